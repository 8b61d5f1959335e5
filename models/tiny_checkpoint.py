"""A full-VLM checkpoint with random weights on disk, loadable the way users load a hub repo.

`save_tiny_vlm` writes random weights in a family's tiny preset shape, plus a processor
that `AutoProcessor.from_pretrained` restores as the family's own class (Qwen2VLProcessor,
InternVLProcessor, ...): the tiny preset's image and video processors, a byte-level BPE
tokenizer trained here on a few paragraphs (ids 0..999, then the preset's special tokens:
`TINY_SPECIAL_TOKENS`, InternVL's `TINY_INTERNVL_SPECIAL_TOKENS`) and the family's chat
template (Qwen2-VL's; InternVL's). Nothing is downloaded; tests and demos use it in place of a
hub repo. `for_vllm` widens the language model to a head size vLLM's CPU attention takes.
`save_random_vlm` does the same for any preset, real sizes included (Qwen3-VL-8B: ~8.8B
parameters, 17.5 GB in bf16, generated on a GPU where given one, written in 5 GB shards), so
that our encoder and vLLM can load one set of weights: its processor files are the preset's
(the released checkpoint's sizes), its tokenizer has the released special-token ids.

    python -m models.tiny_checkpoint qwen3-vl /tmp/tiny-qwen3-vl --for-vllm
    python -m models.tiny_checkpoint qwen3-vl /tmp/qwen3-vl-8b-random --preset qwen3-vl-8b --device cuda --seed 0
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import (
    InternVLProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLProcessor,
    Qwen2VLProcessor,
    Qwen3VLProcessor,
)

from .internvl_tower import randomize_embeddings
from .loading import family_class, vlm_config
from .presets import TINY_SPECIAL_TOKENS, TINY_TEXT_CONFIG, Preset, resolve_preset

logger = logging.getLogger(__name__)

BASE_VOCAB_SIZE = 1000
"""Ids below this are byte-level BPE tokens; the special tokens follow (`TINY_SPECIAL_TOKENS`)."""

VLLM_HEAD_DIM = 64
"""vLLM's CPU attention takes head sizes from 32 in steps of 16 (not the tiny presets' 24)."""
VLLM_TEXT_OVERRIDES = {
    "hidden_size": 4 * VLLM_HEAD_DIM,
    "intermediate_size": 8 * VLLM_HEAD_DIM,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""The tiny language model resized for vLLM: 4 heads of `VLLM_HEAD_DIM`, the vision output to match."""

PROCESSOR_CLASSES = {
    "qwen2-vl": Qwen2VLProcessor,
    "qwen2.5-vl": Qwen2_5_VLProcessor,
    "qwen3-vl": Qwen3VLProcessor,
    "internvl": InternVLProcessor,
}

# Qwen2's pre-tokenizer split (as in transformers' Qwen2Tokenizer), so that loading this
# tokenizer through Qwen2Tokenizer, which rebuilds its pipeline from vocab and merges, encodes alike.
QWEN_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501

# Qwen2-VL's chat template: a default system turn, `<|im_start|>role\n...<|im_end|>\n` turns,
# one `<|vision_start|><|image_pad|><|vision_end|>` per image (the processor expands the pad).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# InternVL's chat template, as transformers' InternVL conversion writes it: `<|im_start|>role\n...
# <|im_end|>\n` turns, one `<IMG_CONTEXT>\n` per image (InternVLProcessor expands it to
# `<img>` + one `<IMG_CONTEXT>` per output token + `</img>`) and `<video>\n` per video.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT_TEMPLATES = {"internvl": INTERNVL_CHAT_TEMPLATE}
"""Chat template per family (Qwen2-VL's, `CHAT_TEMPLATE`, for the others)."""
TOKENIZER_ATTRIBUTES = {
    "internvl": {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    }
}
"""Named special tokens a family's processor reads from its tokenizer (`tokenizer.start_image_token`, ...)."""

CORPUS = """\
The harbor wakes before the town does. Fishing boats slip out past the breakwater while the \
lighthouse still turns, and gulls follow them, crying over the grey water. By seven the bakery \
on the corner has opened its shutters, and the smell of warm bread drifts down to the quay.

A picture is a grid of small squares. Each square holds a colour, and a camera records millions \
of them in a fraction of a second. To describe an image, a person looks for shapes, edges and \
faces; a model looks for patterns in numbers, learned from many examples it has seen before.

She asked the assistant three questions: what was in the photograph, how many people were \
standing near the red car, and whether the sky looked like rain. It answered that two children \
and an old man stood by the car, and that dark clouds were gathering over the hills to the west.

Video is a sequence of frames shown quickly enough that motion appears smooth. A short clip of a \
dog running across a field might contain ninety frames; neighbouring frames differ only a little, \
so a careful reader can skip some of them and still follow the story from beginning to end.

Good instructions are short and clear. Write the answer in one sentence. Count the apples on the \
table. Describe the weather, the season and the time of day. If you are not sure, say so, and \
explain which part of the picture made the question difficult to answer.

In winter the market square fills with stalls selling chestnuts, wool scarves, honey and candles. \
Musicians play near the fountain, and visitors from the mountain villages bring cheese, apples and \
carved wooden toys. When the evening bells ring, everyone gathers to watch the lanterns being lit.

Every morning the train to the city leaves at half past six. Passengers read newspapers, drink \
coffee from paper cups, or simply watch the orchards, rivers and factories go by. A conductor \
checks tickets, and a small girl presses her nose against the window, counting cows and bridges.

The library keeps maps, letters and diaries written by sailors who crossed the ocean long ago. \
Their handwriting is often hard to read: ink has faded, pages are torn, and spelling changes from \
one journal to the next. Volunteers transcribe them slowly, checking every strange word twice.

Numbers help too: 3 bikes, 12 eggs, 250 grams of flour, 1,024 pixels, and 42 minutes until noon.

At the workshop we repaired an old bicycle: new brakes, a bright yellow bell, oiled chains and \
a leather saddle. Afterwards we rode along the canal, past quiet gardens, barges and anglers.
"""


def _with_qwen_pipeline(backend: Tokenizer) -> Tokenizer:
    """Qwen2's normalizer, pre-tokenizer and decoder (NFC, regex split, byte-level)."""
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _trained_vocab_and_merges(size: int = BASE_VOCAB_SIZE) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE trained on `CORPUS` (`BASE_VOCAB_SIZE` tokens), the vocabulary filled with
    unreachable placeholders up to `size` ids (where the special tokens start)."""
    backend = _with_qwen_pipeline(Tokenizer(BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=BASE_VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator([CORPUS], trainer=trainer)
    model = json.loads(backend.to_str())["model"]
    vocab = dict(model["vocab"])
    # Unreachable placeholders keep the special tokens' ids fixed (also should training stop short).
    for index in range(size - len(vocab)):
        vocab[f"<|unused_{index}|>"] = len(vocab)
    assert sorted(vocab.values()) == list(range(size))
    return vocab, [tuple(pair) for pair in model["merges"]]


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny presets' tokenizer: deterministic, built in milliseconds, with Qwen's chat template."""
    return build_tokenizer(TINY_SPECIAL_TOKENS, TINY_TEXT_CONFIG["max_position_embeddings"])


def build_preset_tokenizer(preset: Preset) -> PreTrainedTokenizerFast:
    """The tokenizer of a random-weight preset: its special tokens at their ids, its family's chat template
    and named tokens."""
    return build_tokenizer(
        preset.special_tokens,
        preset.text_config["max_position_embeddings"],
        CHAT_TEMPLATES.get(preset.family, CHAT_TEMPLATE),
        TOKENIZER_ATTRIBUTES.get(preset.family),
    )


def build_tokenizer(
    special_tokens: dict[str, int],
    model_max_length: int,
    chat_template: str = CHAT_TEMPLATE,
    named_tokens: dict[str, str] | None = None,
) -> PreTrainedTokenizerFast:
    """A small byte-level BPE vocabulary with the special tokens at exactly these ids (for random-weight
    presets of real models too: their specials sit at 151643+; the ids between are placeholders).
    `named_tokens`: attribute name -> token, for processors that read them (InternVL's)."""
    first = min(special_tokens.values())
    vocab, merges = _trained_vocab_and_merges(first)
    backend = _with_qwen_pipeline(Tokenizer(BPE(vocab=vocab, merges=merges)))
    by_id = {token_id: token for token, token_id in special_tokens.items()}
    ordered = [by_id.get(i, f"<|reserved_{i}|>") for i in range(first, max(by_id) + 1)]
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in ordered])
    found = {token: backend.token_to_id(token) for token in special_tokens}
    assert found == special_tokens, found
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        chat_template=chat_template,
        **({"extra_special_tokens": named_tokens} if named_tokens else {}),
    )


def build_tiny_processor(family: str):
    """The family's transformers processor: the tiny preset's image and video processors, the tiny tokenizer."""
    return build_preset_processor(resolve_preset(family, "tiny"))


def build_preset_processor(preset: Preset):
    """The family's transformers processor for a preset: its image and video processors, its tokenizer."""
    family = preset.family
    cls = family_class(family)
    tokenizer = build_preset_tokenizer(preset)
    image_processor = cls.image_processor_class(**preset.image_processor)
    video_processor = cls.video_processor_class(**preset.video_processor)
    extra = {}
    if family == "internvl":  # its placeholder count per tile, which the processor does not derive
        config = cls.preset_tower_config(preset)
        extra["image_seq_length"] = cls.make_preprocessor(image_processor, video_processor, config).tile_tokens
    return PROCESSOR_CLASSES[family](
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=tokenizer.chat_template,
        **extra,
    )


def vllm_tiny_preset(family: str) -> Preset:
    """The family's tiny preset with a language model vLLM's CPU backend runs (head_dim 64; the
    multimodal rotary sections sum to half of it); the vision tower is the tiny one, its output
    widened to the new hidden size."""
    preset = resolve_preset(family, "tiny")
    rope = {**preset.text_config["rope_parameters"], "mrope_section": [8, 12, 12]}
    text = {**preset.text_config, **VLLM_TEXT_OVERRIDES, "rope_parameters": rope}
    if "head_dim" in text:
        text["head_dim"] = VLLM_HEAD_DIM
    output = "out_hidden_size" if "out_hidden_size" in preset.vision_config else "hidden_size"  # qwen2-vl: the latter
    vision = {**preset.vision_config, output: VLLM_TEXT_OVERRIDES["hidden_size"]}
    return replace(preset, text_config=text, vision_config=vision)


def save_tiny_vlm(family: str, directory: str | Path, seed: int = 0, for_vllm: bool = False) -> torch.nn.Module:
    """Write a tiny full VLM (seeded random weights) and its processor to `directory`; return the model.
    `for_vllm`: in `vllm_tiny_preset`'s shape, which vLLM's CPU backend can serve."""
    torch.manual_seed(seed)
    preset = vllm_tiny_preset(family) if for_vllm else resolve_preset(family, "tiny")
    model = family_class(family).vlm_class(vlm_config(preset)).eval()
    vision_tower = getattr(model.model, "vision_tower", None)
    if vision_tower is not None:  # InternVL: nonzero class token and position embeddings
        randomize_embeddings(vision_tower, torch.Generator().manual_seed(seed))
    model.save_pretrained(directory)
    _save_processor(build_tiny_processor(family), directory)
    return model


def _save_processor(processor, directory: str | Path) -> None:
    processor.save_pretrained(directory)
    # Hub repos also keep each processor's own file, which the image and video processor classes load.
    processor.image_processor.save_pretrained(directory)
    processor.video_processor.save_pretrained(directory)


RECORD_FILE = "random_checkpoint.json"
"""What `save_random_vlm` wrote: preset, seed, dtype, where generated, versions, seconds."""


def save_random_vlm(
    preset: str | Preset,
    directory: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    max_shard_size: str = "5GB",
) -> dict:
    """Write a full VLM of any preset (seeded random weights, transformers' own initialization on
    `device`) with its processor and tokenizer to `directory`; return the record also saved there
    as `RECORD_FILE`. Written into a sibling folder first and renamed at the end, so `directory`
    exists only once complete; an existing `directory` is an error (delete it to write again).
    The same seed, device kind and torch give the same weights."""
    found = preset if isinstance(preset, Preset) else resolve_preset(None, preset)
    target = Path(directory)
    if target.exists():
        raise FileExistsError(f"{target} exists; delete it to write a new checkpoint there")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} asked for, but torch sees no CUDA device")
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    start = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(device):
        model = family_class(found.family).vlm_class._from_config(vlm_config(found), dtype=dtype).eval()
    vision_tower = getattr(model.model, "vision_tower", None)
    if vision_tower is not None:  # InternVL: nonzero class token and position embeddings
        randomize_embeddings(vision_tower, torch.Generator().manual_seed(seed))
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    generated_s = time.perf_counter() - start
    parameters = sum(p.numel() for p in model.parameters())
    logger.info("generated %s (%.2fB parameters) on %s in %.1f s", found.name, parameters / 1e9, device, generated_s)
    model.save_pretrained(partial, max_shard_size=max_shard_size)
    del model
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()  # a process that goes on (a test) leaves the GPU to the engines it starts
    _save_processor(build_preset_processor(found), partial)
    record = {
        "preset": found.name,
        "seed": seed,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "device_name": torch.cuda.get_device_name() if str(device).startswith("cuda") else "cpu",
        "parameters": parameters,
        "bytes": sum(f.stat().st_size for f in partial.glob("*.safetensors")),
        "torch": torch.__version__,
        "generated_s": round(generated_s, 1),
        "total_s": round(time.perf_counter() - start, 1),
    }
    (partial / RECORD_FILE).write_text(json.dumps(record, indent=2))
    partial.rename(target)
    return record


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write a full-VLM checkpoint (random weights) to a directory.")
    parser.add_argument("family", choices=sorted(PROCESSOR_CLASSES))
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--for-vllm", action="store_true", help="in the shape vLLM's CPU backend serves (head_dim 64)")
    parser.add_argument("--preset", help="a preset of the family (e.g. qwen3-vl-8b: real sizes); default: the tiny one")
    parser.add_argument("--device", default="cpu", help="with --preset: where the weights are generated (cuda: fast)")
    parser.add_argument("--dtype", default="bfloat16", help="with --preset: the weights' dtype")
    args = parser.parse_args()
    if args.preset is None:
        save_tiny_vlm(args.family, args.directory, seed=args.seed, for_vllm=args.for_vllm)
        print(f"wrote a tiny {args.family} checkpoint to {args.directory}")
    else:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
        if args.for_vllm and not args.preset.endswith("tiny"):
            parser.error("--for-vllm reshapes the tiny preset only")
        chosen = vllm_tiny_preset(args.family) if args.for_vllm else resolve_preset(args.family, args.preset)
        written = save_random_vlm(chosen, args.directory, args.seed, getattr(torch, args.dtype), args.device)
        print(f"wrote {args.directory}: {json.dumps(written)}")
