"""The encoder runner: packs through per-(budget, max_seqlen) CUDA graphs over shared static buffers.

Startup: `prepare()` (seconds; from then on every pack runs eagerly on its exact layout), then
`warm_up()` (a background thread in a replica) switches graphs live one at a time (`warmup.py`).
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

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from models.protocol import EncoderOutput, ItemOutput, ItemSpec, VisionEncoder

from .cache_trust import signer
from .capture import GraphCapture
from .compile_cache import CompileCache, cache_key, environment
from .config import GraphConfig, Ladder, budget_ladder
from .entry import GraphEntry, GraphKey, replay_cost
from .exact_route import ExactRoute
from .execute import EntryIO, Forwards, moved_items
from .memory import MemoryReport
from .plan import EagerPlan, GraphPart, GraphPlan, Plan, Planner
from .recurring import RecurringGraphs
from .route_costs import RouteCosts, attention_shapes
from .selfcheck import pack_error
from .stats import RunnerStats
from .table import GraphTable
from .warmup import WarmUp, WarmupStatus

logger = logging.getLogger(__name__)


def canonical_order(specs: Sequence[ItemSpec]) -> list[int]:
    """Item indices in the order a pack runs: longest attention segment first, then most tokens,
    then by grid, stable among equal items. Outputs do not depend on the order (attention is per
    segment), so this only decides the layout."""

    def key(i: int):
        return -specs[i].frame_patches, -specs[i].output_tokens, specs[i].grid_thw

    return sorted(range(len(specs)), key=key)


class EncoderRunner:
    """Runs packs of one encoder through live graphs (CUDA), padded buffers (CPU) or eagerly."""

    def __init__(
        self,
        encoder: VisionEncoder,
        config: GraphConfig = GraphConfig(),
        ladder: Ladder | None = None,
        compiled_forward: Callable[..., EncoderOutput] | None = None,
    ):
        """`ladder`: the deployment's (default: computed from `config`); `compiled_forward`: a
        compiled `encoder.forward_padded` to use (default with `config.compile` on CUDA: the
        encoder's `compiled_forward`, its repeated layer compiled once by `torch.compile`; tests
        pass dynamo's "eager" backend on CPU)."""
        self.encoder = encoder
        self.config = config
        self.device = encoder.device
        self.ladder = ladder or budget_ladder(config, encoder.min_item_tokens)
        self.use_graphs = config.cuda_graphs and self.device.type == "cuda"
        self.stats = RunnerStats()
        self.memory = MemoryReport()
        self.table = GraphTable(encoder, config, self.ladder, self.stats)
        self.memory.static_buffer_bytes = self.table.static_bytes
        if compiled_forward is None and config.compile and self.device.type == "cuda":
            compiled_forward = encoder.compiled_forward(functools.partial(torch.compile, dynamic=True))
        self.forwards = Forwards(encoder.forward_padded, compiled_forward)
        self.io = EntryIO(encoder, self.forwards, self.stats)
        self.costs = RouteCosts(self.device)
        self.exact = ExactRoute(encoder, self.forwards, self.stats)
        self.capture = GraphCapture(self.device, self.memory) if self.use_graphs else None
        self.recurring = RecurringGraphs(
            encoder, config, self.table, self.io, self.capture, self.costs, self.stats, self.memory
        )
        self.planner = Planner(self.table, self.costs, self.exact)
        self.compile_cache = None if config.compile_cache is None else self._compile_cache(config.compile_cache)
        self.device_lock = threading.RLock()
        """Held by every pack and by each warm-up step that touches the device's shared state
        (see `warmup.py`); a replica takes it around its device-side preprocessing too."""
        self.warmup = WarmUp(self)

    def _compile_cache(self, root: str) -> CompileCache:
        layouts = {
            "dynamic": True,
            "regions": "layer",
            "graphs": sorted(self.table.entries),
            "max_segments": self.ladder.max_segments,
            "segment_density": self.config.segment_density,
            "cuda_graphs": self.use_graphs,
            "compile_exact": self.config.compile_exact,
        }
        key = cache_key(self.encoder.compile_identity(), layouts, environment(self.device))
        return CompileCache(root, key, signer(self.config.compile_cache_key_file, root))

    @property
    def entries(self) -> dict[GraphKey, GraphEntry]:
        """The budget graphs by (token_budget, max_seqlen)."""
        return self.table.entries

    # ---- startup ----

    def prepare(self, progress: Callable[[str], None] = logger.info) -> None:
        """Memory check (CUDA graphs: raises `GraphMemoryError`) and the eager path checked on a
        reference pack; seconds. Afterwards every pack runs (eagerly until graphs are live)."""
        self.warmup.prepare(progress)

    def warm_up(
        self, progress: Callable[[str], None] = logger.info, stop: threading.Event | None = None
    ) -> WarmupStatus:
        """Costs, compile, graphs (each live once checked), the exact route; until full speed or
        `stop`. Safe to run in a background thread while `run` serves packs."""
        return self.warmup.run(progress, stop or threading.Event())

    def warmup_status(self) -> WarmupStatus:
        return self.warmup.status()

    def live_budgets(self) -> tuple[int, ...]:
        """Ladder budgets whose packs replay a live graph (the router may prefer such replicas)."""
        return self.table.live_budgets()

    # ---- serving ----

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
        if budget is not None and not self.warmup.full_speed:
            self.warmup.note_demand(budget, max(s.frame_patches for s in specs))
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
            self.warmup.record_failed(entry)
        return eager

    def _disable(self, entry: GraphEntry, why: str) -> None:
        if entry.recurring:
            self.recurring.refuse(entry.pack, "nonfinite", why)
        else:
            self.table.disable(entry, why)

    # ---- reporting ----

    def describe(self) -> dict:
        """Budgets, graphs, warm-up and stats for `/v1/models` and logs."""
        return {
            "budgets": list(self.ladder.budgets),
            "graph_budgets": list(self.table.budgets),
            "live_budgets": list(self.live_budgets()),
            "max_items_per_pack": self.ladder.max_items,
            "max_segments_per_pack": self.ladder.max_segments,
            "cuda_graphs": self.use_graphs,
            "compiled_exact_route": self.exact.live,
            "compiled_exact_min_rows": self.exact.min_rows if self.exact.live else None,
            "graphs": len(self.table.entries),
            "graphs_enabled": self.table.enabled_count(),
            "graphs_live": self.table.live_count(),
            "warmup": self.warmup_status().as_dict(),
            "recurring_graphs": len(self.recurring.entries),
            "startup_costs_ms": {
                route: [[tokens, round(ms, 3)] for tokens, ms in points]
                for route, points in list(self.costs.startup.items())
            },
            "learned_cold_ms": None if self.costs.cold_ms is None else round(self.costs.cold_ms, 2),
            # a copy first: a pack on the worker thread may add a key meanwhile
            "learned_route_scale": {
                f"{route}@{budget}": round(v, 3) for (route, budget), v in list(self.costs.route_scale.items())
            },
            "memory": self.memory.summary() if self.use_graphs else None,
            "stats": self.stats.snapshot(),
        }
