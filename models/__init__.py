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
from .presets import PRESETS, resolve_preset
from .processing import InvalidItemError, VisionPreprocessor
from .protocol import EncoderOutput, ItemOutput, ItemSpec, PackCapacityError, PackLayout, TensorSpec, VisionEncoder
from .qwen import QwenVisionEncoder

__all__ = [
    "FAMILIES",
    "PRESETS",
    "CheckpointError",
    "EncoderOutput",
    "InvalidItemError",
    "ItemOutput",
    "ItemSpec",
    "PackCapacityError",
    "PackLayout",
    "QwenVisionEncoder",
    "TensorSpec",
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
