"""The padded static forward gives, per item, what transformers' own tower gives for that item alone."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from models import attention, from_preset
from models.attention import AttentionBackend
from models.protocol import segment_groups
from models.qwen import FusedGateUpMLP, GeluEpilogueMLP, PatchLinear
from tests.helpers import FAMILY_TINY, random_image, random_video, reference_item, reference_tower, relative_error

PACKS_PER_FAMILY = 50
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILY_TINY))
def family_setup(request):
    encoder = from_preset(FAMILY_TINY[request.param], seed=1)
    return encoder, reference_tower(encoder)


def random_item(rng: np.random.Generator, encoder):
    """A resized uint8 item and its spec: images of random size and aspect ratio, or short videos."""
    pre = encoder.preprocessor
    if rng.random() < 0.25:
        frames = int(rng.integers(2, 7))
        clip = random_video(rng, frames, int(rng.integers(40, 160)), int(rng.integers(40, 160)))
        resized = pre.resize_video(clip)
        return resized, pre.spec("video", frames, *resized.shape[-2:])
    aspect = float(np.exp(rng.uniform(np.log(1 / 12), np.log(12))))
    area = float(rng.uniform(20 * 20, 420 * 420))
    height = max(1, int(round((area / aspect) ** 0.5)))
    width = max(1, int(round((area * aspect) ** 0.5)))
    resized = pre.resize_image(random_image(rng, height, width))
    return resized, pre.spec("image", 1, *resized.shape[-2:])


def test_padded_packs_match_transformers_per_item(family_setup):
    encoder, reference = family_setup
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(PACKS_PER_FAMILY):
        modality = "video" if rng.random() < 0.3 else "image"
        items = []
        while len(items) < int(rng.integers(1, 9)):
            resized, spec = random_item(rng, encoder)
            if spec.modality == modality:
                items.append((resized, spec))
        specs = [spec for _, spec in items]
        tokens = sum(s.output_tokens for s in specs)
        budget = 1 << (tokens + int(rng.integers(0, 300))).bit_length()
        max_seqlen = max(max(s.frame_patches for s in specs), int(rng.integers(16, 2048)))
        layout = encoder.pack_layout(budget, max_seqlen, sum(s.grid_thw[0] for s in specs) + int(rng.integers(0, 8)))

        pixel_values = [encoder.preprocessor.pixel_values([r], modality) for r, _ in items]
        buffer = torch.full((budget * encoder.merge_unit, encoder.patch_dim), 0.0)
        buffer[: sum(p.shape[0] for p in pixel_values)] = torch.cat(pixel_values)
        out = encoder.forward_padded(buffer, encoder.pack_metadata(specs, layout), layout)

        start = 0
        for pixels, spec in zip(pixel_values, specs):
            expected, expected_deepstack = reference_item(reference, pixels, spec.grid_thw)
            got = out.tokens[start : start + spec.output_tokens]
            assert got.shape == expected.shape
            worst = max(worst, relative_error(got, expected))
            if expected_deepstack is not None:
                got_deepstack = out.deepstack[:, start : start + spec.output_tokens]
                worst = max(worst, relative_error(got_deepstack, expected_deepstack))
            else:
                assert out.deepstack is None
            start += spec.output_tokens
    print(f"{encoder.family}: worst relative error {worst:.2e}")
    assert worst <= TOLERANCE, f"{encoder.family}: worst relative error {worst:.2e}"


def test_eager_forward_matches_transformers(family_setup):
    encoder, reference = family_setup
    pre = encoder.preprocessor
    rng = np.random.default_rng(1)
    images = [pre.resize_image(random_image(rng, h, w)) for h, w in [(90, 300), (200, 200), (333, 77)]]
    videos = [pre.resize_video(random_video(rng, frames, 96, 128)) for frames in (2, 5)]
    for modality, resized in (("image", images), ("video", videos)):
        specs = [pre.spec(modality, r.shape[0] if modality == "video" else 1, *r.shape[-2:]) for r in resized]
        pixels = pre.pixel_values(resized, modality)
        out = encoder.forward_eager(pixels, specs)
        start = row = 0
        for spec in specs:
            expected, _ = reference_item(reference, pixels[row : row + spec.input_patches], spec.grid_thw)
            assert relative_error(out.tokens[start : start + spec.output_tokens], expected) <= TOLERANCE
            start += spec.output_tokens
            row += spec.input_patches


def test_padding_content_cannot_leak_into_real_rows(family_setup):
    """Garbage (huge values) in the padding rows leaves the real items' outputs unchanged."""
    encoder, _ = family_setup
    rng = np.random.default_rng(2)
    resized = encoder.preprocessor.resize_image(random_image(rng, 200, 260))
    spec = encoder.preprocessor.spec("image", 1, *resized.shape[-2:])
    pixels = encoder.preprocessor.pixel_values([resized], "image")
    layout = encoder.pack_layout(512, 1024, 4)
    metadata = encoder.pack_metadata([spec], layout)
    clean = torch.zeros(512 * encoder.merge_unit, encoder.patch_dim)
    clean[: spec.input_patches] = pixels
    dirty = clean.clone()
    dirty[spec.input_patches :] = 1e4
    a = encoder.forward_padded(clean, metadata, layout).tokens[: spec.output_tokens]
    b = encoder.forward_padded(dirty, metadata, layout).tokens[: spec.output_tokens]
    assert torch.isfinite(b).all()
    assert relative_error(b, a) <= 1e-6


def test_patch_embedding_runs_as_a_matmul_equal_to_the_conv(family_setup):
    encoder, reference = family_setup
    proj = encoder.tower.patch_embed.proj
    assert isinstance(proj, PatchLinear)
    assert isinstance(reference.patch_embed.proj, torch.nn.Conv3d)
    assert set(encoder.tower.state_dict()) == set(reference.state_dict())
    config = encoder.tower.config
    patches = torch.randn(37, config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
    expected = reference.patch_embed.proj(patches)
    got = proj(patches)
    assert got.shape == expected.shape
    assert relative_error(got, expected) < 1e-5  # float32 summation order only
    with pytest.raises(ValueError, match="single"):
        proj(torch.randn(2, config.in_channels, config.temporal_patch_size, 2 * config.patch_size, config.patch_size))


EXPECTED_MLP = {"qwen2-vl": None, "qwen2.5-vl": FusedGateUpMLP, "qwen3-vl": GeluEpilogueMLP}


def test_fused_mlps_compute_transformers_mlp_with_the_same_weights(family_setup):
    """Qwen3-VL's tanh-GELU MLPs take the epilogue module (its CUDA branch is checked against
    transformers in the GPU parity tests; on CPU it is transformers' MLP), Qwen2.5-VL's gated
    MLPs the one-matmul module; the state dict is unchanged and loading one reaches the fused
    weights."""
    encoder, reference = family_setup
    expected = EXPECTED_MLP[encoder.family]
    kinds = {type(block.mlp) for block in encoder.tower.blocks}
    assert kinds == ({expected} if expected else {type(reference.blocks[0].mlp)})
    assert set(encoder.tower.state_dict()) == set(reference.state_dict())
    width = next(m for m in reference.blocks[0].mlp.modules() if isinstance(m, torch.nn.Linear)).in_features
    hidden = torch.randn(23, width)
    for mine, theirs in zip(encoder.tower.blocks, reference.blocks):
        assert relative_error(mine.mlp(hidden), theirs.mlp(hidden)) < 1e-6
    if expected is FusedGateUpMLP:
        mlp = encoder.tower.blocks[0].mlp
        assert not hasattr(mlp, "gate_proj") and not hasattr(mlp, "up_proj")  # one storage, no aliases
        state = {k: torch.randn_like(v) for k, v in reference.state_dict().items()}
        encoder.tower.load_state_dict(state, strict=True)
        reference.load_state_dict(state, strict=True)
        try:
            assert relative_error(mlp(hidden), reference.blocks[0].mlp(hidden)) < 1e-6
        finally:  # the module-scoped fixture's towers are shared with later tests
            original = from_preset(FAMILY_TINY[encoder.family], seed=1).tower.state_dict()
            encoder.tower.load_state_dict(original, strict=True)
            reference.load_state_dict(original, strict=True)


@dataclass(frozen=True)
class RecordingBackend(AttentionBackend):
    """The sdpa backend, recording (count, length) of every dense attention batch it runs."""

    calls: list = field(default_factory=list, compare=False)

    def dense(self, q, k, v, length, scale):
        self.calls.append((q.shape[0] // length, length))
        return super().dense(q, k, v, length, scale)


def test_exact_hint_reaches_exactly_the_full_attention_layers(family_setup):
    """Exact-layout (eager) packs tell attention their segment lengths: every full-attention layer
    runs each run of equal segments as one dense batch (cuDNN on CUDA; SDPA here), window layers
    and padded packs keep per-segment attention, and the outputs are transformers' per item."""
    encoder, reference = family_setup
    backend = RecordingBackend("sdpa")
    recorded = from_preset(FAMILY_TINY[encoder.family], seed=1, attention=backend)  # the fixture's weights
    assert recorded.tower.config._attn_implementation == backend.implementation != encoder.attention.implementation
    config = recorded.tower.config
    full_layers = len(getattr(config, "fullatt_block_indexes", range(config.depth)))
    pre = recorded.preprocessor
    rng = np.random.default_rng(7)
    sizes = ((100, 140), (100, 140), (60, 60), (100, 140))
    resized = [pre.resize_image(random_image(rng, h, w)) for h, w in sizes]
    specs = [pre.spec("image", 1, *r.shape[-2:]) for r in resized]
    pixels = pre.pixel_values(resized, "image")
    out = recorded.forward_eager(pixels, specs)
    lengths = [s.frame_patches for s in specs]
    assert lengths[0] != lengths[2]
    assert backend.calls == [(2, lengths[0]), (1, lengths[2]), (1, lengths[3])] * full_layers
    row = token = 0
    for spec in specs:
        expected, _ = reference_item(reference, pixels[row : row + spec.input_patches], spec.grid_thw)
        assert relative_error(out.tokens[token : token + spec.output_tokens], expected) < TOLERANCE
        row, token = row + spec.input_patches, token + spec.output_tokens

    backend.calls.clear()  # a padded pack: no hint, no dense batch
    layout = recorded.pack_layout(1024, 1024, 8)
    padded = torch.zeros(1024 * recorded.merge_unit, recorded.patch_dim)
    padded[: pixels.shape[0]] = pixels
    recorded.forward_padded(padded, recorded.pack_metadata(specs, layout), layout)
    assert backend.calls == []
    encoder.forward_eager(pixels, specs)  # another encoder's backend: not this one's calls
    assert backend.calls == []


def test_exact_attention_groups_runs_and_falls_back_where_lengths_do_not_fit():
    """The grouped op against attention written out per segment (softmax(q k^T * scale) v): runs
    of equal segments as dense batches; lengths that do not describe the rows, none set, or more
    than `max_groups` runs take the per-segment (varlen) path. The result is the same every way."""
    torch.manual_seed(0)
    lengths = [5, 5, 5, 3, 7, 7]
    q, k, v = (torch.randn(sum(lengths), 2, 8, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    pieces, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))  # [heads, n, dim]
        pieces.append((torch.softmax(qs @ ks.transpose(1, 2) * 0.3, dim=-1) @ vs).transpose(0, 1))
        start += n
    expected = torch.cat(pieces)
    backend = RecordingBackend("sdpa")
    assert segment_groups([5, 5, 0, 5, 3, 7, 7]) == [(3, 5), (1, 3), (2, 7)]
    with attention.exact_segments(lengths):
        got = attention.exact_attention(q, k, v, cu, 7, 0.3, backend.register())  # the op finds its backend
    assert backend.calls == [(3, 5), (1, 3), (2, 7)]
    assert relative_error(got, expected) < 1e-6
    for wrong in ([5, 5, 5, 3, 7, 6], [5, 5, 5, 3, 14], None):
        backend.calls.clear()
        with attention.exact_segments(wrong) if wrong else contextlib.nullcontext():
            assert relative_error(backend.exact(q, k, v, cu, 7, 0.3), expected) < 1e-6
        assert backend.calls == []
    few = RecordingBackend("sdpa", max_groups=2)
    with attention.exact_segments(lengths):
        assert relative_error(few.exact(q, k, v, cu, 7, 0.3), expected) < 1e-6
    assert few.calls == []


def test_one_exact_compile_serves_equal_and_unequal_packs():
    """The segment lengths never reach torch.compile (the op reads them at run time): once the
    exact forward is compiled for one image and for several equal ones (the runner's warm-up),
    packs of unequal segments, other counts and other sizes run without a recompile. Dynamo's
    guards are the same with the "eager" backend, so this runs on CPU in seconds."""
    import torch._dynamo

    encoder = from_preset(FAMILY_TINY["qwen3-vl"], seed=1)
    pre = encoder.preprocessor
    rng = np.random.default_rng(17)
    torch._dynamo.reset()
    compiled = encoder.compiled_forward(functools.partial(torch.compile, backend="eager", dynamic=True))

    def run(sizes):
        resized = [pre.resize_image(random_image(rng, h, w)) for h, w in sizes]
        specs = [pre.spec("image", 1, *r.shape[-2:]) for r in resized]
        pixels = pre.pixel_values(resized, "image")
        out = encoder.forward_eager(pixels, specs, forward=compiled)
        want = encoder.forward_eager(pixels, specs)
        assert relative_error(out.tokens, want.tokens) < 1e-5

    try:
        with torch.no_grad():
            run([(256, 256)])
            run([(192, 192)] * 2)
            with torch.compiler.set_stance("fail_on_recompile"):
                run([(256, 256), (128, 192), (128, 192)])
                run([(96, 96), (320, 200), (200, 320), (96, 96), (64, 64)])
                run([(224, 224)] * 3)
    finally:
        torch._dynamo.reset()


def test_varlen_kernel_is_chosen_by_backend_and_max_seqlen():
    """Routing only (the kernels themselves are GPU-tested in tests/models/test_gpu_attention.py):
    under "cudnn", layouts of max_seqlen >= CUDNN_MIN_SEQLEN take its varlen kernel, shorter ones
    FlashAttention-2's; "flash" always FlashAttention-2; "triton" ours at 16-byte head rows."""
    threshold = attention.CUDNN_MIN_SEQLEN
    cudnn, flash, triton = (AttentionBackend(kernel) for kernel in ("cudnn", "flash", "triton"))
    assert [cudnn.varlen_kernel(n, 72) for n in (threshold // 2, threshold, threshold * 8)] == [
        "flash",
        "cudnn",
        "cudnn",
    ]
    assert flash.varlen_kernel(threshold * 8, 72) == "flash"
    assert triton.varlen_kernel(64, 72) == "triton" and triton.varlen_kernel(64, 36) == "flash"
    fa3, long = AttentionBackend("fa3"), attention.FA3_MIN_SEQLEN
    assert fa3.varlen_kernel(long, 72) == fa3.varlen_kernel(8192, 80) == "fa3"
    assert fa3.varlen_kernel(long - 1, 72) == fa3.varlen_kernel(784, 80) == "triton"  # small images: ours
    assert fa3.varlen_kernel(8192, 36) == "flash"  # rows neither can load: FlashAttention-2
    assert fa3.varlen_kernel(attention.TRITON_GRAPH_BUCKETS[0], 72) == "triton"  # small images' graphs: ours
    assert fa3.varlen_kernel(8192, 264) == "triton"  # wider than FlashAttention-3 is built for


@pytest.mark.parametrize(
    ("kernel", "groups", "max_seqlen", "head_dim", "launch_bound", "dense"),
    [
        ("flash", [(2, 784), (1, 256)], 784, 72, True, True),  # FlashAttention-2: a dense call per run
        ("cudnn", [(4, 784)], 784, 72, True, True),  # one run: one dense batch
        ("cudnn", [(1, 3136), (2, 784)], 3136, 72, False, False),  # several runs: one cuDNN varlen call
        ("cudnn", [(1, 256), (2, 64)], 256, 80, False, True),  # below cuDNN's varlen threshold
        ("triton", [(4, 784)], 784, 72, False, True),  # in a graph: dense cuDNN on short segments
        ("triton", [(4, 784)], 784, 72, True, False),  # outside one: the Triton kernel's cheaper launch
        ("triton", [(1, 5000)], 5000, 72, False, False),  # long, narrow head: Triton (TMA loads)
        ("triton", [(1, 5000)], 5000, 80, False, True),  # long at a head dim of 80: dense cuDNN
        ("triton", [(1, 1024), (2, 784)], 1024, 80, False, False),  # several runs: one Triton launch
        ("fa3", [(1, 5000)], 5000, 80, False, False),  # long: one FlashAttention-3 launch, always
        ("fa3", [(1, 2048), (2, 784)], 2048, 72, True, False),
        ("fa3", [(4, 784)], 784, 72, False, True),  # short: as under "triton"
        ("fa3", [(4, 784)], 784, 72, True, False),
        ("fa3", [(1, 2048)], 2048, 264, False, True),  # a head wider than FlashAttention-3 takes: as "triton"
    ],
)
def test_exact_layouts_pick_dense_batches_or_one_varlen_launch(
    kernel, groups, max_seqlen, head_dim, launch_bound, dense
):
    assert AttentionBackend(kernel).dense_on_cuda(groups, max_seqlen, head_dim, launch_bound) is dense


def test_backends_answer_what_the_graph_runner_asks():
    triton, cudnn, fa3 = AttentionBackend("triton"), AttentionBackend("cudnn"), AttentionBackend("fa3")
    assert triton.graph_seqlen_buckets(8192) == (1024, 4096, 8192) and triton.graph_seqlen_buckets(1024) == (1024,)
    assert fa3.graph_seqlen_buckets(8192) == (1024, 4096, 8192) and fa3.exact_in_one_call([784, 256])
    assert cudnn.graph_seqlen_buckets(8192) is None  # one bucket per doubling
    assert cudnn.exact_in_one_call([784, 784]) and not cudnn.exact_in_one_call([784, 256])
    assert triton.exact_in_one_call([784, 256])
    assert AttentionBackend.resolve("triton", "cpu") == AttentionBackend("sdpa")  # CPU has one path
    with pytest.raises(ValueError, match="not one of"):
        AttentionBackend("sdpa2")
