"""The tiny checkpoint loads and runs the way transformers loads and runs a hub repo."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, Qwen2Tokenizer

from models import from_checkpoint
from models.presets import QWEN_SPECIAL_TOKENS, TINY_SPECIAL_TOKENS, TINY_TEXT_CONFIG, resolve_preset
from models.tiny_checkpoint import (
    BASE_VOCAB_SIZE,
    PROCESSOR_CLASSES,
    RECORD_FILE,
    VLLM_HEAD_DIM,
    build_preset_processor,
    build_tiny_processor,
    build_tiny_tokenizer,
    save_random_vlm,
    save_tiny_vlm,
)
from tests.helpers import random_image

FAMILIES = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"]
IMAGE_SIZES = {0: [], 1: [(64, 48)], 3: [(64, 48), (200, 120), (90, 300)]}
"""(width, height) of the images in a prompt, by image count."""
TEXTS = [
    "The harbor wakes before the town does.",
    'Count the 12 apples, then write: "done"!\n\nTabs\tand  double  spaces stay.',
    "Words it never saw: quixotic zephyr, Ünïcödé, 東京, emoji 🙂.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One saved tiny VLM per family: {family: (directory, model as saved)}."""
    saved = {}
    for family in FAMILIES:
        directory = tmp_path_factory.mktemp(family)
        saved[family] = (directory, save_tiny_vlm(family, directory))
    return saved


def pil_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = random_image(np.random.default_rng(seed), height, width)
    return Image.fromarray(pixels.permute(1, 2, 0).numpy())


def messages_with_images(count: int) -> list[dict]:
    images = [{"type": "image", "image": pil_image(w, h, seed)} for seed, (w, h) in enumerate(IMAGE_SIZES[count])]
    return [{"role": "user", "content": [*images, {"type": "text", "text": "Describe the pictures."}]}]


# ---- tokenizer ----


def test_special_tokens_have_the_tiny_presets_ids(tokenizer):
    for token, token_id in TINY_SPECIAL_TOKENS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id, token
        assert tokenizer(token, add_special_tokens=False).input_ids == [token_id], token
    assert tokenizer.eos_token_id == TINY_TEXT_CONFIG["eos_token_id"]
    assert tokenizer.pad_token_id == TINY_TEXT_CONFIG["pad_token_id"]


def test_base_vocabulary_is_exactly_the_ids_below_the_special_tokens(tokenizer):
    vocab = tokenizer.get_vocab()
    base_ids = sorted(i for token, i in vocab.items() if token not in TINY_SPECIAL_TOKENS)
    assert base_ids == list(range(BASE_VOCAB_SIZE))
    assert len(tokenizer) == BASE_VOCAB_SIZE + len(TINY_SPECIAL_TOKENS) <= TINY_TEXT_CONFIG["vocab_size"]


@pytest.mark.parametrize("text", TEXTS)
def test_ordinary_text_round_trips(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert max(ids) < BASE_VOCAB_SIZE
    assert tokenizer.decode(ids) == text


def test_building_twice_gives_the_same_tokenizer(tokenizer):
    assert build_tiny_tokenizer().backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_qwen2_tokenizer_reading_the_saved_files_encodes_alike(tokenizer, checkpoints):
    # Qwen2Tokenizer rebuilds Qwen's own pipeline from the saved vocabulary and merges.
    qwen = Qwen2Tokenizer.from_pretrained(checkpoints["qwen2.5-vl"][0])
    for text in [*TEXTS, "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>"]:
        assert qwen(text).input_ids == tokenizer(text).input_ids, text


def test_chat_template_renders_qwen2_vl_turns(tokenizer):
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What happens?"}]},
        {"role": "assistant", "content": "A dog runs."},
    ]
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "<|vision_start|><|video_pad|><|vision_end|>What happens?<|im_end|>\n"
        "<|im_start|>assistant\nA dog runs.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == expected


# ---- processor and model, loaded back by transformers ----


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_processor_loads_the_family_processor(family, checkpoints):
    processor = AutoProcessor.from_pretrained(checkpoints[family][0])
    assert type(processor) is PROCESSOR_CLASSES[family]
    built = build_tiny_processor(family)
    assert processor.image_processor.to_dict() == built.image_processor.to_dict()
    assert processor.video_processor.to_dict() == built.video_processor.to_dict()
    assert processor.image_token_id == TINY_SPECIAL_TOKENS["<|image_pad|>"]
    assert processor.video_token_id == TINY_SPECIAL_TOKENS["<|video_pad|>"]


@pytest.mark.parametrize("image_count", sorted(IMAGE_SIZES))
@pytest.mark.parametrize("family", FAMILIES)
def test_chat_prompt_has_one_pad_per_merged_image_token(family, image_count, checkpoints):
    processor = AutoProcessor.from_pretrained(checkpoints[family][0])
    inputs = processor.apply_chat_template(
        messages_with_images(image_count),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    input_ids = inputs["input_ids"][0]
    starts = (input_ids == TINY_SPECIAL_TOKENS["<|vision_start|>"]).sum().item()
    pads = (input_ids == TINY_SPECIAL_TOKENS["<|image_pad|>"]).sum().item()
    merge_units = processor.image_processor.merge_size**2
    expected_pads = sum(int(grid.prod()) // merge_units for grid in inputs.get("image_grid_thw", []))
    assert starts == image_count
    assert pads == expected_pads
    assert (pads > 0) == (image_count > 0)


@pytest.mark.parametrize("image_count", sorted(IMAGE_SIZES))
@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_model_generates_from_chat_prompts(family, image_count, checkpoints):
    directory, saved = checkpoints[family]
    processor = AutoProcessor.from_pretrained(directory)
    model = AutoModelForImageTextToText.from_pretrained(directory).eval()
    assert type(model) is type(saved)
    inputs = processor.apply_chat_template(
        messages_with_images(image_count),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    prompt_length = inputs["input_ids"].shape[1]
    new_tokens = output[0, prompt_length:]
    assert torch.equal(output[0, :prompt_length], inputs["input_ids"][0])
    assert len(new_tokens) == 16 or new_tokens[-1].item() == TINY_TEXT_CONFIG["eos_token_id"]


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_weights_equal_the_returned_model(family, checkpoints):
    directory, saved = checkpoints[family]
    loaded = AutoModelForImageTextToText.from_pretrained(directory)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.parametrize("family", FAMILIES)
def test_the_vllm_shaped_checkpoint_has_head_dim_64_and_generates_from_an_image(family, tmp_path):
    save_tiny_vlm(family, tmp_path, for_vllm=True)
    model = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    text = model.config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert head_dim == VLLM_HEAD_DIM and sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    processor = AutoProcessor.from_pretrained(tmp_path)
    inputs = processor.apply_chat_template(
        messages_with_images(1), add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.inference_mode():  # the tower's output width feeds the wider language model
        output = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert output.shape[1] > inputs["input_ids"].shape[1]


# ---- any preset, real sizes included (save_random_vlm) ----


@pytest.mark.parametrize("preset", ["qwen3-vl-tiny", "internvl-tiny"])
def test_a_random_preset_checkpoint_loads_in_our_encoder_and_transformers_alike(preset, tmp_path):
    directory = tmp_path / preset
    written = save_random_vlm(preset, directory, seed=3, dtype=torch.float32)
    assert json.loads((directory / RECORD_FILE).read_text()) == written
    assert written["preset"] == preset and written["seed"] == 3 and written["bytes"] > 0
    assert [p.name for p in tmp_path.iterdir()] == [preset]  # no partial folder left beside it
    encoder = from_checkpoint(str(directory))
    model = AutoModelForImageTextToText.from_pretrained(directory)
    assert encoder.family == resolve_preset(None, preset).family
    tower = dict(encoder.tower.named_parameters())
    prefix = "model.visual." if preset.startswith("qwen") else "model."
    weights = {n.removeprefix(prefix): t for n, t in model.state_dict().items() if n.startswith(prefix)}
    assert tower and all(torch.equal(weights[name], tensor) for name, tensor in tower.items())
    assert isinstance(AutoProcessor.from_pretrained(directory), PROCESSOR_CLASSES[encoder.family])


def test_the_same_seed_writes_the_same_weights_and_another_seed_others(tmp_path):
    def weights(seed: int, name: str) -> dict[str, torch.Tensor]:
        save_random_vlm("qwen3-vl-tiny", tmp_path / name, seed=seed, dtype=torch.float32)
        return AutoModelForImageTextToText.from_pretrained(tmp_path / name).state_dict()

    first, again, other = weights(0, "a"), weights(0, "b"), weights(1, "c")
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["lm_head.weight"], other["lm_head.weight"])


def test_an_existing_directory_is_not_overwritten(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="delete it"):
        save_random_vlm("qwen3-vl-tiny", tmp_path / "taken")


def test_a_real_size_preset_gets_the_released_special_token_ids_and_processor_sizes():
    preset = resolve_preset(None, "qwen3-vl-8b")
    processor = build_preset_processor(preset)
    assert {t: processor.tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS} == QWEN_SPECIAL_TOKENS
    assert processor.image_processor.size["longest_edge"] == preset.image_processor["size"]["longest_edge"]
    assert processor.image_processor.patch_size == 16
