"""What the routes without a graph cost (`RouteCosts`): startup curves, corrected by what they
measure on the packs they serve."""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence

import torch

from models.protocol import ItemSpec, segment_groups, segment_lengths

from .selfcheck import DeviceTimer

SIGHTINGS_KEPT = 4096
"""Pack keys (or attention shapes) remembered, least recently seen dropped."""
LEARNED_WEIGHT = 0.5
"""Weight of the newest measurement in a route's learned cost scale (an exponential average)."""
FORGET_HALF_LIFE = 128
"""Packs a route must lose to a graph for half of what it learned beyond its startup estimate (a
scale above 1, the cold cost) to be forgotten. A route is measured only when it runs, so without
forgetting one slow measurement (a host hiccup) would price it out for good; with it, a
priced-out route is tried again after a while and learns anew."""

RouteKey = tuple[str, int]
"""(route, budget): route "eager_ms" (uncompiled, exact layout), "exact_ms" (compiled, exact
layout) or "split" (a pack over several graphs)."""


def attention_shapes(specs: Sequence[ItemSpec]) -> list[tuple[int, int]]:
    """A pack's attention shapes on its exact layout: its runs of equal segments as (count, length),
    each one dense batch (a kernel library may build a plan per batch shape)."""
    return segment_groups(segment_lengths(specs))


def interpolate(points: Sequence[tuple[int, float]], tokens: int) -> float:
    """Piecewise-linear through (tokens, ms) points sorted by tokens, flat outside them."""
    xs = [x for x, _ in points]
    index = bisect_left(xs, tokens)
    if index == 0:
        return points[0][1]
    if index == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[index - 1], points[index]
    return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


class RouteCosts:
    """The costs of a runner's routes without a graph (and of its splits): startup curves per
    route, a learned scale per (route, budget) over them, and the cold cost of a new shape."""

    def __init__(self, device: torch.device):
        self.device = device
        self.clock = time.perf_counter
        """The host clock route timings read where there are no CUDA events."""
        self.forget_half_life = FORGET_HALF_LIFE
        self.startup: dict[str, tuple[tuple[int, float], ...]] = {}
        """Route -> (tokens, ms) of full packs measured at startup, ascending in tokens."""
        self.route_scale: dict[RouteKey, float] = {}
        """Measured / startup-estimated ms per (route, budget), learned from the packs served: the
        startup curves interpolate between full packs and miss host launch time."""
        self._shapes_run: OrderedDict[tuple[int, int], None] = OrderedDict()
        """Attention shapes already run on an exact layout (a new one may pay a plan build)."""
        self.cold_ms: float | None = None
        """What a new shape added to its first pack, learned from first packs (None: not yet)."""
        self._timing: tuple | None = None
        """A route's timing still running on the GPU: (key, shapes, estimate, timer)."""

    def set_startup(self, route: str, points: Sequence[tuple[int, float]]) -> None:
        """The startup curve of `route`: (tokens, ms) of full packs; non-finite points dropped."""
        self.startup[route] = tuple(sorted((int(t), float(ms)) for t, ms in points if math.isfinite(ms)))

    def startup_estimate_ms(self, route: str, tokens: int) -> float:
        """The startup curve at `tokens`; inf where the route was not measured (graphs trusted)."""
        points = self.startup.get(route)
        return interpolate(points, tokens) if points else math.inf

    def eager_estimate_ms(self, route: str, budget: int, tokens: int, new: bool) -> float:
        """A pack of `tokens` on `route`: the startup curve, scaled by what the route measured on
        this budget's packs, plus the learned cold cost if it has a shape never run."""
        scale = self.route_scale.get((route, budget), 1.0)
        cold = (self.cold_ms or 0.0) if new else 0.0
        return scale * self.startup_estimate_ms(route, tokens) + cold

    def timer(self) -> DeviceTimer:
        """A start mark: a CUDA event on the current stream (no wait), else `clock`."""
        return DeviceTimer(self.device, self.clock)

    def time_route(self, key: RouteKey, shapes: list, estimate_ms: float, start: DeviceTimer) -> None:
        """End a route's timing (`estimate_ms`: its startup estimate). CUDA: the GPU span, read
        once done, at the next pack (`absorb_timing`): no wait here."""
        if not math.isfinite(estimate_ms) or estimate_ms <= 0:
            self.mark_run(shapes)
            return
        start.stop()
        if start.device.type != "cuda":
            self._learn(key, shapes, start.ms(), estimate_ms)
            return
        if self._timing is not None:  # still running at this pack's start: dropped, its shapes built
            self.mark_run(self._timing[1])
        self._timing = (key, shapes, estimate_ms, start)

    def absorb_timing(self) -> None:
        if self._timing is not None and self._timing[-1].done():
            key, shapes, estimate_ms, timer = self._timing
            self._timing = None
            self._learn(key, shapes, timer.ms(), estimate_ms)

    def mark_run(self, shapes) -> None:
        for shape in shapes:
            self._shapes_run[shape] = None
            self._shapes_run.move_to_end(shape)
        while len(self._shapes_run) > SIGHTINGS_KEPT:
            self._shapes_run.popitem(last=False)

    def _learn(self, key: RouteKey, shapes: list, measured_ms: float, estimate_ms: float) -> None:
        """A pack of shapes all run before teaches the route's scale; a pack with a new shape
        teaches the cold cost (beyond the route's learned warm cost) once that scale is known."""

        def average(old: float | None, new: float) -> float:
            return new if old is None else (1 - LEARNED_WEIGHT) * old + LEARNED_WEIGHT * new

        cold = self.has_new_shape(shapes)
        self.mark_run(shapes)
        if not cold:
            self.route_scale[key] = average(self.route_scale.get(key), measured_ms / estimate_ms)
        elif key in self.route_scale:
            self.cold_ms = average(self.cold_ms, max(0.0, measured_ms - self.route_scale[key] * estimate_ms))

    def has_new_shape(self, shapes: list) -> bool:
        """Whether one of these attention shapes was never run on an exact layout."""
        return not all(shape in self._shapes_run for shape in shapes)

    def forget_scale(self, key: RouteKey) -> None:
        """Route `key` lost a pack to a graph: forget a little of its learned excess over its estimate."""
        scale = self.route_scale.get(key)
        if scale is not None and scale > 1.0:
            self.route_scale[key] = 1.0 + (scale - 1.0) * self._forget_factor()

    def forget_cold(self) -> None:
        """A pack with a new shape went to a graph: forget a little of the learned cold cost."""
        if self.cold_ms:
            self.cold_ms *= self._forget_factor()

    def _forget_factor(self) -> float:
        return 0.5 ** (1 / self.forget_half_life)
