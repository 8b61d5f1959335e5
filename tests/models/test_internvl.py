"""InternVL: tiles through our runner equal transformers' `get_image_features` on the processor's output."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from encoder_graphs.config import GraphConfig
from models import CheckpointError, from_checkpoint, from_preset, transformers_tower
from models.internvl import InternVLEncoder
from models.presets import PRESETS
from models.protocol import ItemSpec, VisionEncoder
from models.tiling import patch_rows
from models.tiny_checkpoint import build_tiny_processor, save_tiny_vlm
from tests.helpers import random_image, random_video, reference_tiles, relative_error, warmed

TOLERANCE = 1e-4
BUDGETS = (256, 512, 1024, 2048, 4096, 8192)
FIXED_SIZES = [(448, 448), (100, 1300), (2000, 2000), (300, 2100)]
"""(height, width): one tile, 12 tiles + thumbnail, a 3x3 grid + thumbnail, 7 tiles + thumbnail."""


@pytest.fixture(scope="module")
def encoder():
    return from_preset("internvl-tiny", seed=1)


@pytest.fixture(scope="module")
def reference(encoder):
    return transformers_tower(encoder)


@pytest.fixture(scope="module")
def processor():
    """transformers' InternVLProcessor with the tiny preset's image and video processors."""
    return build_tiny_processor("internvl")


def image_sizes(rng: np.random.Generator, count: int) -> list[tuple[int, int]]:
    """The fixed sizes, then random aspect ratios (1:13 to 13:1) and areas."""
    sizes = list(FIXED_SIZES)
    while len(sizes) < count:
        aspect = float(np.exp(rng.uniform(np.log(1 / 13), np.log(13))))
        area = float(rng.uniform(60**2, 1100**2))
        sizes.append((max(1, round((area / aspect) ** 0.5)), max(1, round((area * aspect) ** 0.5))))
    return sizes


def processor_pixels(processor, image: torch.Tensor) -> torch.Tensor:
    """`[tiles, 3, 448, 448]`: what InternVLProcessor gives the model for one image."""
    return processor(images=[image], text=["<IMG_CONTEXT>"], return_tensors="pt")["pixel_values"]


def test_tiles_are_the_processors_own_pixel_values(encoder, processor):
    pre = encoder.preprocessor
    rng = np.random.default_rng(0)
    for height, width in image_sizes(rng, 10):
        image = random_image(rng, height, width)
        expected = processor_pixels(processor, image)
        spec = pre.image_spec(height, width)
        assert spec == ItemSpec("image", (expected.shape[0], 32, 32), expected.shape[0] * 1024, expected.shape[0] * 256)
        tiles = pre.resize_image(image)
        assert tiles.dtype == torch.uint8 and tiles.shape == (spec.grid_thw[0], 3, 448, 448)
        assert torch.equal(pre.pixel_values([tiles], "image"), patch_rows(expected, 14))
    clip = random_video(rng, 5, 120, 160)
    expected = processor(videos=[clip], text=["<video>"], return_tensors="pt")["pixel_values"]
    assert pre.video_spec(5, 120, 160).grid_thw == (5, 32, 32) == (expected.shape[0], 32, 32)
    assert torch.equal(pre.pixel_values([pre.resize_video(clip)], "video"), patch_rows(expected, 14))


def test_30_images_packed_through_the_runner_equal_get_image_features(encoder, reference, processor):
    """Packs of whole images padded with zero tiles to a budget, then all 30 in one (eager) pack."""
    pre = encoder.preprocessor
    rng = np.random.default_rng(1)
    images = [random_image(rng, h, w) for h, w in image_sizes(rng, 30)]
    specs = [pre.image_spec(*image.shape[-2:]) for image in images]
    assert {1, 13} <= {spec.grid_thw[0] for spec in specs}
    resized = [pre.resize_image(image) for image in images]
    expected = [reference_tiles(reference, processor_pixels(processor, image)) for image in images]
    runner = warmed(encoder, GraphConfig(budgets=BUDGETS, min_seqlen_bucket=1024, max_items_per_pack=32))
    packs, pack = [], []
    for index in rng.permutation(len(images)).tolist():
        if pack and sum(specs[i].output_tokens for i in pack) + specs[index].output_tokens > BUDGETS[-1]:
            packs.append(pack)
            pack = []
        pack.append(index)
    packs += [pack, list(range(len(images)))]
    for pack in packs:
        pixel_values = pre.pixel_values([resized[i] for i in pack], "image")
        outputs = runner.run(pixel_values, [specs[i] for i in pack])
        for index, output in zip(pack, outputs):
            assert output.tokens.shape == expected[index].shape
            assert relative_error(output.tokens, expected[index]) <= TOLERANCE, (index, specs[index])
    stats = runner.stats.snapshot()
    assert sum(stats["graph_hits"].values()) == len(packs) - 1 and stats["eager_fallbacks"]["oversize"] == 1, stats


def test_videos_are_frames_as_tiles(encoder, reference, processor):
    pre = encoder.preprocessor
    rng = np.random.default_rng(2)
    clips = [random_video(rng, frames, 96, 128) for frames in (3, 6)]
    specs = [pre.video_spec(clip.shape[0], 96, 128) for clip in clips]
    runner = warmed(encoder, GraphConfig(budgets=BUDGETS, min_seqlen_bucket=1024))
    outputs = runner.run(pre.pixel_values([pre.resize_video(c) for c in clips], "video"), specs)
    for clip, output in zip(clips, outputs):
        pixels = processor(videos=[clip], text=["<video>"], return_tensors="pt")["pixel_values"]
        assert relative_error(output.tokens, reference_tiles(reference, pixels)) <= TOLERANCE


def test_padded_and_exact_runs_agree_on_items_that_are_not_whole_tiles(encoder):
    """The runner's self-check packs have grids of any size: their rows run as consecutive tiles in
    every path, so a padded budget and the exact layout agree on them."""
    specs = [ItemSpec("image", (1, 44, 44), 1936, 484), ItemSpec("image", (1, 20, 44), 880, 220)]
    rows = sum(s.input_patches for s in specs)
    pixels = torch.randn(rows, encoder.patch_dim, generator=torch.Generator().manual_seed(0))
    exact = encoder.forward_eager(pixels, specs).tokens
    layout = encoder.pack_layout(1024, 4096, 8)
    padded = torch.cat([pixels, torch.zeros(1024 * encoder.merge_unit - rows, encoder.patch_dim)])
    tokens = encoder.forward_padded(padded, encoder.pack_metadata(specs, layout), layout).tokens
    assert torch.equal(tokens[: exact.shape[0]], exact)


@pytest.mark.parametrize(
    "vision,top",
    [
        ({"use_mean_pooling": False}, {}),  # a final layer norm after the last layer
        ({"use_qk_norm": True, "norm_type": "rms_norm"}, {}),
        ({"use_mean_pooling": False}, {"vision_feature_layer": -2}),  # no final norm on earlier layers
        ({}, {"vision_feature_layer": 1}),
    ],
)
def test_config_variants_match_get_image_features(vision, top, processor):
    tiny = PRESETS["internvl-tiny"]
    preset = dataclasses.replace(tiny, vision_config={**tiny.vision_config, **vision})
    config = InternVLEncoder.preset_tower_config(preset)
    for name, value in top.items():
        setattr(config, name, value)
    torch.manual_seed(4)
    tower = InternVLEncoder.build_tower(config, torch.float32, "cpu")
    encoder = InternVLEncoder(tower, from_preset(tiny).preprocessor, "variant")
    reference = transformers_tower(encoder)
    image = random_image(np.random.default_rng(3), 300, 700)
    pixels = processor_pixels(processor, image)
    spec = encoder.preprocessor.image_spec(300, 700)
    ours = encoder.forward_eager(patch_rows(pixels, 14), [spec]).tokens
    assert relative_error(ours, reference_tiles(reference, pixels)) <= TOLERANCE


def test_the_adapter_speaks_the_protocol(encoder):
    assert isinstance(encoder, VisionEncoder)
    assert (encoder.merge_unit, encoder.patch_dim, encoder.min_item_tokens) == (4, 3 * 14 * 14, 256)
    assert encoder.metadata_specs(encoder.pack_layout(512, 1024, 4)) == {}


def test_class_token_and_position_embeddings_are_random_in_presets(encoder):
    embeddings = encoder.tower.vision_tower.embeddings
    assert embeddings.cls_token.abs().sum() > 0 and embeddings.position_embeddings.abs().sum() > 0


# ---- checkpoints ----


def test_full_tiny_checkpoint_loads_and_matches_its_model(tmp_path, processor):
    model = save_tiny_vlm("internvl", tmp_path, seed=3)
    encoder = from_checkpoint(str(tmp_path))
    assert encoder.family == "internvl" and encoder.min_item_tokens == 256
    rng = np.random.default_rng(4)
    images = [random_image(rng, 120, 333), random_image(rng, 64, 64), random_image(rng, 500, 90)]
    pixels = [processor_pixels(processor, image) for image in images]
    specs = [encoder.preprocessor.image_spec(*image.shape[-2:]) for image in images]
    ours = encoder.forward_eager(patch_rows(torch.cat(pixels), 14), specs).tokens
    with torch.inference_mode():
        expected = model.get_image_features(torch.cat(pixels)).pooler_output.flatten(0, 1)
    assert relative_error(ours, expected) <= 1e-5


def save_vision_only(encoder, directory, prefix: str = "model.") -> None:
    """A vision-only InternVL checkpoint: the VLM config, the tower's and projector's weights only."""
    encoder.tower.config.save_pretrained(directory)
    state = {prefix + key: value.contiguous() for key, value in encoder.tower.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))


@pytest.mark.parametrize("prefix", ["model.", ""])
def test_vision_only_checkpoint_loads(tmp_path, prefix):
    """With transformers' `model.` prefix, or without it (checkpoints saved before it)."""
    source = from_preset("internvl-tiny", seed=5)
    save_vision_only(source, tmp_path, prefix)
    loaded = from_checkpoint(str(tmp_path), family="internvl")
    state = loaded.tower.state_dict()
    for name, tensor in source.tower.state_dict().items():
        assert torch.equal(state[name], tensor), name
    pixels = torch.randn(2048, source.patch_dim)
    specs = [ItemSpec("image", (2, 32, 32), 2048, 512)]
    assert torch.equal(loaded.forward_eager(pixels, specs).tokens, source.forward_eager(pixels, specs).tokens)


def test_a_missing_projector_weight_is_named(tmp_path):
    source = from_preset("internvl-tiny")
    save_vision_only(source, tmp_path)
    dropped = "multi_modal_projector.linear_2.bias"
    state = {f"model.{k}": v for k, v in source.tower.state_dict().items() if k != dropped}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing \['multi_modal_projector\.linear_2\.bias'\]"):
        from_checkpoint(str(tmp_path))


def test_an_unexpected_vision_weight_is_named(tmp_path):
    source = from_preset("internvl-tiny")
    save_vision_only(source, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["vision_config"]["num_hidden_layers"] = 1  # the checkpoint has a second layer
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"unexpected \['vision_tower\.encoder\.layer\.1\."):
        from_checkpoint(str(tmp_path))


def test_family_mismatch_names_both_families(tmp_path):
    save_tiny_vlm("internvl", tmp_path, seed=3)
    with pytest.raises(CheckpointError, match="internvl model, but family 'qwen3-vl'"):
        from_checkpoint(str(tmp_path), family="qwen3-vl")


def test_zero_sized_items_are_refused(encoder):
    from models import InvalidItemError

    with pytest.raises(InvalidItemError, match="zero size"):
        encoder.preprocessor.image_spec(0, 10)
    with pytest.raises(InvalidItemError, match="no frames"):
        encoder.preprocessor.video_spec(0, 10, 10)


def test_compiled_forward_serves_every_tile_count_without_recompiling(encoder):
    """The compiled layer (dynamic shapes) traces once and serves other tile counts unchanged;
    transformers' pixel shuffle, which dynamo could not guard (`height % 0.5`), stays outside it."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled = encoder.compiled_forward(functools.partial(torch.compile, dynamic=True, backend="aot_eager"))
    traced = counters["stats"]["unique_graphs"]
    try:
        for tiles in (2, 3, 5):
            rows = torch.randn(tiles * encoder.tower.tile_patches, encoder.patch_dim)
            layout = encoder.pack_layout(tiles * encoder.tower.tile_patches // encoder.merge_unit, 0, 0)
            stance = torch.compiler.set_stance("fail_on_recompile") if tiles > 2 else contextlib.nullcontext()
            with torch.no_grad(), stance:
                assert torch.equal(compiled(rows, {}, layout).tokens, encoder.forward_padded(rows, {}, layout).tokens)
        assert counters["stats"]["unique_graphs"] > traced  # it ran compiled, once traced for every count
    finally:
        torch._dynamo.reset()
