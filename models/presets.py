"""Named vision-tower configurations: `tiny` per family and the published real sizes.

Real sizes reproduce the `vision_config` and processor configs of the released checkpoints
(random weights: for benchmarks and capacity planning without downloading anything).
`tiny` keeps the real processor (so token counts are real) and shrinks only the tower.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
HALF = [0.5, 0.5, 0.5]

QWEN2_IMAGE_PROCESSOR = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384},
    "image_mean": OPENAI_CLIP_MEAN,
    "image_std": OPENAI_CLIP_STD,
}
QWEN2_VIDEO_PROCESSOR = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
    "image_mean": OPENAI_CLIP_MEAN,
    "image_std": OPENAI_CLIP_STD,
}
QWEN3_IMAGE_PROCESSOR = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "image_mean": HALF,
    "image_std": HALF,
}
QWEN3_VIDEO_PROCESSOR = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 4096, "longest_edge": 25165824},
    "image_mean": HALF,
    "image_std": HALF,
}


IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]

# InternVL (2.5/3/3.5, as converted to transformers): 448 px tiles, 1-12 of them plus a thumbnail.
INTERNVL_IMAGE_PROCESSOR = {
    "size": {"height": 448, "width": 448},
    "min_patches": 1,
    "max_patches": 12,
    "image_mean": IMAGENET_MEAN,
    "image_std": IMAGENET_STD,
}
INTERNVL_DOWNSAMPLE_RATIO = 0.5
"""Pixel shuffle before the projector: 2 x 2 patches make one output token."""
INTERNVL_VIDEO_PROCESSOR = {
    "size": {"height": 448, "width": 448},
    "image_mean": IMAGENET_MEAN,
    "image_std": IMAGENET_STD,
}

# Special tokens of the tiny presets' vocabulary (the ids a tiny tokenizer must use).
TINY_SPECIAL_TOKENS = {
    "<|endoftext|>": 1000,
    "<|im_start|>": 1001,
    "<|im_end|>": 1002,
    "<|vision_start|>": 1003,
    "<|vision_end|>": 1004,
    "<|image_pad|>": 1005,
    "<|video_pad|>": 1006,
}
TINY_TEXT_CONFIG = {
    "vocab_size": 1024,
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "bos_token_id": TINY_SPECIAL_TOKENS["<|endoftext|>"],
    "eos_token_id": TINY_SPECIAL_TOKENS["<|im_end|>"],
    "pad_token_id": TINY_SPECIAL_TOKENS["<|endoftext|>"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]},
}


# The released Qwen VL tokenizers' special-token ids (their vocabularies start the specials at 151643).
QWEN_SPECIAL_TOKENS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}


# InternVL's prompt tokens: `<img>` + one `<IMG_CONTEXT>` per output token + `</img>` per image;
# `<video>` is the placeholder InternVLProcessor expands into frames.
TINY_INTERNVL_SPECIAL_TOKENS = {
    "<|endoftext|>": 1000,
    "<|im_start|>": 1001,
    "<|im_end|>": 1002,
    "<img>": 1003,
    "</img>": 1004,
    "<IMG_CONTEXT>": 1005,
    "<video>": 1006,
}
TINY_INTERNVL_TEXT_CONFIG = {
    "model_type": "qwen2",
    **{k: v for k, v in TINY_TEXT_CONFIG.items() if k != "rope_parameters"},
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 16384,  # 256 tokens per tile: a prompt of a few images is thousands long
}
# The released InternVL3 tokenizers' ids (Qwen2.5's vocabulary plus InternVL's image tokens).
INTERNVL_SPECIAL_TOKENS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<img>": 151665,
    "</img>": 151666,
    "<IMG_CONTEXT>": 151667,
}


def vlm_token_ids(special_tokens: dict[str, int]) -> dict[str, int]:
    """The VLM config's token-id fields for a vocabulary's special tokens."""
    return {
        "image_token_id": special_tokens["<|image_pad|>"],
        "video_token_id": special_tokens["<|video_pad|>"],
        "vision_start_token_id": special_tokens["<|vision_start|>"],
        "vision_end_token_id": special_tokens["<|vision_end|>"],
    }


@dataclass(frozen=True)
class Preset:
    """A model configuration with random weights: the vision tower, and for E/PD the language side."""

    name: str
    family: str
    vision_config: dict[str, Any]
    image_processor: dict[str, Any] = field(default_factory=dict)
    video_processor: dict[str, Any] = field(default_factory=dict)
    text_config: dict[str, Any] | None = None
    """Language-model config of the full VLM (as published for real sizes)."""
    special_tokens: dict[str, int] = field(default_factory=lambda: dict(QWEN_SPECIAL_TOKENS))
    """Ids of the tokenizer's special tokens (the tiny vocabulary's, or the released one's)."""
    tie_word_embeddings: bool = False

    @property
    def min_item_tokens(self) -> int:
        """Output tokens of the smallest item its processor produces, from the preset's own numbers:
        the app builder needs it for the budget ladder and imports no transformers."""
        if self.family == "internvl":
            tile, patch = self.image_processor["size"]["height"], self.vision_config["patch_size"][0]
            return (tile // patch) ** 2 // round(1 / INTERNVL_DOWNSAMPLE_RATIO) ** 2
        size, patch, merge = (self.image_processor[key] for key in ("size", "patch_size", "merge_size"))
        return max(1, size["shortest_edge"] // patch**2 // merge**2)


def _qwen2_vl(name: str, **vision: Any) -> Preset:
    return Preset(name, "qwen2-vl", vision, QWEN2_IMAGE_PROCESSOR, QWEN2_VIDEO_PROCESSOR)


def _qwen2_5_vl(name: str, **vision: Any) -> Preset:
    return Preset(name, "qwen2.5-vl", vision, QWEN2_IMAGE_PROCESSOR, QWEN2_VIDEO_PROCESSOR)


def _qwen3_vl(name: str, **vision: Any) -> Preset:
    return Preset(name, "qwen3-vl", vision, QWEN3_IMAGE_PROCESSOR, QWEN3_VIDEO_PROCESSOR)


def _qwen3_text(hidden: int, intermediate: int, layers: int, heads: int) -> dict[str, Any]:
    return dict(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=262144,
        rope_parameters=_QWEN3_ROPE,
    )


def _internvl(name: str, text: dict[str, Any], special_tokens: dict[str, int], tie: bool, **vision: Any) -> Preset:
    return Preset(
        name,
        "internvl",
        vision,
        INTERNVL_IMAGE_PROCESSOR,
        INTERNVL_VIDEO_PROCESSOR,
        text_config=text,
        special_tokens=special_tokens,
        tie_word_embeddings=tie,
    )


def _internvl3_text(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int) -> dict[str, Any]:
    """InternVL3's Qwen2.5 language model, as in the `-hf` checkpoints' `text_config`."""
    return dict(
        model_type="qwen2",
        vocab_size=151674,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        bos_token_id=INTERNVL_SPECIAL_TOKENS["<|endoftext|>"],
        eos_token_id=INTERNVL_SPECIAL_TOKENS["<|im_end|>"],
        pad_token_id=INTERNVL_SPECIAL_TOKENS["<|endoftext|>"],
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000000.0},
    )


# InternViT-300M-448px-V2_5, the vision tower of InternVL3-1B, -2B and -8B (`vision_config` of the
# `-hf` checkpoints; transformers' InternVLVisionConfig defaults fill the rest: 448 px, patch 14,
# layer norm, no qk norm, layer scale, mean pooling, i.e. no final norm).
_INTERNVIT_300M = dict(
    patch_size=[14, 14],
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    attention_bias=True,
    hidden_act="gelu",
    layer_norm_eps=1e-6,
)
_INTERNVIT_TINY = {
    **_INTERNVIT_300M,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def _with_text(preset: Preset, **text: Any) -> Preset:
    return replace(preset, text_config={**TINY_TEXT_CONFIG, **text}, special_tokens=dict(TINY_SPECIAL_TOKENS))


def _with_real_text(preset: Preset, tie_word_embeddings: bool, **text: Any) -> Preset:
    """The released model's language side, special tokens at the released ids."""
    ids = {
        "bos_token_id": QWEN_SPECIAL_TOKENS["<|endoftext|>"],
        "eos_token_id": QWEN_SPECIAL_TOKENS["<|im_end|>"],
        "pad_token_id": QWEN_SPECIAL_TOKENS["<|endoftext|>"],
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
    }
    return replace(preset, text_config={**ids, **text}, tie_word_embeddings=tie_word_embeddings)


_QWEN2_TEXT_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
)
_QWEN3_ROPE = {
    "rope_type": "default",
    "rope_theta": 5000000.0,
    "mrope_section": [24, 20, 20],
    "mrope_interleaved": True,
}


_QWEN2_5_REAL = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    hidden_act="silu",
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
)
_QWEN3_SMALL = dict(
    depth=24,
    hidden_size=1024,
    intermediate_size=4096,
    num_heads=16,
    hidden_act="gelu_pytorch_tanh",
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[5, 11, 17],
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        _with_text(
            _qwen2_vl(
                "qwen2-vl-tiny",
                depth=2,
                embed_dim=64,
                hidden_size=96,
                num_heads=4,
                mlp_ratio=2,
                hidden_act="quick_gelu",
            )
        ),
        _with_real_text(
            _qwen2_vl(
                "qwen2-vl-7b",
                depth=32,
                embed_dim=1280,
                hidden_size=3584,
                num_heads=16,
                mlp_ratio=4,
                hidden_act="quick_gelu",
            ),
            False,
            max_position_embeddings=32768,
            **_QWEN2_TEXT_7B,
        ),
        _with_text(
            _qwen2_5_vl(
                "qwen2.5-vl-tiny",
                depth=4,
                hidden_size=64,
                intermediate_size=96,
                num_heads=4,
                out_hidden_size=96,
                hidden_act="silu",
                window_size=112,
                fullatt_block_indexes=[1, 3],
            )
        ),
        _with_real_text(
            _qwen2_5_vl("qwen2.5-vl-3b", out_hidden_size=2048, **_QWEN2_5_REAL),
            True,
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            max_position_embeddings=128000,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        ),
        _with_real_text(
            _qwen2_5_vl("qwen2.5-vl-7b", out_hidden_size=3584, **_QWEN2_5_REAL),
            False,
            max_position_embeddings=128000,
            **_QWEN2_TEXT_7B,
        ),
        _with_text(
            _qwen3_vl(
                "qwen3-vl-tiny",
                depth=3,
                hidden_size=64,
                intermediate_size=96,
                num_heads=4,
                out_hidden_size=96,
                hidden_act="gelu_pytorch_tanh",
                num_position_embeddings=256,
                deepstack_visual_indexes=[0, 1],
            ),
            head_dim=24,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 4, 4],
                "mrope_interleaved": True,
            },
        ),
        _with_real_text(
            _qwen3_vl("qwen3-vl-2b", out_hidden_size=2048, **_QWEN3_SMALL),
            True,
            **_qwen3_text(hidden=2048, intermediate=6144, layers=28, heads=16),
        ),
        _with_real_text(
            _qwen3_vl("qwen3-vl-4b", out_hidden_size=2560, **_QWEN3_SMALL),
            True,
            **_qwen3_text(hidden=2560, intermediate=9728, layers=36, heads=32),
        ),
        _with_real_text(
            _qwen3_vl(
                "qwen3-vl-8b",
                depth=27,
                hidden_size=1152,
                intermediate_size=4304,
                num_heads=16,
                hidden_act="gelu_pytorch_tanh",
                out_hidden_size=4096,
                patch_size=16,
                num_position_embeddings=2304,
                deepstack_visual_indexes=[8, 16, 24],
            ),
            False,
            **_qwen3_text(hidden=4096, intermediate=12288, layers=36, heads=32),
        ),
        _internvl(
            "internvl-tiny",
            TINY_INTERNVL_TEXT_CONFIG,
            TINY_INTERNVL_SPECIAL_TOKENS,
            False,
            **_INTERNVIT_TINY,
        ),
        _internvl(
            "internvl3-1b", _internvl3_text(896, 4864, 24, 14, 2), INTERNVL_SPECIAL_TOKENS, True, **_INTERNVIT_300M
        ),
        _internvl(
            "internvl3-2b", _internvl3_text(1536, 8960, 28, 12, 2), INTERNVL_SPECIAL_TOKENS, True, **_INTERNVIT_300M
        ),
        _internvl(
            "internvl3-8b", _internvl3_text(3584, 18944, 28, 28, 4), INTERNVL_SPECIAL_TOKENS, False, **_INTERNVIT_300M
        ),
    ]
}


def resolve_preset(family: str | None, preset: str) -> Preset:
    """Find a preset by full name ("qwen3-vl-8b") or by family + short name ("tiny")."""
    name = preset if preset in PRESETS else f"{family}-{preset}"
    if name not in PRESETS:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown preset {preset!r} (family {family!r}); known presets: {known}")
    found = PRESETS[name]
    if family is not None and found.family != family:
        raise ValueError(f"preset {found.name!r} belongs to family {found.family!r}, not {family!r}")
    return found
