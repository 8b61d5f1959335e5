"""The encoder runner: per-(budget, max_seqlen) CUDA graphs over shared static buffers.

`EncoderRunner.run(pixel_values, specs)` runs one pack (one modality) and returns per-item
outputs. It picks the smallest budget that fits and the smallest attention-length bucket
that holds the pack's longest frame, copies the pack into that graph's static buffers
(padding rows zeroed), replays, and copies the used rows out so the next replay cannot
overwrite them. It runs eagerly instead when the pack is larger than every budget, when
no graph fits (or the CPU, where there are no graphs), or when the costs measured at
startup say eager is faster for a pack of this size. "Eagerly" means on the pack's exact
layout (no padding rows). With `compile` (and `compile_exact`), a pack of equal attention
segments (one image, a video, same-size images) runs there through the same compiled forward
as the graphs, as one dense batch, warmed at startup so that no request pays for a compile;
its cost is measured apart from uncompiled eager's.

Routes without a graph are priced from startup timings, corrected by what they measure on
the packs they serve (`RouteCosts._learn`): a scale per (route, budget), since the startup timings miss
host launch time, and a cold cost for an attention shape no such route has run yet (cuDNN
builds a graph per dense shape, ~60-68 ms on the H100), which new shapes are priced with.

Items run in a canonical order (`canonical_order`: longest segment first) and come back in the
caller's: the same items in any order are one layout.

A pack that recurs (the same items' grids, in any order, seen `recurring_after` times)
gets a graph of its own exact layout: no padding rows, each run of equal segments as one dense
attention batch, position metadata baked into its own input buffers, outputs in views of the shared
static outputs, intermediates in the shared pool. That request runs by its plan, timed; then
the graph is captured, checked against its own warm-up run, timed the same way, and kept
(least recently used evicted past `recurring_graphs`) only if it beat the plan on that pack.

On CPU the same buffers, padding and slicing run through `forward_padded` without graphs,
so CI covers everything but the capture itself.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from models import attention
from models.protocol import (
    EncoderOutput,
    ItemOutput,
    ItemSpec,
    PackCapacityError,
    PackLayout,
    TensorSpec,
    VisionEncoder,
)

from .budgets import (
    buckets_for_budget,
    fitting_budget,
    segment_capacity,
    seqlen_buckets,
)
from .buffers import StaticBuffers
from .config import GraphConfig, build_ladder  # callers import these from here too
from .entry import GraphEntry, GraphKey, PackKey, replay_cost
from .exact_route import ExactRoute, compile_state
from .memory import MemoryReport, check_fits, fit_memory_model, measure_peak_bytes, pool_reserved_bytes
from .recurring import RecurringGraphs
from .route_costs import RouteCosts, attention_shapes
from .selfcheck import relative_error, synthetic_pixels, synthetic_specs, time_ms
from .stats import RunnerStats

logger = logging.getLogger(__name__)

MAX_SPLIT = 3
"""Most graph replays one pack may be split into when that is cheaper than one padded graph."""


def _moved(out: EncoderOutput, device: torch.device) -> EncoderOutput:
    deepstack = None if out.deepstack is None else out.deepstack.to(device)
    return EncoderOutput(out.tokens.to(device), deepstack)


def canonical_order(specs: Sequence[ItemSpec]) -> list[int]:
    """Item indices in the order a pack runs: longest attention segment first, then most tokens,
    then by grid, stable among equal items. Outputs do not depend on the order (attention is per
    segment), so this only decides the layout."""

    def key(i: int):
        return -specs[i].frame_patches, -specs[i].output_tokens, specs[i].grid_thw

    return sorted(range(len(specs)), key=key)


class EncoderRunner(RecurringGraphs, ExactRoute):
    """Runs packs of one encoder through captured graphs (CUDA) or padded buffers (CPU)."""

    def __init__(self, encoder: VisionEncoder, config: GraphConfig = GraphConfig()):
        self.encoder = encoder
        self.config = config
        self.device = encoder.device
        self.use_graphs = config.cuda_graphs and self.device.type == "cuda"
        # Under the Triton kernel a budget takes three graphs at most (`TRITON_GRAPH_BUCKETS`);
        # under the others one per doubling bucket, which the fine steps would multiply.
        triton_buckets = attention.graph_seqlen_buckets() if self.device.type == "cuda" else None
        fine = self.device.type != "cuda" or triton_buckets is not None
        self.ladder, self.max_items = build_ladder(config, encoder.min_item_tokens, fine)
        self.max_segments = config.max_segments_per_pack or 2 * self.max_items
        self.stats = RunnerStats()
        self.memory = MemoryReport()
        self.capture_seconds = 0.0
        buckets = triton_buckets or seqlen_buckets(config.min_seqlen_bucket, self.ladder[-1] * encoder.merge_unit)
        layouts = [
            encoder.pack_layout(
                budget,
                seqlen,
                segment_capacity(budget * encoder.merge_unit, seqlen, config.segment_density, self.max_segments),
            )
            for budget in self.ladder
            for seqlen in buckets_for_budget(buckets, budget * encoder.merge_unit)
        ]
        specs = {(lay.token_budget, lay.max_seqlen): self._input_specs(lay) for lay in layouts}
        out_specs = {(lay.token_budget, lay.max_seqlen): self._output_specs(lay) for lay in layouts}
        self._inputs = StaticBuffers(specs.values(), self.device)
        self._outputs = StaticBuffers(out_specs.values(), self.device)
        self.memory.static_buffer_bytes = self._inputs.nbytes + self._outputs.nbytes
        self.entries: dict[GraphKey, GraphEntry] = {
            key: GraphEntry(key, lay, self._inputs.views(specs[key]), self._outputs.views(out_specs[key]))
            for key, lay in zip(specs, layouts)
        }
        self._by_budget = {
            budget: sorted((e for e in self.entries.values() if e.key[0] == budget), key=lambda e: e.key[1])
            for budget in self.ladder
        }
        self._pool = None
        self._side = None
        self._serving = False
        """True once `capture` is done: requests may no longer compile."""
        self._forward = self.encoder.forward_padded
        self._recurring: OrderedDict[PackKey, GraphEntry] = OrderedDict()
        self._sightings: OrderedDict[PackKey, int] = OrderedDict()
        """Times each pack key was seen; -1 once its graph was rejected (never tried again)."""
        self.costs = RouteCosts(self.device, self.ladder, self._by_budget)
        self._compiled = config.compile and self.device.type == "cuda"
        self._exact_compiled = False
        """True once the compiled forward is warmed for exact layouts (`_warm_exact`)."""
        self._exact_min_rows = 0
        """Smallest pack (input rows) the exact compile was seen to hold for: the warm-up's, then
        lowered by the startup measurements (Qwen2.5-VL's compile holds only from ~3420 rows)."""
        if self._compiled:
            import torch._dynamo

            # Each graph's layout (rows, segment slots, max_seqlen) may specialise the compiled
            # forward; dynamo's default recompile limit (8) would silently leave later graphs
            # uncompiled.
            limit = max(torch._dynamo.config.recompile_limit, 2 * len(self.entries) + 8)
            torch._dynamo.config.recompile_limit = limit
            torch._dynamo.config.accumulated_recompile_limit = max(
                torch._dynamo.config.accumulated_recompile_limit, 4 * limit
            )
            self._forward = torch.compile(self.encoder.forward_padded, dynamic=True)

    # ---- layout of the static buffers ----

    def _input_specs(self, layout: PackLayout) -> dict[str, TensorSpec]:
        rows = layout.token_budget * self.encoder.merge_unit
        pixels = TensorSpec((rows, self.encoder.patch_dim), self.encoder.dtype)
        return {"pixel_values": pixels, **self.encoder.metadata_specs(layout)}

    def _output_specs(self, layout: PackLayout) -> dict[str, TensorSpec]:
        out = {"tokens": TensorSpec((layout.token_budget, self.encoder.out_hidden), self.encoder.dtype)}
        if self.encoder.num_deepstack:
            shape = (self.encoder.num_deepstack, layout.token_budget, self.encoder.out_hidden)
            out["deepstack"] = TensorSpec(shape, self.encoder.dtype)
        out["finite"] = TensorSpec((layout.token_budget,), torch.bool)
        return out

    # ---- startup ----

    def capture(self, progress: Callable[[str], None] = logger.info) -> MemoryReport:
        """Capture every graph (largest first, one shared pool), then self-check. CPU: self-check only."""
        start = time.perf_counter()
        if self.use_graphs:
            self._check_memory()
            self._pool = torch.cuda.graph_pool_handle()
            self._side = torch.cuda.Stream(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            order = sorted(self.entries, reverse=True)
            for index, key in enumerate(order, 1):
                before = pool_reserved_bytes(self._pool, self.device)
                self._capture_entry(self.entries[key])
                self.memory.graph_bytes[key] = pool_reserved_bytes(self._pool, self.device) - before
                progress(
                    f"captured graph {index}/{len(order)}: budget {key[0]} tokens, max_seqlen {key[1]} "
                    f"(+{self.memory.graph_bytes[key] / 2**20:.1f} MiB)"
                )
            self.memory.peak_allocated_bytes = torch.cuda.max_memory_allocated(self.device)
        elif self._compiled:
            self._warm_compiled(progress)
        if self._compiled and self.config.compile_exact:
            try:
                self._warm_exact(progress)
            except Exception:  # an optimisation: the replica serves without it
                logger.exception("compiling the exact-layout route failed; packs without a graph run uncompiled")
        if (self.use_graphs or self._compiled) and self.config.self_check:
            self.self_check(progress)  # without graphs: the compiled forward, checked as graphs are
        self._serving = True
        self.capture_seconds = time.perf_counter() - start
        progress(f"graphs ready in {self.capture_seconds:.1f} s: {self.memory.summary()}")
        return self.memory

    def _warm_compiled(self, progress: Callable[[str], None]) -> None:
        """`compile` without `cuda_graphs`: packs run the compiled forward on the budgets' padded
        layouts, so compile it for each now (largest first, as graphs are captured), not on the
        first requests (tens of seconds each on the H100)."""
        order = sorted(self.entries, reverse=True)
        for index, key in enumerate(order, 1):
            entry = self.entries[key]
            self._fill_empty(entry)
            self._forward_into_outputs(entry)
            progress(f"compiled forward {index}/{len(order)}: budget {key[0]} tokens, max_seqlen {key[1]}")

    def _check_memory(self) -> None:
        # One unmeasured forward first: one-time allocations (library workspaces) must not enter
        # the line. Then two budgets far apart: a line through the two smallest, extrapolated
        # 128x to the largest, predicted 70 MiB for a 1048 MiB pool in a serving process.
        def forward_at(budget: int) -> Callable[[], object]:
            specs = synthetic_specs(budget, budget * self.encoder.merge_unit, self.encoder.merge_unit, 1)
            pixels = synthetic_pixels(specs, self.encoder.patch_dim, self.device)
            return lambda: self.encoder.forward_eager(pixels, specs)

        forward_at(self.ladder[0])()
        sampled = sorted({self.ladder[0], self.ladder[len(self.ladder) // 2]})
        model = fit_memory_model([(b, measure_peak_bytes(forward_at(b), self.device)) for b in sampled])
        free, _ = torch.cuda.mem_get_info(self.device)
        self.memory.predicted_pool_bytes = check_fits(
            model, self.ladder, self.memory.static_buffer_bytes, free, self.config.memory_fraction
        )

    def _forward_into_outputs(self, entry: GraphEntry) -> None:
        metadata = {name: t for name, t in entry.inputs.items() if name != "pixel_values"}
        forward = entry.forward or self._forward
        exact = entry.segments is not None
        lengths = attention.exact_segments(entry.segments) if exact else contextlib.nullcontext()
        # One fixed global state for every compiled call (see `compile_state`): a recurring pack's
        # graph, captured on a request, then finds the compile the budget graphs made at startup.
        with compile_state(), lengths:
            out = forward(entry.inputs["pixel_values"], metadata, entry.layout, *((True,) if exact else ()))
        entry.outputs["tokens"].copy_(out.tokens)
        finite = torch.isfinite(out.tokens).all(dim=-1)
        if out.deepstack is not None:
            entry.outputs["deepstack"].copy_(out.deepstack)
            finite &= torch.isfinite(out.deepstack).all(dim=-1).all(dim=0)
        # Per-row flags computed inside the graph: the host checks the used rows it copies out
        # anyway, instead of scanning the outputs again (on the CPU when they go to the host).
        entry.outputs["finite"].copy_(finite)

    def _fill_empty(self, entry: GraphEntry) -> None:
        """The entry's buffers as for a pack of no items (all padding): what capture runs on."""
        empty = torch.zeros(0, self.encoder.patch_dim, device=self.device)
        self._fill(entry, empty, self.encoder.pack_metadata([], entry.layout))

    def _capture_entry(self, entry: GraphEntry) -> None:
        self._fill_empty(entry)
        # Warm up outside capture (kernel selection, cuDNN plans, workspaces), then capture; both
        # pick attention kernels as for a graph.
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with attention.for_graph():
            with torch.cuda.stream(side):
                self._forward_into_outputs(entry)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._forward_into_outputs(entry)
        entry.graph = graph

    def self_check(self, progress: Callable[[str], None] = logger.info) -> None:
        """Replay each graph on a synthetic pack; disable it if it disagrees with eager or is not finite."""
        for key in sorted(self.entries):
            entry = self.entries[key]
            specs = synthetic_specs(*key, self.encoder.merge_unit, self.max_items)
            pixels = synthetic_pixels(specs, self.encoder.patch_dim, self.device, seed=key[0] + key[1])
            tokens = sum(s.output_tokens for s in specs)
            eager = self.encoder.forward_eager(pixels, specs)
            metadata = self.encoder.pack_metadata(specs, entry.layout)
            self._fill(entry, pixels, metadata)
            self._execute(entry)
            got = entry.outputs["tokens"][:tokens]
            error = relative_error(got, eager.tokens)
            if eager.deepstack is not None:
                error = max(error, relative_error(entry.outputs["deepstack"][:, :tokens], eager.deepstack))
            entry.self_check_error = error
            if not math.isfinite(error) or error > self.config.self_check_tolerance:
                self._disable(entry, f"self-check error {error:.3g} > {self.config.self_check_tolerance}")
                continue
            if self._exact_compiled:
                self._check_exact(entry, pixels, specs, eager)
            if self.use_graphs:
                # Copies in and out included: a split pays them per part (the replays alone
                # priced a 32 x 224x224 split at 24.97 ms against 25.00 for one graph). No warm-up
                # runs: the check above just ran the replay and the eager forward on these inputs.
                part = lambda: self._launch(entry, metadata, pixels, specs, self.device)  # noqa: E731
                entry.replay_ms = time_ms(part, self.device, warmup=0)
                eager_run = lambda: self.encoder.forward_eager(pixels, specs)  # noqa: E731
                entry.eager_ms = time_ms(eager_run, self.device, repeats=3, warmup=0)
        enabled = sum(e.enabled for e in self.entries.values())
        progress(f"self-check: {enabled}/{len(self.entries)} graphs enabled")

    def _disable(self, entry: GraphEntry, why: str) -> None:
        if entry.recurring:
            self._recurring.pop(entry.pack, None)
            self._reject_recurring(entry.pack, "nonfinite", why)
            return
        entry.enabled = False
        self.stats.disabled_graphs += 1
        logger.warning("disabled graph budget=%d max_seqlen=%d: %s", *entry.key, why)

    # ---- serving ----

    def run(
        self,
        pixel_values: torch.Tensor,
        specs: Sequence[ItemSpec],
        output_device: torch.device | str | None = None,
        recurring: bool = True,
    ) -> list[ItemOutput]:
        """Encode one pack (`pixel_values` rows in item order) and return one output per item, on
        `output_device` (default: the encoder's), copied once out of the static buffers.
        `recurring` False: neither run nor count toward the pack's own graph (what a pack seen
        for the first time costs; the benchmark times both)."""
        output_device = torch.device(output_device) if output_device is not None else self.device
        order = canonical_order(specs)
        if order != sorted(order):
            # Run the items in the pack's canonical order and hand the outputs back in the
            # caller's: the same items in any order are one pack (one recurring key, one layout),
            # and equal attention segments sit together (fewer runs for grouped attention).
            offsets = [0]
            for spec in specs:
                offsets.append(offsets[-1] + spec.input_patches)
            pixel_values = torch.cat([pixel_values[offsets[i] : offsets[i + 1]] for i in order])
            ran = self._run_ordered(pixel_values, [specs[i] for i in order], output_device, recurring)
            results: list[ItemOutput] = [None] * len(specs)  # type: ignore[list-item]
            for position, i in enumerate(order):
                results[i] = ran[position]
            return results
        return self._run_ordered(pixel_values, specs, output_device, recurring)

    def _run_ordered(
        self, pixel_values: torch.Tensor, specs: Sequence[ItemSpec], output_device: torch.device, recurring: bool
    ) -> list[ItemOutput]:
        self.costs.absorb_timing()
        self.stats.packs += 1
        self.stats.items += len(specs)
        tokens = sum(s.output_tokens for s in specs)
        budget = fitting_budget(self.ladder, tokens)
        key = tuple(s.grid_thw for s in specs)
        own = self._recurring.get(key) if recurring else None
        if own is not None:
            self._recurring.move_to_end(key)
            return self._run_graph(own, None, pixel_values, specs, output_device)
        parts = self._plan(specs, tokens, budget)
        if not (recurring and self._recurs(key, specs)):
            return self._run_plan(parts, pixel_values, specs, budget, tokens, output_device)
        # The sighting that earns the pack its own graph: run its plan timed, then capture and
        # time the graph; it is kept only if it beats the plan on this very pack.
        self._synchronize()
        start = time.perf_counter()
        outputs = self._run_plan(parts, pixel_values, specs, budget, tokens, output_device)
        self._synchronize()
        self.costs.absorb_timing()  # before the capture marks the pack's shapes as run
        self._capture_recurring(key, pixel_values, specs, (time.perf_counter() - start) * 1e3, output_device)
        return outputs

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _run_plan(
        self,
        parts: str | list,
        pixel_values: torch.Tensor,
        specs: Sequence[ItemSpec],
        budget: int | None,
        tokens: int,
        output_device: torch.device,
    ) -> list[ItemOutput]:
        if isinstance(parts, str):
            timed = parts == "cost" and self.use_graphs  # chosen by cost: learn what it really costs
            start = self.costs.timer() if timed else None
            out, compiled, fell_back = self._forward_exact(pixel_values, specs)
            if timed and not fell_back:  # a fallback also paid for the failed compiled attempt
                field = "exact_ms" if compiled else "eager_ms"
                entry = self._entries(budget, max(s.frame_patches for s in specs))[0]
                estimate = self.costs.startup_estimate_ms(entry, tokens, field)
                self.costs.time_route((field, budget), attention_shapes(specs), estimate, start)
            self.stats.record_eager(parts, budget, tokens, compiled=compiled, recompile_fallback=fell_back)
            return self._split(_moved(out, output_device), specs)
        if len(parts) == 1:
            _, entry, metadata = parts[0]
            return self._run_graph(entry, metadata, pixel_values, specs, output_device)
        self.stats.split_packs += 1
        start = self.costs.timer() if self.use_graphs else None
        offsets = [0]
        for spec in specs:
            offsets.append(offsets[-1] + spec.input_patches)
        # Every part is filled, replayed and copied out before any is checked: the finite check
        # waits for the GPU, and waiting after each part left the GPU idle while the next part's
        # inputs were copied in (a 32 x 224x224 pack split in two took 28.8 ms, against 25.0 ms
        # by the two replays).
        launched = []
        for indices, entry, metadata in parts:
            rows = [pixel_values[offsets[i] : offsets[i + 1]] for i in indices]  # views, copied once by _fill
            part_specs = [specs[i] for i in indices]
            taken = self._launch(entry, metadata, rows, part_specs, output_device)
            launched.append((indices, entry, rows, part_specs, taken))
        if start is not None:
            # The parts' replays were timed one at a time at startup; back to back they also pay
            # what waits between them (on the H100, a Qwen2.5-VL 32 x 224x224 split in two ran
            # 28.9 ms against 25.5 by its parts' timings, and one graph 25.7): learn the excess.
            self.costs.time_route(("split", budget), [], sum(replay_cost(e) for _, e, _ in parts), start)
        results: list[ItemOutput | None] = [None] * len(specs)
        for indices, entry, rows, part_specs, (out, finite) in launched:
            for i, item in zip(indices, self._finish(entry, out, finite, rows, part_specs, output_device)):
                results[i] = item
        return results

    def _launch(
        self,
        entry: GraphEntry,
        metadata: dict[str, torch.Tensor] | None,
        pixel_values: torch.Tensor | Sequence[torch.Tensor],
        specs: Sequence[ItemSpec],
        output_device: torch.device,
    ) -> tuple[EncoderOutput, torch.Tensor]:
        """Fill, replay and copy out, without waiting for the GPU: the outputs and their finite flag."""
        self._fill(entry, pixel_values, metadata)
        self._execute(entry)
        return self._take(entry, sum(s.output_tokens for s in specs), output_device)

    def _run_graph(
        self,
        entry: GraphEntry,
        metadata: dict[str, torch.Tensor] | None,
        pixel_values: torch.Tensor | Sequence[torch.Tensor],
        specs: Sequence[ItemSpec],
        output_device: torch.device,
    ) -> list[ItemOutput]:
        """`metadata` None: the entry's own (a recurring pack's, baked in)."""
        out, finite = self._launch(entry, metadata, pixel_values, specs, output_device)
        return self._finish(entry, out, finite, pixel_values, specs, output_device)

    def _finish(
        self,
        entry: GraphEntry,
        out: EncoderOutput,
        finite: torch.Tensor,
        pixel_values: torch.Tensor | Sequence[torch.Tensor],
        specs: Sequence[ItemSpec],
        output_device: torch.device,
    ) -> list[ItemOutput]:
        """The finite check (waits for the GPU): a graph whose output is not finite where eager's
        is gets disabled, and the pack is served eagerly."""
        tokens = sum(s.output_tokens for s in specs)
        budget = fitting_budget(self.ladder, tokens) if entry.recurring else entry.key[0]
        # Sliced before the wait, while the GPU still runs: slicing reads no data, and after the
        # wait it was host time added to the pack (~0.1 ms for 8 items on the H100 host's CPU).
        results = self._split(out, specs)
        if self.use_graphs and not bool(finite):
            if not isinstance(pixel_values, torch.Tensor):
                pixel_values = torch.cat(list(pixel_values))
            eager = self.encoder.forward_eager(pixel_values, specs)
            if bool(torch.isfinite(eager.tokens).all()):
                self._disable(entry, "non-finite output at run time")
            self.stats.record_eager("nonfinite", budget, tokens)
            return self._split(_moved(eager, output_device), specs)
        self.stats.record_graph(budget, tokens, recurring=entry.recurring)
        return results

    def _entries(self, budget: int, longest: int):
        """Enabled graphs of `budget` whose attention bucket holds a `longest`-patch frame, smallest first."""
        return [e for e in self._by_budget[budget] if e.key[1] >= longest and e.enabled]

    def _place(self, specs: Sequence[ItemSpec], budget: int):
        """(entry, metadata) of the first graph from `budget` up whose buffers hold the pack, or None.
        A pack with more segments than its own budget's graphs hold moves up a budget."""
        longest = max(s.frame_patches for s in specs)
        for larger in self.ladder[self.ladder.index(budget) :]:
            for entry in self._entries(larger, longest):
                try:
                    return entry, self.encoder.pack_metadata(specs, entry.layout)
                except PackCapacityError:
                    continue
        return None

    def _plan(self, specs: Sequence[ItemSpec], tokens: int, budget: int | None):
        """How to run a pack, from the costs measured at startup: a list of (item indices, entry,
        metadata) parts (one graph, or the pack split over smaller graphs), or the reason to run
        eagerly."""
        if budget is None:
            return "oversize"
        longest = max(s.frame_patches for s in specs)
        own = self._entries(budget, longest)
        if not own:
            return "no_graph"
        whole = list(range(len(specs)))
        if not self.use_graphs:  # CPU: no costs to compare; the static buffers run every pack that fits
            single = self._place(specs, budget)
            return [(whole, *single)] if single else "capacity"
        best: str | list = "cost"
        route = "eager_ms"
        new = self.costs.has_new_shape(attention_shapes(specs))
        cost = self.costs.eager_estimate_ms(own[0], tokens, new)
        if self._compiles_exact(specs):
            exact = self.costs.eager_estimate_ms(own[0], tokens, new, "exact_ms")
            if exact < cost:
                route, cost = "exact_ms", exact
        # The budget's smallest graph bounds every single-graph plan from below: no host metadata
        # is built for a plan that cannot beat eager.
        if replay_cost(own[0]) < cost:
            single = self._place(specs, budget)
            if single is None:
                best = "capacity"
            elif replay_cost(single[0]) < cost:
                best, cost = [(whole, *single)], replay_cost(single[0])
        split = self._split_plan(specs, budget)
        # What splits at this budget really cost over their parts' startup timings (learned).
        split_scale = self.costs.route_scale.get(("split", budget), 1.0)
        # Cheapest first: the parts' own token budgets bound the split's cost from below...
        if split and split_scale * sum(replay_cost(self._entries(b, m)[0]) for _, b, m in split) < cost:
            placed = [self._place([specs[i] for i in indices], b) for indices, b, _ in split]
            # ...but a part with more segments than its budget's graphs hold moves up a budget:
            # price the graphs it really lands in.
            if all(placed) and split_scale * sum(replay_cost(entry) for entry, _ in placed) < cost:
                best = [(indices, *where) for (indices, _, _), where in zip(split, placed)]
        if not isinstance(best, str):
            self.costs.forget((route, budget), new)
            if split and len(best) == 1:
                self.costs.forget(("split", budget), False)
        return best

    def _split_plan(self, specs: Sequence[ItemSpec], budget: int) -> list[tuple[list[int], int, int]] | None:
        """The pack's items first-fit-decreasing into packs of the next smaller budget: [(item
        indices, fitting budget, longest frame)] when that gives 2..MAX_SPLIT parts, each with a
        graph, else None. A pack just over a budget otherwise pays for up to 2x padding."""
        index = self.ladder.index(budget)
        if index == 0 or len(specs) < 2:
            return None
        capacity = self.ladder[index - 1]
        bins: list[list[int]] = []
        loads: list[int] = []
        for i in sorted(range(len(specs)), key=lambda i: -specs[i].output_tokens):
            tokens = specs[i].output_tokens
            for b, load in enumerate(loads):
                if load + tokens <= capacity:
                    bins[b].append(i)
                    loads[b] += tokens
                    break
            else:
                if tokens > capacity or len(bins) == MAX_SPLIT:
                    return None
                bins.append([i])
                loads.append(tokens)
        if len(bins) < 2:
            return None
        plan = []
        for indices, load in zip(bins, loads):
            indices.sort()
            longest = max(specs[i].frame_patches for i in indices)
            part_budget = fitting_budget(self.ladder, load)
            if not self._entries(part_budget, longest):
                return None
            plan.append((indices, part_budget, longest))
        return plan

    def _fill(
        self,
        entry: GraphEntry,
        pixel_values: torch.Tensor | Sequence[torch.Tensor],
        metadata: dict[str, torch.Tensor] | None,
    ) -> None:
        """Copy a pack (its rows, or consecutive blocks of them) and its metadata (None: the
        entry's own, kept) into the entry's static inputs; padding rows are zeroed."""
        for name, host in (metadata or {}).items():
            entry.inputs[name].copy_(host, non_blocking=True)
        static = entry.inputs["pixel_values"]
        used = 0
        for block in [pixel_values] if isinstance(pixel_values, torch.Tensor) else pixel_values:
            static[used : used + block.shape[0]].copy_(block)
            used += block.shape[0]
        static[used:].zero_()

    def _execute(self, entry: GraphEntry) -> None:
        if entry.graph is not None:
            entry.graph.replay()
        elif not (self._compiled and self._serving and entry.forward in (None, self._forward)):
            self._forward_into_outputs(entry)
        else:  # compiled, no graph, serving: no compile on a request (`_warm_compiled` made them)
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    self._forward_into_outputs(entry)
            except RuntimeError as error:
                if "fail_on_recompile" not in str(error):
                    raise
                self.stats.recompile_fallbacks += 1
                logger.warning("the compiled forward would recompile for budget %s; it runs uncompiled", entry.key)
                entry.forward = self.encoder.forward_padded
                self._forward_into_outputs(entry)

    def _take(self, entry: GraphEntry, tokens: int, device: torch.device) -> tuple[EncoderOutput, torch.Tensor]:
        """The used output rows, copied (once) out of the shared static outputs to `device`, and
        whether all of them are finite (a 0-dim tensor on the GPU, computed in the graph's stream
        after the copies; reading it waits)."""
        deepstack = entry.outputs.get("deepstack")
        out = EncoderOutput(
            tokens=entry.outputs["tokens"][:tokens].to(device, copy=True),
            deepstack=None if deepstack is None else deepstack[:, :tokens].to(device, copy=True),
        )
        return out, entry.outputs["finite"][:tokens].all()

    @staticmethod
    def _split(out: EncoderOutput, specs: Sequence[ItemSpec]) -> list[ItemOutput]:
        results, start = [], 0
        for spec in specs:
            end = start + spec.output_tokens
            deepstack = None if out.deepstack is None else out.deepstack[:, start:end]
            results.append(ItemOutput(tokens=out.tokens[start:end], deepstack=deepstack))
            start = end
        return results

    def describe(self) -> dict:
        """Budgets, graphs and stats for `/v1/models` and logs."""
        return {
            "budgets": list(self.ladder),
            "max_items_per_pack": self.max_items,
            "max_segments_per_pack": self.max_segments,
            "cuda_graphs": self.use_graphs,
            "compiled_exact_route": self._exact_compiled,
            "compiled_exact_min_rows": self._exact_min_rows if self._exact_compiled else None,
            "graphs": len(self.entries),
            "graphs_enabled": sum(e.enabled for e in self.entries.values()),
            "capture_seconds": round(self.capture_seconds, 2),
            "recurring_graphs": len(self._recurring),
            "learned_cold_ms": None if self.costs.cold_ms is None else round(self.costs.cold_ms, 2),
            # a copy first: a pack on the worker thread may add a key meanwhile
            "learned_route_scale": {
                f"{field}@{budget}": round(v, 3) for (field, budget), v in list(self.costs.route_scale.items())
            },
            "memory": self.memory.summary() if self.use_graphs else None,
            "stats": self.stats.snapshot(),
        }
