"""Presets match the released models' shapes; their tokenizers put special tokens where configs expect them."""

from __future__ import annotations

import pytest
import torch

from models import family_class, load_preprocessor, vlm_config
from models.presets import PRESETS
from models.tiny_checkpoint import build_preset_tokenizer, build_tokenizer

# Parameter counts: the vision towers as given in DESIGN.md, whole models as on the model cards.
VISION_PARAMS = {"qwen2.5-vl-7b": 677e6, "qwen3-vl-8b": 576e6, "qwen3-vl-2b": 407e6}
INTERNVIT_300M_PARAMS = 304e6
QWEN_PRESETS = sorted(name for name, preset in PRESETS.items() if preset.family != "internvl")
INTERNVL_PRESETS = sorted(name for name, preset in PRESETS.items() if preset.family == "internvl")
TOTAL_PARAMS = {
    "qwen2-vl-7b": 8.29e9,
    "qwen2.5-vl-3b": 3.75e9,
    "qwen2.5-vl-7b": 8.29e9,
    "qwen3-vl-2b": 2.13e9,
    "qwen3-vl-4b": 4.44e9,
    "qwen3-vl-8b": 8.77e9,
}


@pytest.mark.parametrize("name", sorted(TOTAL_PARAMS))
def test_real_size_presets_have_the_published_parameter_counts(name):
    preset = PRESETS[name]
    with torch.device("meta"):
        model = family_class(preset.family).vlm_class(vlm_config(preset))
    total = sum(p.numel() for p in model.parameters())
    assert abs(total - TOTAL_PARAMS[name]) / TOTAL_PARAMS[name] < 0.01, total
    if name in VISION_PARAMS:
        vision = sum(p.numel() for p in model.model.visual.parameters())
        assert abs(vision - VISION_PARAMS[name]) / VISION_PARAMS[name] < 0.01, vision


@pytest.mark.parametrize("name", QWEN_PRESETS)
def test_the_tower_feeds_the_language_model_and_the_tokenizer_matches_the_config(name):
    preset = PRESETS[name]
    config = vlm_config(preset)
    vision = config.vision_config
    assert (getattr(vision, "out_hidden_size", None) or vision.hidden_size) == config.text_config.hidden_size
    tokenizer = build_tokenizer(preset.special_tokens, 4096)
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == config.image_token_id
    assert tokenizer.convert_tokens_to_ids("<|video_pad|>") == config.video_token_id
    assert tokenizer.convert_tokens_to_ids("<|vision_start|>") == config.vision_start_token_id
    assert tokenizer.eos_token_id == config.text_config.eos_token_id
    assert len(tokenizer) <= config.text_config.vocab_size


@pytest.mark.parametrize("name", [n for n in INTERNVL_PRESETS if not n.endswith("-tiny")])
def test_internvl3_presets_have_the_internvit_300m_tower(name):
    preset = PRESETS[name]
    with torch.device("meta"):
        model = family_class(preset.family).vlm_class(vlm_config(preset))
    vision = sum(p.numel() for p in model.model.vision_tower.parameters())
    assert abs(vision - INTERNVIT_300M_PARAMS) / INTERNVIT_300M_PARAMS < 0.01, vision
    # pixel shuffle: 4 patches of 1024 channels per token, projected to the language model's width
    assert model.model.multi_modal_projector.linear_1.in_features == 4 * 1024


@pytest.mark.parametrize("name", INTERNVL_PRESETS)
def test_internvl_projector_feeds_the_language_model_and_the_tokenizer_matches_the_config(name):
    preset = PRESETS[name]
    config = vlm_config(preset)
    tokenizer = build_preset_tokenizer(preset)
    assert tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>") == config.image_token_id == tokenizer.context_image_token_id
    assert tokenizer.start_image_token == "<img>" and tokenizer.end_image_token == "</img>"
    assert tokenizer.eos_token_id == config.text_config.eos_token_id
    assert len(tokenizer) <= config.text_config.vocab_size
    with torch.device("meta"):
        model = family_class(preset.family).vlm_class(config)
    assert model.model.multi_modal_projector.linear_2.out_features == config.text_config.hidden_size


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_presets_smallest_item_is_what_its_processor_makes(name):
    """The app builder sizes the budget ladder from the preset's numbers alone (no transformers);
    they must agree with the processor the replicas load, and with a real smallest image."""
    preset = PRESETS[name]
    _, preprocessor = load_preprocessor(name, preset.family)
    assert preset.min_item_tokens == preprocessor.min_item_tokens
    assert preprocessor.image_spec(32, 32).output_tokens == preset.min_item_tokens
