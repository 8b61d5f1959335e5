"""Model-agnostic CUDA-graph management for vision encoders: budgets, packing, capture, replay.

Talks to model code only through `models.protocol` (never imports transformers).
"""

from .budgets import BudgetConfigError
from .config import GraphConfig, build_ladder
from .memory import GraphMemoryError
from .packing import Pack, PackItem, pack_items
from .runner import EncoderRunner

__all__ = [
    "BudgetConfigError",
    "EncoderRunner",
    "GraphConfig",
    "GraphMemoryError",
    "Pack",
    "PackItem",
    "build_ladder",
    "pack_items",
]
