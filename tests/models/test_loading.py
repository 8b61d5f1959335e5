"""Loading vision towers from checkpoints: full VLMs, vision-only towers, and clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models import CheckpointError, family_class, from_checkpoint, from_preset, vlm_config
from models.presets import PRESETS
from tests.helpers import random_image, relative_error


def save_tiny_vlm(family: str, directory, seed: int = 3):
    """A tiny full VLM written with transformers' own `save_pretrained`, processors included."""
    torch.manual_seed(seed)
    model = family_class(family).vlm_class(vlm_config("tiny", family)).eval()
    model.save_pretrained(directory)
    reference = from_preset(f"{family}-tiny")  # only for its processors, saved beside the weights
    reference.preprocessor.image_processor.save_pretrained(directory)
    reference.preprocessor.video_processor.save_pretrained(directory)
    return model


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_full_vlm_checkpoint_gives_get_image_features(family, tmp_path):
    model = save_tiny_vlm(family, tmp_path)
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
    save_tiny_vlm("qwen2.5-vl", tmp_path)
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
