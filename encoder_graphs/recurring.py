"""Graphs of recurring packs' own exact layouts (`RecurringGraphs`): counted sightings, capture on the
sighting that earns one (seen often enough, and recently enough to stay kept until it is seen
again), kept only where they beat the pack's plan.

A recurring pack's graph has no padding rows, runs each run of equal segments as one dense
attention batch, bakes its position metadata into its own input buffers, writes views of the
shared static outputs and keeps its intermediates in the shared pool. It is captured on the
serving thread, so only once the warm-up is over (`enabled`): no capture then races the warm-up's.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import OrderedDict
from collections.abc import Sequence

import torch

from models.protocol import ItemSpec, VisionEncoder

from .capture import GraphCapture
from .config import GraphConfig
from .entry import LIVE, GraphEntry, PackKey
from .execute import EntryIO, Forwards, would_compile
from .memory import MemoryReport
from .route_costs import SIGHTINGS_KEPT, RouteCosts, attention_shapes
from .selfcheck import outputs_error, time_ms
from .stats import RunnerStats
from .table import GraphTable, input_specs, output_specs

logger = logging.getLogger(__name__)

RECURRING_MIN_FREE = 1 << 30
"""Free GPU memory (bytes) below which no recurring pack's graph is captured."""


class RecurringGraphs:
    """The recurring packs' graphs of one runner, least recently used first."""

    def __init__(
        self,
        encoder: VisionEncoder,
        config: GraphConfig,
        table: GraphTable,
        io: EntryIO,
        capture: GraphCapture | None,
        costs: RouteCosts,
        stats: RunnerStats,
        memory: MemoryReport,
    ):
        self.encoder, self.config, self.table, self.io = encoder, config, table, io
        self.capturer, self.costs, self.stats, self.memory = capture, costs, stats, memory
        self.forwards: Forwards = io.forwards
        self.entries: OrderedDict[PackKey, GraphEntry] = OrderedDict()
        self._sightings: OrderedDict[PackKey, int] = OrderedDict()
        """Times each pack key was seen; -1 once its graph was refused (never tried again)."""
        self.enabled = False
        """Set by the runner at the end of its warm-up."""
        self.min_free_bytes = RECURRING_MIN_FREE

    def lookup(self, key: PackKey) -> GraphEntry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            # a hit is a sighting too: it keeps the key's place among recent keys
            self._sightings[key] = self._sightings.pop(key, self.config.recurring_after)
        return entry

    def earns(self, key: PackKey, specs: Sequence[ItemSpec]) -> bool:
        """Count a sighting of `key`; True when this is the one that earns the pack its own graph.
        Packs larger than the largest budget's rows never do (their intermediates would grow the
        shared pool past what the budgets measured)."""
        if not self.enabled or self.config.recurring_graphs <= 0:
            return False
        if sum(s.input_patches for s in specs) > self.table.budgets[-1] * self.encoder.merge_unit:
            return False
        distance = self._reuse_distance(key)
        seen = self._sightings.pop(key, 0)
        if seen >= 0:
            seen += 1
        self._sightings[key] = seen
        while len(self._sightings) > SIGHTINGS_KEPT:
            self._sightings.popitem(last=False)
        if seen < self.config.recurring_after:
            return False
        if distance >= self.config.recurring_graphs:
            self.stats.recurring_sparse += 1
            return False
        return True

    def _reuse_distance(self, key: PackKey) -> int:
        """Distinct keys that could hold a graph (not refused ones) seen since `key` was last seen,
        counted up to `recurring_graphs` (0 for a new key). A key that recurs no more often than
        that many others would be evicted before its next sighting: capturing it would cost a
        capture per sighting and save nothing."""
        if key not in self._sightings:
            return 0
        limit, distance = self.config.recurring_graphs, 0
        for other in reversed(self._sightings):
            if other == key or distance >= limit:
                break
            if self._sightings[other] >= 0:
                distance += 1
        return distance

    def refuse(self, key: PackKey, why: str, detail: str = "") -> None:
        """Never try `key` again (counted per reason)."""
        self.entries.pop(key, None)
        self._sightings[key] = -1
        self.stats.recurring_rejected[why] += 1
        logger.info("no graph for a recurring pack of %d items: %s %s", len(key), why, detail)

    def capture(
        self,
        key: PackKey,
        pixel_values: torch.Tensor,
        specs: Sequence[ItemSpec],
        plan_ms: float,
        output_device: torch.device,
    ) -> None:
        """Capture (CUDA) or set up (CPU) the pack's own exact-layout graph. Refused, and the key
        never tried again: too little free memory, a capture error, a result that disagrees with
        its own warm-up run, or (where costs are measured) a run no faster than `plan_ms`, the
        plan's time on this pack timed the same way. Its inputs are its own plain tensors (dynamo
        guards on whether an input is a view)."""
        capturing = self.capturer is not None and self.capturer.started
        device = self.encoder.device
        if capturing and torch.cuda.mem_get_info(device)[0] < self.min_free_bytes:
            self.refuse(key, "memory")
            return
        layout = self.encoder.exact_layout(specs)
        with torch.inference_mode(False):  # not inference tensors, whatever the caller's mode
            inputs = {
                name: torch.zeros(spec.shape, dtype=spec.dtype, device=device)
                for name, spec in input_specs(self.encoder, layout).items()
            }
        outputs = self.table.outputs.views(output_specs(self.encoder, layout))
        entry = GraphEntry(
            (layout.token_budget, layout.max_seqlen), layout, inputs, outputs, specs=tuple(specs), pack=key
        )
        self.io.fill(entry, pixel_values, self.encoder.pack_metadata(specs, layout))
        pool_before = self.capturer.pool_bytes() if capturing else 0
        try:
            with self.encoder.capturing():
                expected = self._warm(entry)
                self.costs.mark_run(attention_shapes(specs))  # its attention is built now
                if capturing:
                    with self._stance(entry):
                        self.capturer.capture(entry, lambda: self.io.forward_into(entry))
            self.io.execute(entry)
            error = outputs_error(entry.outputs, expected)
        except Exception as exc:  # an optimisation: the pack still runs by its plan
            self.refuse(key, "error", f"{type(exc).__name__}: {exc}")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return
        if not math.isfinite(error) or error > self.config.self_check_tolerance:
            self.refuse(key, "mismatch", f"{error:.3g} against its warm-up run")
            return
        if self.table.costs_measured() and not self._faster(entry, pixel_values, plan_ms, output_device):
            self.refuse(key, "slower", f"{entry.replay_ms:.2f} ms >= {plan_ms:.2f} ms by its plan")
            return
        if capturing:
            grown = self.capturer.pool_bytes() - pool_before
            self.memory.recurring_bytes += sum(t.numel() * t.element_size() for t in inputs.values()) + grown
        entry.state, entry.verified = LIVE, True
        self._keep(key, entry)

    def _faster(self, entry: GraphEntry, pixel_values: torch.Tensor, plan_ms: float, output_device) -> bool:
        """Whether the entry's run (copy in, replay, copy out) beats the plan's `plan_ms`."""

        def run_own() -> None:
            self.io.fill(entry, pixel_values, None)
            self.io.execute(entry)
            self.io.take(entry, entry.specs, output_device)

        entry.replay_ms = time_ms(run_own, self.encoder.device, repeats=3, warmup=0)
        return entry.replay_ms < plan_ms

    def _keep(self, key: PackKey, entry: GraphEntry) -> None:
        self.entries[key] = entry
        self.stats.recurring_captured += 1
        while len(self.entries) > self.config.recurring_graphs:
            self.entries.popitem(last=False)
            self.stats.recurring_evicted += 1

    def _stance(self, entry: GraphEntry):
        """No compile on a request: the compiled forward raises where it would need one."""
        if self.forwards.compiled is not None and entry.forward is self.forwards.compiled:
            return torch.compiler.set_stance("fail_on_recompile")
        return contextlib.nullcontext()

    def _warm(self, entry: GraphEntry) -> dict[str, torch.Tensor]:
        """Run the entry once outside capture (on a side stream on CUDA) with the compiled forward,
        or the uncompiled one where that would need a compile. Returns copies of its outputs:
        what its graph must reproduce."""
        forwards = [f for f in (self.forwards.compiled, self.forwards.plain) if f is not None]
        for forward in forwards:
            entry.forward = forward
            try:
                with self._stance(entry):
                    if self.capturer is not None and self.capturer.started:
                        self.capturer.warm(lambda: self.io.forward_into(entry))
                    else:
                        self.io.forward_into(entry)
                break
            except RuntimeError as error:
                if not would_compile(error):
                    raise
                self.stats.recurring_uncompiled += 1
        return {name: tensor.clone() for name, tensor in entry.outputs.items()}
