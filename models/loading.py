"""Building encoders: from a preset (random weights) or from a checkpoint (dir or hub id).

A checkpoint is either a full VLM (`...ForConditionalGeneration`; only the vision weights are
read, under `model.visual.` or `visual.`) or a vision-only tower saved by `save_pretrained`.
Loading is strict: a missing or unexpected key is an error that names it.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from .attention import AttentionBackend
from .presets import PRESETS, Preset, resolve_preset, vlm_token_ids
from .processing import VisionPreprocessor
from .qwen import QwenVisionEncoder
from .qwen2_5_vl import Qwen2_5_VLEncoder
from .qwen2_vl import Qwen2VLEncoder
from .qwen3_vl import Qwen3VLEncoder

logger = logging.getLogger(__name__)

FAMILIES: dict[str, type[QwenVisionEncoder]] = {
    cls.family: cls for cls in (Qwen2VLEncoder, Qwen2_5_VLEncoder, Qwen3VLEncoder)
}
VISION_PREFIXES = ("model.visual.", "visual.")


class CheckpointError(ValueError):
    """A checkpoint that cannot serve as this service's vision tower."""


def family_class(family: str) -> type[QwenVisionEncoder]:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known families: {', '.join(FAMILIES)}")
    return FAMILIES[family]


def _build_tower(cls: type[QwenVisionEncoder], config, dtype: torch.dtype, device: torch.device | str):
    # Built under the target dtype (not `.to(dtype)` afterwards) so that rotary `inv_freq`
    # buffers stay float32, as with transformers' own `from_pretrained`.
    with torch.device(device):
        return cls.tower_class._from_config(config, dtype=dtype)


def from_preset(
    preset: str | Preset,
    family: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    attention: str | AttentionBackend = "auto",
) -> QwenVisionEncoder:
    """An encoder with random weights (seeded) in a preset's shape; `attention`: its kernels."""
    found = preset if isinstance(preset, Preset) else resolve_preset(family, preset)
    cls = family_class(found.family)
    torch.manual_seed(seed)
    tower = _build_tower(cls, cls.config_class(**found.vision_config), dtype, device)
    return cls(tower, _preset_preprocessor(found), name=found.name, attention=attention)


def transformers_tower(
    encoder: QwenVisionEncoder, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> torch.nn.Module:
    """A fresh transformers tower of the encoder's class and config holding its weights, as users
    run it: untouched modules (the Conv3d patch embedding) and sdpa attention. The independent
    reference for tests and the "HF" column of the benchmarks."""
    config = copy.deepcopy(encoder.tower.config)
    config._attn_implementation = "sdpa"
    tower = _build_tower(type(encoder), config, dtype or encoder.dtype, device or encoder.device)
    tower.load_state_dict(encoder.tower.state_dict(), strict=True)
    return tower.eval().requires_grad_(False)


def _preset_preprocessor(preset: Preset) -> VisionPreprocessor:
    cls = family_class(preset.family)
    return VisionPreprocessor(
        cls.image_processor_class(**preset.image_processor),
        cls.video_processor_class(**preset.video_processor),
        cls.resize_rules,
    )


def load_preprocessor(
    preset: str | None = None, family: str | None = None, path: str | None = None
) -> tuple[str, VisionPreprocessor]:
    """(family, preprocessor) of a preset or checkpoint, without building the tower (for routers)."""
    if path is not None:
        directory = resolve_checkpoint_dir(path)
        found_family, _ = _detect_family(_read_config(directory), directory)
        if family is not None and family != found_family:
            raise CheckpointError(
                f"checkpoint {directory} is a {found_family} model, but family {family!r} was requested"
            )
        return found_family, _load_processors(FAMILIES[found_family], directory)
    found = resolve_preset(family, preset or "tiny")
    return found.family, _preset_preprocessor(found)


def vlm_config(preset: str | Preset, family: str | None = None):
    """The full VLM config (vision + language) of a preset."""
    found = preset if isinstance(preset, Preset) else resolve_preset(family, preset)
    if found.text_config is None:
        raise ValueError(f"preset {found.name!r} has no language-model config; load a checkpoint instead")
    cls = family_class(found.family)
    return cls.vlm_config_class(
        vision_config=found.vision_config,
        text_config=found.text_config,
        tie_word_embeddings=found.tie_word_embeddings,
        **vlm_token_ids(found.special_tokens),
    )


def resolve_checkpoint_dir(path_or_id: str) -> Path:
    """A local directory as is; anything else is a hub id, downloaded (configs and safetensors only)."""
    local = Path(path_or_id).expanduser()
    if local.is_dir():
        return local
    if local.exists() or path_or_id.startswith((".", "/", "~")):
        raise CheckpointError(f"checkpoint path {path_or_id!r} is not a directory")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path_or_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja"]))
    except Exception as exc:  # the hub client raises many types; all mean "not available"
        raise CheckpointError(
            f"{path_or_id!r} is neither a local directory nor a downloadable hub model: {exc}"
        ) from exc


def _read_config(directory: Path) -> dict:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json in {directory}: not a transformers checkpoint")
    return json.loads(config_file.read_text())


def _detect_family(config: dict, directory: Path) -> tuple[str, bool]:
    """(family, whether the checkpoint is a full VLM) from a checkpoint's config.json."""
    model_type = config.get("model_type")
    for family, cls in FAMILIES.items():
        if model_type in cls.checkpoint_model_types:
            return family, model_type == cls.checkpoint_model_types[0]
    known = sorted(t for cls in FAMILIES.values() for t in cls.checkpoint_model_types)
    raise CheckpointError(
        f"checkpoint {directory} has model_type {model_type!r}, which is not a supported vision-language model "
        f"or vision tower (supported model_type values: {', '.join(known)})"
    )


def _safetensors_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {directory}")
    return files


def read_vision_state_dict(directory: Path, full_vlm: bool) -> dict[str, torch.Tensor]:
    """The tower's weights, prefixes stripped; reads only the vision keys from each file."""
    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if not full_vlm:
                    state[key] = handle.get_tensor(key)
                    continue
                for prefix in VISION_PREFIXES:
                    if key.startswith(prefix):
                        state[key[len(prefix) :]] = handle.get_tensor(key)
    if not state:
        raise CheckpointError(f"no vision-tower weights (keys under {' or '.join(VISION_PREFIXES)}) in {directory}")
    return state


def _load_processors(cls: type[QwenVisionEncoder], directory: Path) -> VisionPreprocessor:
    """The checkpoint's processors: their own config files, or (transformers >= 5.2x saves them
    nested) `processor_config.json`; else the family's published defaults, with a warning."""
    nested = {}
    if (directory / "processor_config.json").is_file():
        nested = json.loads((directory / "processor_config.json").read_text())
    defaults = next(p for p in PRESETS.values() if p.family == cls.family and not p.name.endswith("-tiny"))

    def load(processor_class, filename: str, key: str, default: dict):
        if (directory / filename).is_file():
            return processor_class.from_pretrained(str(directory))
        if isinstance(nested.get(key), dict):
            settings = {k: v for k, v in nested[key].items() if not k.endswith("_type") and k != "processor_class"}
            return processor_class(**settings)
        logger.warning("%s has no %s; using %s's published defaults", directory, filename, defaults.name)
        return processor_class(**default)

    return VisionPreprocessor(
        load(cls.image_processor_class, "preprocessor_config.json", "image_processor", defaults.image_processor),
        load(cls.video_processor_class, "video_preprocessor_config.json", "video_processor", defaults.video_processor),
        cls.resize_rules,
    )


def from_checkpoint(
    path_or_id: str,
    family: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attention: str | AttentionBackend = "auto",
) -> QwenVisionEncoder:
    """Load the vision tower and processors of a checkpoint directory or hub id; `attention`: its kernels."""
    directory = resolve_checkpoint_dir(path_or_id)
    config = _read_config(directory)
    found_family, full_vlm = _detect_family(config, directory)
    if family is not None and family != found_family:
        raise CheckpointError(f"checkpoint {directory} is a {found_family} model, but family {family!r} was requested")
    cls = FAMILIES[found_family]
    vision_config = cls.config_class(**(config["vision_config"] if full_vlm else config))
    tower = _build_tower(cls, vision_config, dtype, device)
    state = read_vision_state_dict(directory, full_vlm)
    missing, unexpected = _key_mismatch(tower, state)
    if missing or unexpected:
        raise CheckpointError(
            f"vision weights in {directory} do not match a {found_family} tower: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    tower.load_state_dict(state, strict=True)
    logger.info("loaded %s vision tower (%d tensors) from %s", found_family, len(state), directory)
    return cls(tower, _load_processors(cls, directory), name=str(path_or_id), attention=attention)


def _key_mismatch(tower: torch.nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    expected = set(tower.state_dict())
    return sorted(expected - set(state)), sorted(set(state) - expected)
