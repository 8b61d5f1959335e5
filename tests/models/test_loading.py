"""Loading vision towers from checkpoints: full VLMs, vision-only towers, and clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models import CheckpointError, family_class, from_checkpoint, from_preset, vlm_config
from models.presets import PRESETS
from models.tiny_checkpoint import save_tiny_vlm
from tests.helpers import random_image, relative_error


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_full_vlm_checkpoint_gives_get_image_features(family, tmp_path):
    model = save_tiny_vlm(family, tmp_path, seed=3)
    encoder = from_checkpoint(str(tmp_path))
    assert encoder.family == family

    rng = np.random.default_rng(0)
    images = [random_image(rng, 120, 333), random_image(rng, 64, 64)]
    inputs = encoder.preprocessor.image_processor(images=images, return_tensors="pt")
    with torch.inference_mode():
        expected = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    specs = [encoder.preprocessor.spec("image", 1, *encoder.preprocessor.resize_image(i).shape[-2:]) for i in images]
    ours = encoder.forward_eager(inputs["pixel_values"], specs)
    assert relative_error(ours.tokens, torch.cat(expected.pooler_output)) <= 1e-5
    if family == "qwen3-vl":
        for layer, features in enumerate(expected.deepstack_features):
            assert relative_error(ours.deepstack[layer], torch.cat(features)) <= 1e-5


def test_vision_only_checkpoint_loads(tmp_path):
    source = from_preset("qwen2-vl-tiny", seed=5)
    source.tower.save_pretrained(tmp_path)
    loaded = from_checkpoint(str(tmp_path), family="qwen2-vl")
    for name, tensor in source.tower.state_dict().items():
        assert torch.equal(loaded.tower.state_dict()[name], tensor), name


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        from_checkpoint(str(tmp_path / "nope"))


def test_directory_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        from_checkpoint(str(tmp_path))


def test_non_vlm_checkpoint_names_what_was_found(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(CheckpointError, match="model_type 'llama'"):
        from_checkpoint(str(tmp_path))


def test_family_mismatch_names_both_families(tmp_path):
    save_tiny_vlm("qwen2.5-vl", tmp_path, seed=3)
    with pytest.raises(CheckpointError, match="qwen2.5-vl model, but family 'qwen3-vl'"):
        from_checkpoint(str(tmp_path), family="qwen3-vl")


def test_unexpected_or_missing_keys_are_named(tmp_path):
    source = from_preset("qwen2-vl-tiny")
    source.tower.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["depth"] = PRESETS["qwen2-vl-tiny"].vision_config["depth"] + 1  # one block too many in the config
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"missing \['blocks\.2\."):
        from_checkpoint(str(tmp_path))


def test_processors_saved_nested_in_processor_config_are_used(tmp_path):
    """transformers >= 5.2x writes image/video processors inside processor_config.json only."""
    from models.tiny_checkpoint import build_tiny_processor

    model = family_class("qwen3-vl").vlm_class(vlm_config("tiny", "qwen3-vl"))
    model.save_pretrained(tmp_path)
    build_tiny_processor("qwen3-vl").save_pretrained(tmp_path)
    encoder = from_checkpoint(str(tmp_path))
    expected = from_preset("qwen3-vl-tiny").preprocessor
    assert encoder.preprocessor.patch_size == expected.patch_size == 16
    assert dict(encoder.preprocessor.image_processor.size) == dict(expected.image_processor.size)
    assert dict(encoder.preprocessor.video_processor.size) == dict(expected.video_processor.size)
