"""Counters of what the runner did: graph hits and misses, padding waste, eager fallbacks."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

EAGER_REASONS = (
    "oversize",  # the pack is larger than the largest budget
    "no_graph",  # no graph fits (disabled by a check)
    "warming",  # the graph that fits is not built yet (background warm-up in progress)
    "capacity",  # the pack has more attention segments than the fitting graph's buffers hold
    "cost",  # the measured costs say no graph (eager, or compiled on the exact layout) is faster
    "nonfinite",  # the graph produced NaN/inf at run time; the pack was recomputed eagerly
    "mismatch",  # the graph's first real pack disagreed with eager; recomputed eagerly, graph disabled
)


@dataclass(frozen=True)
class PackReport:
    """How the last pack ran (for per-pack metrics)."""

    budget: int | None
    """The fitting token budget (None: larger than every budget)."""
    real_tokens: int
    graph: bool
    """True when a graph (or, on CPU, the static buffers) ran it."""
    eager_reason: str | None = None
    compiled: bool = False
    """An eager run that went through the compiled forward on the pack's exact layout."""
    recompile_fallback: bool = False
    """An eager run that would have needed a compile and ran uncompiled instead."""
    recurring: bool = False
    """A graph run by a recurring pack's own graph (its exact layout: no padding)."""


@dataclass
class RunnerStats:
    """Cumulative counters; `snapshot()` gives a plain dict for metrics and `/v1/models`."""

    graph_hits: Counter = field(default_factory=Counter)
    """Packs served by a graph, per token budget."""
    graph_misses: Counter = field(default_factory=Counter)
    """Packs that fit a budget but ran eagerly, per token budget."""
    eager_fallbacks: Counter = field(default_factory=Counter)
    """Eager runs per reason (see EAGER_REASONS)."""
    real_tokens: int = 0
    """Output tokens of real items computed by graphs."""
    padded_tokens: int = 0
    """Output tokens of padding computed by graphs."""
    disabled_graphs: int = 0
    """Graphs disabled by the self-check or at run time."""
    first_pack_checks: int = 0
    """Graphs whose first real pack was checked against eager."""
    first_pack_mismatches: int = 0
    """Of those, graphs whose first real pack disagreed (disabled; the pack served eagerly)."""
    first_pack_check_s: float = 0.0
    """Wall seconds those checks added to their packs' runs (the eager forward and the comparison)."""
    packs: int = 0
    items: int = 0
    split_packs: int = 0
    """Packs run as 2+ smaller graphs because that was cheaper than one padded graph."""
    compiled_exact: int = 0
    """Eager runs that went through the compiled forward on the pack's exact layout."""
    recompile_fallbacks: int = 0
    """Packs that would have needed a new compile and ran uncompiled instead: exact-layout packs,
    and (`compile` without `cuda_graphs`) a budget's padded layout, counted once per layout."""
    layout_compiles: int = 0
    """Graphs whose capture found the compiled forward would compile for their layout: compiled
    outside the device lock, then captured again (the warm-up's)."""
    recurring_hits: int = 0
    """Packs run by a recurring pack's own graph (not counted in `graph_hits`)."""
    recurring_captured: int = 0
    """Recurring packs' graphs captured and kept."""
    recurring_evicted: int = 0
    """Recurring packs' graphs dropped, least recently used first, past `recurring_graphs`."""
    recurring_sparse: int = 0
    """Sightings that would have earned a graph but recur among more than `recurring_graphs` other
    keys (the graph would be evicted before its next use), so none was captured."""
    recurring_rejected: Counter = field(default_factory=Counter)
    """Recurring packs refused a graph, per reason: "slower" than the planned route, "mismatch"
    with its own warm-up run, "error" while capturing, "memory" (too little free), "nonfinite"
    output at run time."""
    recurring_capture_s: float = 0.0
    """Wall seconds the packs that earned a graph spent on capturing, checking and timing it
    (accepted or refused), beyond their own run."""
    recurring_uncompiled: int = 0
    """Recurring packs' graphs that hold the uncompiled forward (the compiled one would have
    needed a compile)."""

    last: PackReport | None = None

    def record_graph(self, budget: int, real_tokens: int, recurring: bool = False) -> None:
        """`budget`: the pack's fitting budget; a recurring pack's graph computes no padding."""
        if recurring:
            self.recurring_hits += 1
        else:
            self.graph_hits[budget] += 1
            self.padded_tokens += budget - real_tokens
        self.real_tokens += real_tokens
        self.last = PackReport(budget, real_tokens, graph=True, recurring=recurring)

    def record_eager(
        self,
        reason: str,
        budget: int | None,
        real_tokens: int = 0,
        compiled: bool = False,
        recompile_fallback: bool = False,
    ) -> None:
        assert reason in EAGER_REASONS, reason
        self.eager_fallbacks[reason] += 1
        self.compiled_exact += compiled
        if budget is not None:
            self.graph_misses[budget] += 1
        self.last = PackReport(budget, real_tokens, False, reason, compiled, recompile_fallback)

    @property
    def padding_waste(self) -> float:
        """Padded tokens / computed tokens over all graph replays."""
        computed = self.real_tokens + self.padded_tokens
        return self.padded_tokens / computed if computed else 0.0

    def snapshot(self) -> dict:
        return {
            "packs": self.packs,
            "items": self.items,
            "graph_hits": dict(self.graph_hits),
            "graph_misses": dict(self.graph_misses),
            "eager_fallbacks": {reason: self.eager_fallbacks[reason] for reason in EAGER_REASONS},
            "padding_waste": round(self.padding_waste, 4),
            "disabled_graphs": self.disabled_graphs,
            "first_pack_checks": self.first_pack_checks,
            "first_pack_mismatches": self.first_pack_mismatches,
            "first_pack_check_s": round(self.first_pack_check_s, 3),
            "split_packs": self.split_packs,
            "compiled_exact": self.compiled_exact,
            "recompile_fallbacks": self.recompile_fallbacks,
            "layout_compiles": self.layout_compiles,
            "recurring_hits": self.recurring_hits,
            "recurring_captured": self.recurring_captured,
            "recurring_evicted": self.recurring_evicted,
            "recurring_sparse": self.recurring_sparse,
            "recurring_rejected": dict(self.recurring_rejected),
            "recurring_capture_s": round(self.recurring_capture_s, 3),
            "recurring_uncompiled": self.recurring_uncompiled,
        }
