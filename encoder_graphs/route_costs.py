"""What the routes without a graph cost (`RouteCosts`), learned from the packs they serve."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from models import attention
from models.layout import segment_lengths
from models.protocol import ItemSpec

from .entry import GraphEntry

SIGHTINGS_KEPT = 4096
"""Pack keys whose sightings (or rejection) the runner remembers, least recently seen dropped."""
LEARNED_WEIGHT = 0.5
"""Weight of the newest measurement in a route's learned cost scale (an exponential average)."""
FORGET_HALF_LIFE = 128
"""Packs a route without a graph must lose to a graph (a split, to one graph) for half of what it
learned beyond its startup estimate (a scale above 1, the cold cost) to be forgotten. A route is
measured only when it runs, so without forgetting, one slow measurement (a host hiccup, a compile
in another thread) would price it out for good. With it, a priced-out route is tried again after
a while and learns anew; what that costs shrinks with the margin it lost by (a route truly 6x over
its estimate, losing by 3x, runs again after ~300 lost packs)."""


def attention_shapes(specs: Sequence[ItemSpec]) -> list[tuple[int, int]]:
    """A pack's attention shapes on its exact layout: its runs of equal segments as (count,
    length), each one dense batch (cuDNN builds a graph per batch shape)."""
    return attention.segment_groups(segment_lengths(specs))


class RouteCosts:
    """The learned costs of a runner's routes without a graph (and of its splits): a scale per
    (route, budget) over the startup estimates, and the cold cost of a new attention shape."""

    def __init__(self, device: torch.device, ladder: tuple[int, ...], by_budget: dict[int, list[GraphEntry]]):
        self.device = device
        self.ladder = ladder
        self._by_budget = by_budget
        """The runner's graphs of each budget, smallest `max_seqlen` first: their startup timings."""
        self.route_scale: dict[tuple[str, int], float] = {}
        """(cost field, budget) -> measured / startup-estimated ms of a route without a graph
        ("eager_ms" uncompiled, "exact_ms" compiled), or of a pack split over several graphs
        ("split": against the sum of its parts' startup timings), learned from the packs it
        served. The startup costs interpolate between full packs and do not see host launch time:
        on a slow host the compiled exact route took 23.2 ms for a pack priced below its padded
        graph."""
        self._shapes_run: OrderedDict[tuple[int, int], None] = OrderedDict()
        """Attention shapes ((count, length) of a run of equal segments) run on an exact layout:
        by a route without a graph, the compiled route's startup check, or a recurring pack's
        warm-up. The first pack of a new shape builds cuDNN's attention graph for it: ~60-68 ms
        per dense shape on the H100 (`benchmarks/results/cold_probe.json`)."""
        self.cold_ms: float | None = None
        """What a new shape added to its first pack, learned from first packs (None: not yet)."""
        self._timing: tuple | None = None
        """A route's timing still running on the GPU: (scale key, shape, estimate, start, end)."""

    def timer(self):
        """A start mark: a CUDA event on the current stream (no wait), else the host clock."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def time_route(self, key: tuple[str, int], shapes: list, estimate_ms: float, start) -> None:
        """End a route's timing (`estimate_ms`: its startup estimate). CUDA: the GPU span between
        the two events, read once it is done (`absorb_timing`, at the next pack; no wait here).
        The span includes the GPU's idle gaps while the host launches: the cost that makes a
        route host-bound."""
        if not math.isfinite(estimate_ms) or estimate_ms <= 0:
            self.mark_run(shapes)
            return
        if not isinstance(start, torch.cuda.Event):
            self._learn(key, shapes, (time.perf_counter() - start) * 1e3, estimate_ms)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        if self._timing is not None:  # still running at this pack's start: dropped, its shapes built
            self.mark_run(self._timing[1])
        self._timing = (key, shapes, estimate_ms, start, end)

    def absorb_timing(self) -> None:
        if self._timing is not None and self._timing[-1].query():
            key, shapes, estimate_ms, start, end = self._timing
            self._timing = None
            self._learn(key, shapes, start.elapsed_time(end), estimate_ms)

    def mark_run(self, shapes) -> None:
        for shape in shapes:
            self._shapes_run[shape] = None
            self._shapes_run.move_to_end(shape)
        while len(self._shapes_run) > SIGHTINGS_KEPT:
            self._shapes_run.popitem(last=False)

    def _learn(self, key: tuple[str, int], shapes: list, measured_ms: float, estimate_ms: float) -> None:
        """A pack of shapes all run before teaches the route's scale; a pack with a new shape
        teaches the cold cost (what it took beyond the route's learned warm cost), once that
        scale is known (before, the two cannot be told apart: the pack only marks its shapes)."""

        def average(old: float | None, new: float) -> float:
            return new if old is None else (1 - LEARNED_WEIGHT) * old + LEARNED_WEIGHT * new

        cold = self.has_new_shape(shapes)
        self.mark_run(shapes)
        if not cold:
            self.route_scale[key] = average(self.route_scale.get(key), measured_ms / estimate_ms)
        elif key in self.route_scale:
            self.cold_ms = average(self.cold_ms, max(0.0, measured_ms - self.route_scale[key] * estimate_ms))

    def has_new_shape(self, shapes: list) -> bool:
        """Whether one of these attention shapes was never run by a route without a graph."""
        return not all(shape in self._shapes_run for shape in shapes)

    def forget(self, key: tuple[str, int], new: bool) -> None:
        """The route `key` lost this pack to a graph: forget a little of what it learned beyond its
        startup estimate (`FORGET_HALF_LIFE`), the cold cost too when the pack had a `new` shape."""
        factor = 0.5 ** (1 / FORGET_HALF_LIFE)
        scale = self.route_scale.get(key)
        if scale is not None and scale > 1.0:
            self.route_scale[key] = 1.0 + (scale - 1.0) * factor
        if self.cold_ms and new:
            self.cold_ms *= factor

    def eager_estimate_ms(self, entry: GraphEntry, tokens: int, new: bool, measured: str = "eager_ms") -> float:
        """Time of a pack of `tokens` without a graph (`measured`: "eager_ms" uncompiled, "exact_ms"
        compiled): interpolated between full packs measured at startup, scaled by what that route
        measured on this budget's packs so far, plus the learned cold cost if no route without a
        graph has run the pack's attention shape yet."""
        scale = self.route_scale.get((measured, entry.key[0]), 1.0)
        cold = (self.cold_ms or 0.0) if new else 0.0
        return scale * self.startup_estimate_ms(entry, tokens, measured) + cold

    def startup_estimate_ms(self, entry: GraphEntry, tokens: int, measured: str) -> float:
        budget, seqlen = entry.key
        own = getattr(entry, measured)
        if math.isnan(own):
            return math.inf  # not measured (self-check off): trust the graph
        index = self.ladder.index(budget)
        if index == 0:
            return own
        previous = self.ladder[index - 1]
        lower = [
            getattr(e, measured)
            for e in self._by_budget[previous]
            if e.key[1] <= seqlen and not math.isnan(getattr(e, measured))
        ]
        if not lower:
            return own
        share = (tokens - previous) / (budget - previous)
        return lower[-1] + (own - lower[-1]) * share
