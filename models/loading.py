"""Building encoders: from a preset (random weights) or from a checkpoint (dir or hub id).

A checkpoint is either a full VLM (`...ForConditionalGeneration`; only the vision weights are
read, under the family's `checkpoint_prefixes`: Qwen's `model.visual.` or `visual.`, InternVL's
`model.vision_tower.` and `model.multi_modal_projector.`, or the same without `model.`) or a
vision-only one: a Qwen tower saved by `save_pretrained`, or an InternVL VLM config with only
the tower's and projector's weights. Loading is strict: a missing or unexpected key is an error
that names it. What differs between families is behind each family class's building hooks
(`vlm_config`, `preset_tower_config`, `checkpoint_tower_config`, `build_tower`,
`make_preprocessor`, `transformers_reference`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from .attention import AttentionBackend
from .internvl import InternVLEncoder
from .presets import PRESETS, Preset, resolve_preset
from .processing import VisionPreprocessor
from .qwen import QwenVisionEncoder
from .qwen2_5_vl import Qwen2_5_VLEncoder
from .qwen2_vl import Qwen2VLEncoder
from .qwen3_vl import Qwen3VLEncoder
from .tiling import TilePreprocessor

logger = logging.getLogger(__name__)

Encoder = QwenVisionEncoder | InternVLEncoder
Preprocessor = VisionPreprocessor | TilePreprocessor
FAMILIES: dict[str, type[Encoder]] = {
    cls.family: cls for cls in (Qwen2VLEncoder, Qwen2_5_VLEncoder, Qwen3VLEncoder, InternVLEncoder)
}


class CheckpointError(ValueError):
    """A checkpoint that cannot serve as this service's vision tower."""


def family_class(family: str) -> type[Encoder]:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known families: {', '.join(FAMILIES)}")
    return FAMILIES[family]


def from_preset(
    preset: str | Preset,
    family: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    attention: str | AttentionBackend = "auto",
) -> Encoder:
    """An encoder with random weights (seeded) in a preset's shape; `attention`: its kernels."""
    found = preset if isinstance(preset, Preset) else resolve_preset(family, preset)
    cls = family_class(found.family)
    torch.manual_seed(seed)
    config = cls.preset_tower_config(found)
    tower = cls.build_tower(config, dtype, device)
    return cls(tower, _preset_preprocessor(found, config), name=found.name, attention=attention)


def transformers_tower(
    encoder: Encoder, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> torch.nn.Module:
    """transformers' own model holding the encoder's weights, run as users run it (untouched modules,
    sdpa attention): the independent reference for tests and the "HF" column of the benchmarks.
    Qwen: the family's vision tower (`tower(pixel_values, grid_thw)`); InternVL: an `InternVLModel`
    (`get_image_features(pixel_values)`)."""
    return type(encoder).transformers_reference(encoder, dtype or encoder.dtype, device or encoder.device)


def _preset_preprocessor(preset: Preset, config) -> Preprocessor:
    cls = family_class(preset.family)
    return cls.make_preprocessor(
        cls.image_processor_class(**preset.image_processor), cls.video_processor_class(**preset.video_processor), config
    )


def load_preprocessor(
    preset: str | None = None, family: str | None = None, path: str | None = None
) -> tuple[str, Preprocessor]:
    """(family, preprocessor) of a preset or checkpoint, without building the tower (for routers)."""
    if path is not None:
        directory = resolve_checkpoint_dir(path)
        config = _read_config(directory)
        found_family, full_vlm = _detect_family(config, directory)
        if family is not None and family != found_family:
            raise CheckpointError(
                f"checkpoint {directory} is a {found_family} model, but family {family!r} was requested"
            )
        cls = FAMILIES[found_family]
        return found_family, _load_processors(cls, directory, cls.checkpoint_tower_config(config, full_vlm))
    found = resolve_preset(family, preset or "tiny")
    return found.family, _preset_preprocessor(found, family_class(found.family).preset_tower_config(found))


def vlm_config(preset: str | Preset, family: str | None = None):
    """The full VLM config (vision + language) of a preset."""
    found = preset if isinstance(preset, Preset) else resolve_preset(family, preset)
    if found.text_config is None:
        raise ValueError(f"preset {found.name!r} has no language-model config; load a checkpoint instead")
    return family_class(found.family).vlm_config(found)


CONFIG_PATTERNS = ["*.json", "*.txt", "*.jinja"]
"""What a hub checkpoint's configs, tokenizer, processors and safetensors index are made of."""
SAFETENSORS_INDEX = "model.safetensors.index.json"


def resolve_checkpoint_dir(path_or_id: str) -> Path:
    """A local directory as is; anything else is a hub id, of which only the configs (and the
    safetensors index) are downloaded here: `fetch_vision_weights` brings the tower's weights."""
    local = Path(path_or_id).expanduser()
    if local.is_dir():
        return local
    if local.exists() or path_or_id.startswith((".", "/", "~")):
        raise CheckpointError(f"checkpoint path {path_or_id!r} is not a directory")
    return _download(path_or_id, CONFIG_PATTERNS)


def _download(hub_id: str, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(hub_id, allow_patterns=patterns))
    except Exception as exc:  # the hub client raises many types; all mean "not available"
        raise CheckpointError(f"{hub_id!r} is neither a local directory nor a downloadable hub model: {exc}") from exc


def vision_shards(index: dict, prefixes: dict[str, str] | None) -> list[str]:
    """The safetensors files of a sharded checkpoint (its `model.safetensors.index.json`) that hold a
    key under `prefixes` (the family's vision prefixes; None: a vision-only checkpoint, every file)."""
    weight_map = index.get("weight_map") or {}
    if prefixes is None:
        return sorted(set(weight_map.values()))
    return sorted({file for key, file in weight_map.items() if key.startswith(tuple(prefixes))})


def fetch_vision_weights(path_or_id: str, directory: Path, prefixes: dict[str, str] | None) -> None:
    """Download a hub checkpoint's weights that the tower needs: for a sharded full VLM only the
    shards holding vision keys (an 8B VLM's tower lies in one or two of its shards), otherwise its
    safetensors files. A local directory has them already."""
    if Path(path_or_id).expanduser().is_dir():
        return
    index_file = directory / SAFETENSORS_INDEX
    shards = vision_shards(json.loads(index_file.read_text()), prefixes) if index_file.is_file() else []
    _download(path_or_id, shards or ["*.safetensors"])


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


def read_vision_state_dict(directory: Path, prefixes: dict[str, str] | None) -> dict[str, torch.Tensor]:
    """The tower's weights; reads only the vision keys from each file. `prefixes`: checkpoint key
    prefix -> tower key prefix (None: keys as saved, a vision-only tower)."""
    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if prefixes is None:
                    state[key] = handle.get_tensor(key)
                    continue
                for prefix, tower_prefix in prefixes.items():
                    if key.startswith(prefix):
                        state[tower_prefix + key[len(prefix) :]] = handle.get_tensor(key)
                        break
    if not state:
        under = " or ".join(prefixes) if prefixes else "any name"
        raise CheckpointError(f"no vision-tower weights (keys under {under}) in {directory}")
    return state


def _load_processors(cls: type[Encoder], directory: Path, config) -> Preprocessor:
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

    return cls.make_preprocessor(
        load(cls.image_processor_class, "preprocessor_config.json", "image_processor", defaults.image_processor),
        load(cls.video_processor_class, "video_preprocessor_config.json", "video_processor", defaults.video_processor),
        config,
    )


def from_checkpoint(
    path_or_id: str,
    family: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attention: str | AttentionBackend = "auto",
) -> Encoder:
    """Load the vision tower and processors of a checkpoint directory or hub id; `attention`: its kernels."""
    directory = resolve_checkpoint_dir(path_or_id)
    config = _read_config(directory)
    found_family, full_vlm = _detect_family(config, directory)
    if family is not None and family != found_family:
        raise CheckpointError(f"checkpoint {directory} is a {found_family} model, but family {family!r} was requested")
    cls = FAMILIES[found_family]
    tower_config = cls.checkpoint_tower_config(config, full_vlm)
    prefixes = cls.checkpoint_prefixes if full_vlm else None
    fetch_vision_weights(path_or_id, directory, prefixes)
    tower = cls.build_tower(tower_config, dtype, device)
    state = read_vision_state_dict(directory, prefixes)
    missing, unexpected = _key_mismatch(tower, state)
    if missing or unexpected:
        raise CheckpointError(
            f"vision weights in {directory} do not match a {found_family} tower: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    tower.load_state_dict(state, strict=True)
    logger.info("loaded %s vision tower (%d tensors) from %s", found_family, len(state), directory)
    return cls(tower, _load_processors(cls, directory, tower_config), name=str(path_or_id), attention=attention)


def _key_mismatch(tower: torch.nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    expected = set(tower.state_dict())
    return sorted(expected - set(state)), sorted(set(state) - expected)
