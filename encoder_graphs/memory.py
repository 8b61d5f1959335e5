"""Graph memory: a check before capture, and a report of what capture actually took.

Before capture we run the eager forward at two budgets (the smallest and the middle of the
ladder, after one unmeasured warm-up forward), read the peak allocation of each, and fit a
line (activation memory is linear in tokens: varlen attention keeps no quadratic buffers).
The graph pool holds about one largest forward's activations (graphs share one pool and
replay one at a time), so the line's value at the largest budget plus the static buffers
must fit in the allowed share of free memory, or capture is refused with the largest budget
that would fit. After capture, the report gives how much each graph's capture grew the pool
(the pool's own allocator segments, read from a snapshot), the total, and the peak
allocation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

MiB = 1 << 20


class GraphMemoryError(RuntimeError):
    """The budget ladder's graphs would not fit in free GPU memory."""


@dataclass(frozen=True)
class MemoryModel:
    """Peak activation bytes of one forward as `intercept + slope * tokens`."""

    intercept_bytes: float
    bytes_per_token: float

    def bytes_at(self, tokens: int) -> float:
        return self.intercept_bytes + self.bytes_per_token * tokens

    def max_tokens_within(self, available_bytes: float) -> int:
        return max(0, int((available_bytes - self.intercept_bytes) / max(self.bytes_per_token, 1.0)))


def measure_peak_bytes(forward: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated by `forward` above what was allocated before it."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    forward()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def pool_reserved_bytes(pool, device: torch.device) -> int:
    """Bytes of the allocator segments that belong to one graph memory pool (allocator snapshot):
    exact for the pool whatever else is cached, but it walks every block (recurring graphs'
    accounting; a warm-up capture reads the growth of `memory_reserved` instead)."""
    wanted = tuple(pool)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sum(
        segment["total_size"]
        for segment in torch.cuda.memory_snapshot()
        if segment.get("device") == index and tuple(segment.get("segment_pool_id", ())) == wanted
    )


def fit_memory_model(samples: Sequence[tuple[int, int]]) -> MemoryModel:
    """A line through (tokens, peak bytes) samples (the first and last)."""
    (t0, b0), (t1, b1) = samples[0], samples[-1]
    slope = (b1 - b0) / (t1 - t0) if t1 != t0 else b1 / max(t1, 1)
    return MemoryModel(intercept_bytes=max(0.0, b0 - slope * t0), bytes_per_token=max(slope, 0.0))


def check_fits(model: MemoryModel, ladder: Sequence[int], static_bytes: int, free_bytes: int, fraction: float) -> int:
    """Predicted pool bytes for the ladder; raises GraphMemoryError naming a maximum that fits."""
    allowed = free_bytes * fraction - static_bytes
    predicted = model.bytes_at(ladder[-1])
    if predicted > allowed:
        fit = model.max_tokens_within(allowed)  # conservative: static buffers shrink with the budget too
        raise GraphMemoryError(
            f"CUDA graphs for budgets up to {ladder[-1]} tokens need about {predicted / MiB:.0f} MiB of graph pool "
            f"plus {static_bytes / MiB:.0f} MiB of static buffers, but only {allowed / MiB + static_bytes / MiB:.0f} "
            f"MiB ({fraction:.0%} of {free_bytes / MiB:.0f} MiB free) may be used; "
            f"set max_budget_tokens <= {fit} (or free GPU memory / raise memory_fraction)"
        )
    return int(predicted)


@dataclass
class MemoryReport:
    """What capture took, per graph and in total."""

    static_buffer_bytes: int = 0
    predicted_pool_bytes: int = 0
    graph_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    """Growth of the shared graph pool while capturing each (token_budget, max_seqlen) graph."""
    peak_allocated_bytes: int = 0
    recurring_bytes: int = 0
    """Recurring packs' graphs: their own input buffers (pixels and metadata) plus the shared
    pool's growth while capturing them (cumulative: not given back on eviction)."""

    @property
    def pool_bytes(self) -> int:
        return sum(self.graph_bytes.values())

    def per_budget_bytes(self) -> dict[int, int]:
        totals: dict[int, int] = {}
        for (budget, _), size in self.graph_bytes.items():
            totals[budget] = totals.get(budget, 0) + size
        return totals

    def summary(self) -> dict:
        return {
            "static_buffer_mib": round(self.static_buffer_bytes / MiB, 1),
            "predicted_pool_mib": round(self.predicted_pool_bytes / MiB, 1),
            "pool_mib": round(self.pool_bytes / MiB, 1),
            "per_budget_mib": {b: round(v / MiB, 1) for b, v in sorted(self.per_budget_bytes().items())},
            "peak_allocated_mib": round(self.peak_allocated_bytes / MiB, 1),
            "graphs": len(self.graph_bytes),
            "recurring_mib": round(self.recurring_bytes / MiB, 1),
        }
