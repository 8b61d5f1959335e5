"""Vision-encoder adapters over transformers: presets, loading, preprocessing, graph-safe forwards.

`models` never imports ray. `encoder_graphs` uses it only through `models.protocol`. Names are
imported lazily (PEP 562), so importing `models.protocol` does not import transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "FAMILIES": "loading",
    "CheckpointError": "loading",
    "family_class": "loading",
    "from_checkpoint": "loading",
    "from_preset": "loading",
    "load_preprocessor": "loading",
    "transformers_tower": "loading",
    "vlm_config": "loading",
    "PRESETS": "presets",
    "resolve_preset": "presets",
    "InvalidItemError": "processing",
    "VisionPreprocessor": "processing",
    "EncoderOutput": "protocol",
    "ItemOutput": "protocol",
    "ItemSpec": "protocol",
    "PackCapacityError": "protocol",
    "PackLayout": "protocol",
    "TensorSpec": "protocol",
    "VisionEncoder": "protocol",
    "QwenVisionEncoder": "qwen",
    "InternVLEncoder": "internvl",
    "TilePreprocessor": "tiling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
