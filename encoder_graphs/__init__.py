"""Model-agnostic CUDA-graph management for vision encoders: budgets, packing, capture, replay.

Talks to model code only through `models.protocol` (never imports transformers). Names are
imported lazily (PEP 562): `encoder_graphs.budgets`, `.config` and `.packing` need only the
standard library, so a router or a config check does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BudgetConfigError": "budgets",
    "GraphConfig": "config",
    "Ladder": "config",
    "budget_ladder": "config",
    "GraphMemoryError": "memory",
    "Pack": "packing",
    "PackItem": "packing",
    "pack_items": "packing",
    "EncoderRunner": "runner",
    "WarmupStatus": "warmup",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
