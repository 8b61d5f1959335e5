"""The serving path of the encoder runner (`PackServer`): packs through per-(budget, max_seqlen) CUDA
graphs over shared static buffers, on the parts it shares with the warm-up (`parts.py`).

`run(pixel_values, specs)` runs one pack (one modality): the planner (`plan.py`) picks one live
graph, a split over smaller ones, or the exact layout without a graph (the compiled exact route
where it serves, else the encoder's eager forward); the pack is copied into the graph's static
buffers (padding rows zeroed), replayed, and its used rows copied out, so the next replay cannot
overwrite them. A graph's first real pack is checked against eager too. Items run in a canonical
order (longest segment first) and come back in the caller's. A pack that recurs gets a graph of
its own exact layout (`recurring.py`). On CPU the same buffers, padding and slicing run through
the padded forward without graphs, so CI covers everything but the capture itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from models.protocol import EncoderOutput, ItemOutput, ItemSpec

from .capture import GraphCapture
from .entry import GraphEntry, replay_cost
from .execute import moved_items
from .parts import RunnerParts
from .plan import EagerPlan, GraphPart, GraphPlan, Plan
from .route_costs import attention_shapes
from .selfcheck import pack_error


def canonical_order(specs: Sequence[ItemSpec]) -> list[int]:
    """Item indices in the order a pack runs: longest attention segment first, then most tokens,
    then by grid, stable among equal items. Outputs do not depend on the order (attention is per
    segment), so this only decides the layout."""

    def key(i: int):
        return -specs[i].frame_patches, -specs[i].output_tokens, specs[i].grid_thw

    return sorted(range(len(specs)), key=key)


class PackServer:
    """Runs packs of one encoder through live graphs (CUDA), padded buffers (CPU) or eagerly."""

    def __init__(self, parts: RunnerParts):
        """The parts' members are attributes too (for reading; `capture` and `device_lock` write through)."""
        self.parts = parts
        self.encoder = parts.encoder
        self.config = parts.config
        self.device = parts.device
        self.ladder = parts.ladder
        self.use_graphs = parts.use_graphs
        self.stats = parts.stats
        self.memory = parts.memory
        self.table = parts.table
        self.forwards = parts.forwards
        self.io = parts.io
        self.costs = parts.costs
        self.exact = parts.exact
        self.recurring = parts.recurring
        self.planner = parts.planner
        self.compile_cache = parts.compile_cache
        self.demand = parts.demand
        self.record = parts.record

    @property
    def device_lock(self) -> threading.RLock:
        """Held by every pack and by each warm-up step that touches the device's shared state;
        a replica takes it around its device-side preprocessing too."""
        return self.parts.device_lock

    @device_lock.setter
    def device_lock(self, lock: threading.RLock) -> None:
        self.parts.device_lock = lock

    @property
    def capture(self) -> GraphCapture | None:
        """The graph pool and capture the warm-up uses (None: no CUDA graphs)."""
        return self.parts.capture

    @capture.setter
    def capture(self, capture: GraphCapture | None) -> None:
        self.parts.capture = capture

    def run(
        self,
        pixel_values: torch.Tensor,
        specs: Sequence[ItemSpec],
        output_device: torch.device | str | None = None,
        recurring: bool = True,
    ) -> list[ItemOutput]:
        """Encode one pack (`pixel_values` rows in item order) and return one output per item, on
        `output_device` (default: the encoder's), copied out of the static buffers item after item.
        `recurring` False: neither run nor count toward the pack's own graph."""
        output_device = torch.device(output_device) if output_device is not None else self.device
        if output_device.type == "cuda" and output_device.index is None:  # as tensors name it: "cuda:0"
            output_device = torch.device("cuda", torch.cuda.current_device())
        with self.device_lock:
            order = canonical_order(specs)
            if order == sorted(order):
                return self._run_ordered(pixel_values, specs, output_device, recurring)
            # The same items in any order are one pack (one recurring key, one layout), and
            # equal attention segments sit together.
            offsets = [0]
            for spec in specs:
                offsets.append(offsets[-1] + spec.input_patches)
            pixel_values = torch.cat([pixel_values[offsets[i] : offsets[i + 1]] for i in order])
            ran = self._run_ordered(pixel_values, [specs[i] for i in order], output_device, recurring)
            results: list[ItemOutput] = [None] * len(specs)  # type: ignore[list-item]
            for position, i in enumerate(order):
                results[i] = ran[position]
            return results

    def _run_ordered(
        self, pixel_values: torch.Tensor, specs: Sequence[ItemSpec], output_device: torch.device, recurring: bool
    ) -> list[ItemOutput]:
        self.costs.absorb_timing()
        self.stats.packs += 1
        self.stats.items += len(specs)
        tokens = sum(s.output_tokens for s in specs)
        budget = self.table.fitting_budget(tokens)
        key = tuple(s.grid_thw for s in specs)
        own = self.recurring.lookup(key) if recurring else None
        if own is not None:
            return self._run_graph(own, None, pixel_values, specs, output_device)
        if budget is not None and not self.demand.full_speed:
            self.demand.note(budget, max(s.frame_patches for s in specs))
        plan = self.planner.plan(specs, tokens, budget)
        if isinstance(plan, GraphPlan):
            for beaten in plan.beaten:
                self.costs.forget_scale(beaten)
            if plan.new_shape:
                self.costs.forget_cold()
        if not (recurring and self.recurring.earns(key, specs)):
            return self._run_plan(plan, pixel_values, specs, budget, tokens, output_device)
        # The sighting that earns the pack its own graph: its plan timed, then the graph captured
        # and timed the same way; kept only if it beats the plan on this very pack.
        self._synchronize()
        start = time.perf_counter()
        outputs = self._run_plan(plan, pixel_values, specs, budget, tokens, output_device)
        self._synchronize()
        self.costs.absorb_timing()  # before the capture marks the pack's shapes as run
        captured = time.perf_counter()
        self.recurring.capture(key, pixel_values, specs, (captured - start) * 1e3, output_device)
        self.stats.recurring_capture_s += time.perf_counter() - captured
        return outputs

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _run_plan(
        self,
        plan: Plan,
        pixel_values: torch.Tensor,
        specs: Sequence[ItemSpec],
        budget: int | None,
        tokens: int,
        output_device: torch.device,
    ) -> list[ItemOutput]:
        if isinstance(plan, EagerPlan):
            return self._run_eager(plan.reason, pixel_values, specs, budget, tokens, output_device)
        if len(plan.parts) == 1:
            part = plan.parts[0]
            return self._run_graph(part.entry, part.metadata, pixel_values, specs, output_device)
        return self._run_split(plan.parts, pixel_values, specs, budget, output_device)

    def _run_eager(self, reason, pixel_values, specs, budget, tokens, output_device) -> list[ItemOutput]:
        """The pack on its exact layout; chosen by cost, it is timed to learn what it costs."""
        start = self.costs.timer() if reason == "cost" else None
        out, compiled, fell_back = self.exact.forward(pixel_values, specs)
        if start is not None and not fell_back:  # a fallback also paid for the failed compiled attempt
            route = "exact_ms" if compiled else "eager_ms"
            estimate = self.costs.startup_estimate_ms(route, tokens)
            self.costs.time_route((route, budget), attention_shapes(specs), estimate, start)
        self.stats.record_eager(reason, budget, tokens, compiled=compiled, recompile_fallback=fell_back)
        return moved_items(out, specs, output_device)

    def _run_split(
        self,
        parts: Sequence[GraphPart],
        pixel_values: torch.Tensor,
        specs: Sequence[ItemSpec],
        budget: int,
        output_device: torch.device,
    ) -> list[ItemOutput]:
        """Every part filled, replayed and copied out before any is checked: the finite check
        waits for the GPU, which would idle while the next part's inputs were copied in."""
        self.stats.split_packs += 1
        start = self.costs.timer()
        offsets = [0]
        for spec in specs:
            offsets.append(offsets[-1] + spec.input_patches)
        launched = []
        for part in parts:
            rows = [pixel_values[offsets[i] : offsets[i + 1]] for i in part.indices]  # views, copied once
            part_specs = [specs[i] for i in part.indices]
            taken = self.io.launch(part.entry, part.metadata, rows, part_specs, output_device)
            launched.append((part, rows, part_specs, taken))
        # The parts' replays were timed one at a time at startup; back to back they also pay
        # what waits between them: learn the excess.
        self.costs.time_route(("split", budget), [], sum(replay_cost(p.entry) for p in parts), start)
        results: list[ItemOutput | None] = [None] * len(specs)
        for part, rows, part_specs, (items, finite) in launched:
            for i, item in zip(part.indices, self._finish(part.entry, items, finite, rows, part_specs, output_device)):
                results[i] = item
        return results

    def _run_graph(self, entry, metadata, pixel_values, specs, output_device) -> list[ItemOutput]:
        """`metadata` None: the entry's own (a recurring pack's, baked in)."""
        items, finite = self.io.launch(entry, metadata, pixel_values, specs, output_device)
        return self._finish(entry, items, finite, pixel_values, specs, output_device)

    def _finish(
        self,
        entry: GraphEntry,
        results: list[ItemOutput],
        finite: torch.Tensor,
        pixel_values: torch.Tensor | Sequence[torch.Tensor],
        specs: Sequence[ItemSpec],
        output_device: torch.device,
    ) -> list[ItemOutput]:
        """The finite check (waits for the GPU) and, on a graph's first real pack, the check
        against eager: a graph that fails either is disabled and the pack served eagerly."""
        tokens = sum(s.output_tokens for s in specs)
        budget = self.table.fitting_budget(tokens) if entry.recurring else entry.key[0]
        if not bool(finite):
            rows = pixel_values if isinstance(pixel_values, torch.Tensor) else torch.cat(list(pixel_values))
            eager = self.encoder.forward_eager(rows, specs)
            if bool(torch.isfinite(eager.tokens).all()):
                self._disable(entry, "non-finite output at run time")
            self.stats.record_eager("nonfinite", budget, tokens)
            return moved_items(eager, specs, output_device)
        if not entry.verified and self.config.self_check:
            started = time.perf_counter()
            eager = self._first_pack_mismatch(entry, results, pixel_values, specs)
            self.stats.first_pack_check_s += time.perf_counter() - started
            if eager is not None:
                self.stats.record_eager("mismatch", budget, tokens)
                return moved_items(eager, specs, output_device)
        self.stats.record_graph(budget, tokens, recurring=entry.recurring)
        return results

    def _first_pack_mismatch(self, entry, items: list[ItemOutput], pixel_values, specs) -> EncoderOutput | None:
        """A graph's first real pack against the eager forward of the same items: None when they
        agree, else the eager output (the graph is disabled)."""
        rows = pixel_values if isinstance(pixel_values, torch.Tensor) else torch.cat(list(pixel_values))
        eager = self.encoder.forward_eager(rows, specs)
        entry.verified = True
        self.stats.first_pack_checks += 1
        # the items (page-locked on the host) go to the GPU before they are joined, not after
        device = eager.tokens.device
        tokens = torch.cat([item.tokens.to(device, non_blocking=True) for item in items])
        deepstack = None
        if items[0].deepstack is not None:
            deepstack = torch.cat([item.deepstack.to(device, non_blocking=True) for item in items], dim=1)
        error = pack_error(tokens, deepstack, eager)
        if error <= self.config.self_check_tolerance:  # False for NaN
            return None
        self.stats.first_pack_mismatches += 1
        self._disable(entry, f"first pack error {error:.3g} > {self.config.self_check_tolerance}")
        if not entry.recurring:
            self.record.graph_failed(entry.key)
        return eager

    def _disable(self, entry: GraphEntry, why: str) -> None:
        if entry.recurring:
            self.recurring.refuse(entry.pack, "nonfinite", why)
        else:
            self.table.disable(entry, why)
