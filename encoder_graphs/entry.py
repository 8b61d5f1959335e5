"""One graph slot (`GraphEntry`): a layout, its static buffer views and, on CUDA, its graph."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.protocol import EncoderOutput, PackLayout

GraphKey = tuple[int, int]
"""(token_budget, max_seqlen)."""
PackKey = tuple[tuple[int, int, int], ...]
"""A pack's items' grids (t, h, w) in canonical order: all its exact layout and metadata depend on."""


@dataclass
class GraphEntry:
    """One (budget, max_seqlen) slot: its layout, buffer views and, on CUDA, its graph."""

    key: GraphKey
    layout: PackLayout
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    graph: torch.cuda.CUDAGraph | None = None
    enabled: bool = True
    replay_ms: float = math.nan
    """What a plan pays for one part in this graph: copy in (rows, metadata, padding zeroed),
    replay, copy out. A split pays it once per part."""
    eager_ms: float = math.nan
    """Uncompiled eager forward of the self-check pack (exact layout)."""
    exact_ms: float = math.nan
    """Compiled exact-layout forward of the self-check pack's equal items, scaled to the budget."""
    self_check_error: float = math.nan
    segments: tuple[int, ...] | None = None
    """Set on an exact layout (a recurring pack's): its attention segment lengths, with which
    attention runs each run of equal segments as one dense batch."""
    forward: Callable[..., EncoderOutput] | None = None
    """The forward captured (None: the runner's); a recurring pack's graph may hold the
    uncompiled one where the compiled forward would have needed a compile."""
    pack: PackKey | None = None
    """Set on a recurring pack's own graph (exact layout, metadata baked in): that pack's key."""

    @property
    def recurring(self) -> bool:
        return self.pack is not None

    @property
    def dense(self) -> bool:
        """An exact layout of equal segments: attention is one dense batch."""
        return self.segments is not None and len(set(self.segments)) == 1


def replay_cost(entry: GraphEntry) -> float:
    """Measured replay ms; 0 when not measured (self-check off): then the graph is trusted."""
    return 0.0 if math.isnan(entry.replay_ms) else entry.replay_ms
