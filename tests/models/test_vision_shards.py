"""An encoder given a hub id fetches only the shards of a full VLM that hold its tower's weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from models import family_class, from_checkpoint
from models.loading import SAFETENSORS_INDEX, fetch_vision_weights, vision_shards
from models.qwen import QwenVisionEncoder
from models.tiny_checkpoint import save_tiny_vlm

QWEN = QwenVisionEncoder.checkpoint_prefixes

QWEN3_VL_8B_LIKE = {
    "metadata": {"total_size": 17_534_247_392},
    "weight_map": {
        "lm_head.weight": "model-00004-of-00004.safetensors",
        "model.language_model.embed_tokens.weight": "model-00001-of-00004.safetensors",
        "model.language_model.layers.0.mlp.down_proj.weight": "model-00001-of-00004.safetensors",
        "model.language_model.layers.20.mlp.down_proj.weight": "model-00002-of-00004.safetensors",
        "model.language_model.layers.30.mlp.down_proj.weight": "model-00003-of-00004.safetensors",
        "model.visual.blocks.0.attn.qkv.weight": "model-00004-of-00004.safetensors",
        "model.visual.merger.linear_fc2.weight": "model-00004-of-00004.safetensors",
        "model.visual.deepstack_merger_list.0.norm.weight": "model-00004-of-00004.safetensors",
    },
}


def test_only_the_shards_with_vision_keys_are_chosen():
    assert vision_shards(QWEN3_VL_8B_LIKE, QWEN) == ["model-00004-of-00004.safetensors"]
    split = {
        "weight_map": {
            **QWEN3_VL_8B_LIKE["weight_map"],
            "visual.patch_embed.proj.weight": "model-00001-of-00004.safetensors",
        }
    }
    assert vision_shards(split, QWEN) == ["model-00001-of-00004.safetensors", "model-00004-of-00004.safetensors"]
    assert vision_shards(QWEN3_VL_8B_LIKE, None) == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert vision_shards({"weight_map": {"lm_head.weight": "a.safetensors"}}, QWEN) == []


def test_a_local_directory_is_never_downloaded(tmp_path):
    (tmp_path / SAFETENSORS_INDEX).write_text(json.dumps(QWEN3_VL_8B_LIKE))
    fetch_vision_weights(str(tmp_path), tmp_path, QWEN)  # would raise without network if it tried


@pytest.mark.parametrize("family", ["qwen3-vl", "internvl"])
def test_the_chosen_shards_alone_load_the_tower(tmp_path, family):
    """A real sharded checkpoint: with every shard that the choice leaves out deleted, the tower
    still loads (strictly: a missing key would fail) and equals the one from all shards."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    model = save_tiny_vlm(family, whole)  # one safetensors file, processors and tokenizer
    shutil.copytree(whole, part)
    (part / "model.safetensors").unlink()
    model.save_pretrained(part, max_shard_size="100KB")  # shards and their index
    index = json.loads((part / SAFETENSORS_INDEX).read_text())
    prefixes = family_class(family).checkpoint_prefixes
    chosen = vision_shards(index, prefixes)
    shards = sorted(set(index["weight_map"].values()))
    assert 0 < len(chosen) < len(shards)
    for shard in set(shards) - set(chosen):
        (part / shard).unlink()
    expected = from_checkpoint(str(whole), family).tower.state_dict()
    loaded = from_checkpoint(str(part), family).tower.state_dict()
    assert expected.keys() == loaded.keys()
    assert all(torch.equal(expected[key], loaded[key]) for key in expected)
