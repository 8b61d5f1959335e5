"""GPU: capture, replay correctness against transformers, the memory report, and fault handling."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from encoder_graphs.config import GraphConfig
from encoder_graphs.execute import split_outputs
from encoder_graphs.memory import GraphMemoryError
from encoder_graphs.recurring import RECURRING_MIN_FREE
from encoder_graphs.runner import EncoderRunner, canonical_order
from models import from_preset, transformers_tower
from models.attention import AttentionBackend
from models.protocol import ItemOutput
from tests.helpers import assert_each_item_is_one_block, random_image, random_video, relative_error, warmed

pytestmark = pytest.mark.gpu

PRESET = "qwen3-vl-2b"
CONFIG = GraphConfig(max_budget_tokens=2048)


@pytest.fixture(scope="module")
def encoder():
    return from_preset(PRESET, dtype=torch.bfloat16, device="cuda", seed=0)


@pytest.fixture(scope="module")
def references(encoder):
    """transformers' tower in float32 (the exact reference) and in bf16 sdpa (its own noise level)."""
    towers = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        towers[name] = transformers_tower(encoder, dtype=dtype)
    return towers


@pytest.fixture(scope="module")
def runner(encoder):
    return warmed(encoder, CONFIG)


def item_errors(references, pixels, specs, outputs):
    """Per item: (our error, transformers bf16 error), both against the float32 reference."""
    errors, row = [], 0
    for spec, out in zip(specs, outputs):
        item = pixels[row : row + spec.input_patches]
        grid = torch.tensor([list(spec.grid_thw)], device="cuda")
        with torch.inference_mode():
            exact = references["fp32"](item.float(), grid_thw=grid)
            bf16 = references["bf16"](item, grid_thw=grid)
        ours = relative_error(out.tokens, exact.pooler_output)
        ours = max(ours, relative_error(out.deepstack, torch.stack(exact.deepstack_features)))
        errors.append((ours, relative_error(bf16.pooler_output, exact.pooler_output)))
        row += spec.input_patches
    return errors


def test_capture_reports_pool_memory(runner):
    summary = runner.memory.summary()
    assert summary["graphs"] == len(runner.entries) > len(runner.table.budgets)  # several buckets per budget
    assert runner.memory.pool_bytes > 0 and runner.memory.peak_allocated_bytes > 0
    assert set(summary["per_budget_mib"]) == set(runner.table.budgets)
    # The pre-capture prediction is an estimate, but must be the right size: it decides whether
    # capture is refused.
    assert 0.5 <= runner.memory.predicted_pool_bytes / runner.memory.pool_bytes <= 2.0, summary
    assert all(e.live and e.replay_ms > 0 for e in runner.entries.values())
    status = runner.warmup_status()
    assert (
        status.full_speed
        and status.graphs_live == status.graphs_total
        and runner.live_budgets() == runner.ladder.budgets
    )


def test_replayed_packs_match_transformers(encoder, runner, references):
    pre = encoder.preprocessor
    rng = np.random.default_rng(0)
    cases = []
    for sizes in ([(224, 224)], [(300, 500)] * 5, [(64, 64)] * 20, [(900, 700)], [(3000, 40)]):
        resized = [pre.resize_image(random_image(rng, h, w)) for h, w in sizes]
        cases.append(("image", resized, [pre.spec("image", 1, *r.shape[-2:]) for r in resized]))
    clip = pre.resize_video(random_video(rng, 8, 360, 480))
    cases.append(("video", [clip], [pre.spec("video", 8, *clip.shape[-2:])]))
    big = pre.resize_image(random_image(rng, 2000, 2000))  # over the largest budget: eager
    cases.append(("image", [big], [pre.spec("image", 1, *big.shape[-2:])]))
    hits_before = sum(runner.stats.graph_hits.values())
    for modality, resized, specs in cases:
        pixels = pre.pixel_values(resized, modality, device="cuda").to(encoder.dtype)
        for ours, theirs in item_errors(references, pixels, specs, runner.run(pixels, specs)):
            assert ours <= 1.5 * theirs + 1e-3, (modality, [s.grid_thw for s in specs], ours, theirs)
        # as a replica serves them: copied to the host in one copy, each item one block
        on_host = runner.run(pixels, specs, output_device="cpu", recurring=False)
        assert all(out.tokens.device.type == "cpu" for out in on_host)
        assert_each_item_is_one_block(on_host)
        back = [ItemOutput(out.tokens.cuda(), out.deepstack.cuda()) for out in on_host]
        for ours, theirs in item_errors(references, pixels, specs, back):
            assert ours <= 1.5 * theirs + 1e-3, (modality, [s.grid_thw for s in specs], ours, theirs)
    assert sum(runner.stats.graph_hits.values()) > hits_before
    assert runner.stats.eager_fallbacks["oversize"] == 2  # the big image, on the GPU and to the host
    assert runner.stats.first_pack_checks > 0 and runner.stats.first_pack_mismatches == 0


@dataclass(frozen=True)
class CountsExact(AttentionBackend):
    """A backend that counts the attention calls that took the exact-segments hint."""

    calls: list = field(default_factory=list, compare=False)

    def exact(self, q, k, v, cu_seqlens, max_seqlen, scale):
        self.calls.append(max_seqlen)
        return super().exact(q, k, v, cu_seqlens, max_seqlen, scale)


def test_eager_equal_segments_take_the_exact_hint_and_match_transformers(encoder, references):
    backend = CountsExact(encoder.attention.kernel)
    counted = from_preset(PRESET, dtype=torch.bfloat16, device="cuda", seed=0, attention=backend)  # the same weights
    pre = counted.preprocessor
    resized = [pre.resize_image(random_image(np.random.default_rng(3), 300, 500)) for _ in range(3)]
    specs = [pre.spec("image", 1, *r.shape[-2:]) for r in resized]
    pixels = pre.pixel_values(resized, "image", device="cuda").to(counted.dtype)
    out = counted.forward_eager(pixels, specs)
    assert len(backend.calls) == counted.tower.config.depth  # every layer attends on the exact layout
    outputs = split_outputs(out, specs)
    for ours, theirs in item_errors(references, pixels, specs, outputs):
        assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


class Broken:
    """Wraps an encoder; its padded forward is multiplied by `scale` at `budget` (a fault to inject)."""

    def __init__(self, encoder, budget):
        self._encoder, self._budget = encoder, budget
        self.scale = torch.ones((), device="cuda", dtype=encoder.dtype)

    def __getattr__(self, name):
        return getattr(self._encoder, name)

    def forward_padded(self, pixel_values, metadata, layout, exact_segments=False):
        out = self._encoder.forward_padded(pixel_values, metadata, layout, exact_segments)
        if layout.token_budget == self._budget:
            out.tokens = out.tokens * self.scale
        return out


def test_self_check_disables_a_deliberately_broken_graph(encoder):
    broken = Broken(encoder, 256)
    broken.scale.fill_(float("nan"))  # captured into the budget-256 graphs
    runner = warmed(broken, GraphConfig(max_budget_tokens=512))
    disabled = {key for key, e in runner.entries.items() if not e.enabled}
    assert disabled == {key for key in runner.entries if key[0] == 256}
    assert runner.stats.disabled_graphs == len(disabled)


def test_graph_that_turns_nonfinite_falls_back_to_eager(encoder, references):
    broken = Broken(encoder, 256)
    # The doubling ladder, so that the pack below (192 tokens) lands in the broken 256 graphs.
    runner = warmed(broken, GraphConfig(max_budget_tokens=512, fine_budget_steps=1))
    assert all(e.live for e in runner.entries.values())
    broken.scale.fill_(float("inf"))  # the graph now produces inf/NaN; eager does not
    pre = encoder.preprocessor
    resized = [pre.resize_image(random_image(np.random.default_rng(1), 256, 256)) for _ in range(3)]
    specs = [pre.spec("image", 1, *r.shape[-2:]) for r in resized]
    assert 128 < sum(s.output_tokens for s in specs) <= 256
    pixels = pre.pixel_values(resized, "image", device="cuda").to(encoder.dtype)
    outputs = runner.run(pixels, specs)
    assert runner.stats.eager_fallbacks["nonfinite"] == 1 and runner.stats.disabled_graphs == 1
    for ours, theirs in item_errors(references, pixels, specs, outputs):
        assert ours <= 1.5 * theirs + 1e-3


def test_ladder_too_big_for_memory_is_refused_before_capture(encoder):
    runner = EncoderRunner(encoder, GraphConfig(max_budget_tokens=4096, memory_fraction=1e-4))
    with pytest.raises(GraphMemoryError, match=r"set max_budget_tokens <= \d+"):
        runner.prepare()
    assert not any(e.graph for e in runner.entries.values())


def test_compiled_exact_route_serves_unseen_shapes_without_compiling(encoder, references):
    """`compile`: packs of equal segments without a graph run compiled on their exact layout.
    After startup, no shape needs a compile: one image (one dense attention batch) and equal
    images (one batch of several), of sizes never seen, larger than every budget. Unequal
    images run compiled there too under attention backend "triton" (one launch per layer), else
    uncompiled (host-bound: see `ExactRoute.takes`); their own recurring graph holds the compiled
    forward either way, still without a compile."""
    from torch._dynamo.utils import counters

    runner = warmed(encoder, GraphConfig(max_budget_tokens=256, compile=True))
    assert runner.warmup_status().compiled and runner.warmup_status().exact_route
    # every graph captured the compiled forward (none fell back to the uncompiled one)
    assert runner.stats.recompile_fallbacks == 0 and all(e.forward is None for e in runner.entries.values())
    compiled_graphs = counters["stats"]["unique_graphs"]
    triton = encoder.attention.kernel == "triton"
    pre = encoder.preprocessor
    rng = np.random.default_rng(5)
    for sizes in ([(1000, 900)], [(700, 500)] * 3, [(800, 600), (400, 300), (420, 560)]):
        resized = [pre.resize_image(random_image(rng, h, w)) for h, w in sizes]
        specs = [pre.spec("image", 1, *r.shape[-2:]) for r in resized]
        assert sum(s.output_tokens for s in specs) > runner.ladder.budgets[-1]
        pixels = pre.pixel_values(resized, "image", device="cuda").to(encoder.dtype)
        with torch.inference_mode():  # as the benchmark calls it; startup compiled without it
            outputs = runner.run(pixels, specs)
        assert runner.stats.last.compiled == (len(set(sizes)) == 1 or triton), sizes
        for ours, theirs in item_errors(references, pixels, specs, outputs):
            assert ours <= 1.5 * theirs + 1e-3, (sizes, ours, theirs)
    assert runner.stats.compiled_exact == 2 + triton and runner.stats.recompile_fallbacks == 0
    assert runner.costs.startup["exact_ms"] and all(ms > 0 for _, ms in runner.costs.startup["exact_ms"])
    assert counters["stats"]["unique_graphs"] == compiled_graphs

    # A recurring pack's own graph is captured on a request with the compiled forward (the exact
    # route's startup compile serves equal and unequal images alike); never a compile.
    for sizes in ([(300, 400)] * 2, [(300, 400), (200, 240)]):
        resized = [pre.resize_image(random_image(rng, h, w)) for h, w in sizes]
        specs = [pre.spec("image", 1, *r.shape[-2:]) for r in resized]
        pixels = pre.pixel_values(resized, "image", device="cuda").to(encoder.dtype)
        uncompiled = runner.stats.recurring_uncompiled
        for _ in range(3):
            outputs = runner.run(pixels, specs)
        for ours, theirs in item_errors(references, pixels, specs, outputs):
            assert ours <= 1.5 * theirs + 1e-3, (sizes, ours, theirs)
        assert runner.stats.recurring_uncompiled == uncompiled, sizes
    stats = runner.stats.snapshot()
    assert stats["recurring_captured"] + sum(stats["recurring_rejected"].values()) == 2, stats
    assert counters["stats"]["unique_graphs"] == compiled_graphs


def test_compile_without_graphs_compiles_every_budget_at_startup(encoder, references):
    """`compile: true`, `cuda_graphs: false`: packs run the compiled forward on the budgets'
    padded layouts. The warm-up compiles it for each and checks it, so no request compiles."""
    from torch._dynamo.utils import counters

    runner = warmed(encoder, GraphConfig(max_budget_tokens=256, compile=True, cuda_graphs=False))
    checked = {key: (e.graph, e.enabled, e.self_check_error) for key, e in runner.entries.items()}
    assert all(graph is None and enabled and error >= 0 for graph, enabled, error in checked.values()), checked
    compiled_graphs = counters["stats"]["unique_graphs"]
    pre = encoder.preprocessor
    rng = np.random.default_rng(6)
    for sizes in ([(224, 224)], [(300, 400), (200, 240)], [(448, 448)], [(200, 200)] * 4):
        resized = [pre.resize_image(random_image(rng, h, w)) for h, w in sizes]
        specs = [pre.spec("image", 1, *r.shape[-2:]) for r in resized]
        pixels = pre.pixel_values(resized, "image", device="cuda").to(encoder.dtype)
        with torch.inference_mode():
            outputs = runner.run(pixels, specs)
        assert runner.stats.last.graph, sizes  # the budget's layout, without a graph
        for ours, theirs in item_errors(references, pixels, specs, outputs):
            assert ours <= 1.5 * theirs + 1e-3, (sizes, ours, theirs)
    assert runner.stats.recompile_fallbacks == 0
    assert counters["stats"]["unique_graphs"] == compiled_graphs


def test_recurring_pack_gets_its_own_graph_and_matches_transformers(encoder, runner, references):
    """A pack seen twice gets a graph of its exact layout (no padding rows), captured on that
    request and kept because it replays faster than its padded graph; later sightings replay it.
    Equal images (dense attention) and unequal ones. A graph no faster than the plan is refused."""
    pre = encoder.preprocessor
    rng = np.random.default_rng(6)
    captured = runner.stats.recurring_captured
    for sizes in ([(640, 640)] * 3, [(640, 640), (512, 512), (640, 640)]):
        resized = [pre.resize_image(random_image(rng, h, w)) for h, w in sizes]
        specs = [pre.spec("image", 1, *r.shape[-2:]) for r in resized]
        tokens = sum(s.output_tokens for s in specs)
        assert 1024 < tokens <= 2048  # the padded graph: budget 2048, a third or more padding
        pixels = pre.pixel_values(resized, "image", device="cuda").to(encoder.dtype)
        for _ in range(3):
            outputs = runner.run(pixels, specs)
            for ours, theirs in item_errors(references, pixels, specs, outputs):
                assert ours <= 1.5 * theirs + 1e-3, (sizes, ours, theirs)
        assert runner.stats.last.recurring, runner.stats.snapshot()
        entry = runner.recurring.entries[tuple(specs[i].grid_thw for i in canonical_order(specs))]
        padded = min(e.replay_ms for e in runner.entries.values() if e.key[0] == 2048 and e.enabled)
        assert entry.graph is not None and entry.layout.token_budget == tokens
        assert entry.dense == (len(set(sizes)) == 1) and 0 < entry.replay_ms < padded
    assert runner.stats.recurring_captured == captured + 2

    runner.recurring.capture(("probe",), pixels, specs, 1e-6, torch.device("cuda"))  # a plan taking 1 ns
    assert runner.stats.recurring_rejected["slower"] == 1 and ("probe",) not in runner.recurring.entries


def test_no_recurring_graph_is_captured_with_too_little_free_memory(encoder, runner, references):
    pre = encoder.preprocessor
    resized = [pre.resize_image(random_image(np.random.default_rng(7), 700, 500))]
    specs = [pre.spec("image", 1, *resized[0].shape[-2:])]
    pixels = pre.pixel_values(resized, "image", device="cuda").to(encoder.dtype)
    before = runner.stats.recurring_rejected["memory"]
    runner.recurring.min_free_bytes = 1 << 50  # more than any GPU has free
    try:
        for _ in range(3):
            outputs = runner.run(pixels, specs)
            assert not runner.stats.last.recurring
    finally:  # the module's runner serves later tests
        runner.recurring.min_free_bytes = RECURRING_MIN_FREE
    assert runner.stats.recurring_rejected["memory"] == before + 1
    for ours, theirs in item_errors(references, pixels, specs, outputs):
        assert ours <= 1.5 * theirs + 1e-3


def test_a_capture_that_fails_without_a_warm_run_is_tried_again_after_one(encoder, references):
    """Only the first capture takes a side-stream warm run; one that fails without (lazy
    initialisation inside a capture) is captured again after one, and serves. The failure is
    raised before the real capture: a capture that fails inside torch 2.11 can leave its caching
    allocator counting a capture underway (pytorch/pytorch#180395, #190308)."""
    runner = EncoderRunner(encoder, GraphConfig(budgets=(64, 256)))
    runner.prepare(progress=lambda message: None)
    capture, warm = runner.capture.capture, runner.capture.warm
    events = []

    def warm_counted(run):
        events.append("warm")
        return warm(run)

    def fails_once_unwarmed(entry, run):
        if entry.key[0] == 64 and events[-1] != "warm":
            events.append("failed")
            raise RuntimeError("operation not permitted when stream is capturing")
        events.append("captured")
        return capture(entry, run)

    runner.capture.warm, runner.capture.capture = warm_counted, fails_once_unwarmed
    runner.warm_up(progress=lambda message: None)
    assert events.count("warm") == 2 and events.count("failed") == 1  # the first capture, the retry
    assert all(e.live for e in runner.entries.values())
    pre = encoder.preprocessor
    resized = [pre.resize_image(random_image(np.random.default_rng(3), 224, 224))]
    specs = [pre.spec("image", 1, *resized[0].shape[-2:])]
    pixels = pre.pixel_values(resized, "image", device="cuda").to(encoder.dtype)
    outputs = runner.run(pixels, specs)
    assert runner.stats.last.graph and runner.stats.last.budget == 64
    for ours, theirs in item_errors(references, pixels, specs, outputs):
        assert ours <= 1.5 * theirs + 1e-3


def test_packs_served_during_a_background_warm_up_and_after_a_start_on_its_record_match_transformers(
    encoder, references, tmp_path, monkeypatch
):
    """Packs served while the warm-up runs in a background thread (eagerly, then on each graph as
    it goes live) agree with transformers as its own bf16 does. The warm-up records its checks; a
    second runner of the same graphs captures them on that record without a checked run, and its
    packs (each graph's first one checked against eager) agree too."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the node key: this test's own
    config = GraphConfig(max_budget_tokens=1024, compile_cache=str(tmp_path / "cache"))
    pre, rng = encoder.preprocessor, np.random.default_rng(7)
    packs = []
    for sizes in ([(224, 224)], [(300, 500)] * 3, [(64, 64)] * 12, [(448, 448), (200, 120)]):
        resized = [pre.resize_image(random_image(rng, h, w)) for h, w in sizes]
        specs = [pre.spec("image", 1, *r.shape[-2:]) for r in resized]
        pixels = pre.pixel_values(resized, "image", device="cuda").to(encoder.dtype)
        packs.append((pixels, specs))
    refused: set = set()
    for later in (False, True):
        runner = EncoderRunner(encoder, config)
        runner.prepare(progress=lambda message: None)
        thread = threading.Thread(target=runner.warm_up, kwargs={"progress": lambda message: None}, daemon=True)
        thread.start()
        served = during = 0
        while thread.is_alive() or served < 2 * len(packs):
            pixels, specs = packs[served % len(packs)]
            with runner.device_lock:
                warming = not runner.warmup_status().full_speed
                outputs = runner.run(pixels, specs)
            for ours, theirs in item_errors(references, pixels, specs, outputs):
                assert ours <= 1.5 * theirs + 1e-3, (later, [s.grid_thw for s in specs], ours, theirs)
            served, during = served + 1, during + warming
        thread.join()
        status = runner.warmup_status()
        assert during and status.full_speed and status.graphs_live == status.graphs_total
        assert status.from_record == later and runner.stats.first_pack_mismatches == 0
        assert runner.stats.first_pack_checks > 0 and sum(runner.stats.graph_hits.values()) > 0
        checked = {key for key, entry in runner.entries.items() if not math.isnan(entry.self_check_error)}
        if later:  # only what the first start did not make live is checked at startup again
            assert checked <= refused
        else:
            refused = {key for key, entry in runner.entries.items() if not entry.live}
            assert checked >= set(runner.entries) - refused
    assert len(list(runner.compile_cache.path.glob("warmup-*.json"))) == 1
