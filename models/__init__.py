"""Vision-encoder adapters over transformers: presets, loading, preprocessing, graph-safe forwards.

`models` never imports ray. `encoder_graphs` uses it only through `models.protocol`.
"""

from .loading import (
    FAMILIES,
    CheckpointError,
    family_class,
    from_checkpoint,
    from_preset,
    load_preprocessor,
    transformers_tower,
    vlm_config,
)
from .internvl import InternVLEncoder
from .presets import PRESETS, resolve_preset
from .processing import InvalidItemError, VisionPreprocessor
from .protocol import EncoderOutput, ItemOutput, ItemSpec, PackCapacityError, PackLayout, TensorSpec, VisionEncoder
from .qwen import QwenVisionEncoder
from .tiling import TilePreprocessor

__all__ = [
    "FAMILIES",
    "PRESETS",
    "CheckpointError",
    "EncoderOutput",
    "InternVLEncoder",
    "InvalidItemError",
    "ItemOutput",
    "ItemSpec",
    "PackCapacityError",
    "PackLayout",
    "QwenVisionEncoder",
    "TensorSpec",
    "TilePreprocessor",
    "VisionEncoder",
    "VisionPreprocessor",
    "family_class",
    "transformers_tower",
    "from_checkpoint",
    "from_preset",
    "load_preprocessor",
    "resolve_preset",
    "vlm_config",
]
