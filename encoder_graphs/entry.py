"""One graph slot (`GraphEntry`): a layout, its static buffer views, its state and, on CUDA, its graph."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.protocol import EncoderOutput, ItemSpec, PackLayout

GraphKey = tuple[int, int]
"""(token_budget, max_seqlen)."""
PackKey = tuple[tuple[int, int, int], ...]
"""A pack's items' grids (t, h, w) in canonical order: all its exact layout and metadata depend on."""

PENDING, LIVE, DISABLED = "pending", "live", "disabled"
"""An entry's states: built by the warm-up later, serving packs, or refused for good."""


@dataclass
class GraphEntry:
    """One (budget, max_seqlen) slot: its layout, buffer views and, on CUDA, its graph.

    State changes happen under the runner's device lock, so a pack sees one state throughout."""

    key: GraphKey
    layout: PackLayout
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    graph: torch.cuda.CUDAGraph | None = None
    state: str = PENDING
    replay_ms: float = math.nan
    """What a plan pays for one part in this graph: copy in (rows, metadata, padding zeroed),
    replay, copy out. A split pays it once per part."""
    self_check_error: float = math.nan
    verified: bool = False
    """Whether a real pack's output was checked against eager (its first pack's, or never needed)."""
    specs: tuple[ItemSpec, ...] | None = None
    """Set on an exact layout (a recurring pack's): its items, whose segments attention reads."""
    forward: Callable[..., EncoderOutput] | None = None
    """The forward it runs (None: the runner's padded forward); a recurring pack's graph may hold
    the uncompiled one where the compiled forward would have needed a compile."""
    pack: PackKey | None = None
    """Set on a recurring pack's own graph (exact layout, metadata baked in): that pack's key."""

    @property
    def live(self) -> bool:
        return self.state == LIVE

    @property
    def enabled(self) -> bool:
        """Not refused: live, or still to be built."""
        return self.state != DISABLED

    @property
    def recurring(self) -> bool:
        return self.pack is not None

    @property
    def dense(self) -> bool:
        """An exact layout of equal segments: attention is one dense batch."""
        return self.specs is not None and len({s.frame_patches for s in self.specs}) == 1


def replay_cost(entry: GraphEntry) -> float:
    """Measured replay ms; 0 when not measured (no timings: graphs off, or on CPU): then trusted."""
    return 0.0 if math.isnan(entry.replay_ms) else entry.replay_ms
