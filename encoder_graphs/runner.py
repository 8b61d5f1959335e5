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
the packs they serve (`_learn`): a scale per (route, budget), since the startup timings miss
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
from dataclasses import dataclass

import torch

from models import attention
from models.layout import segment_lengths
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
    auto_ladder,
    buckets_for_budget,
    fitting_budget,
    segment_capacity,
    seqlen_buckets,
    validate_ladder,
)
from .buffers import StaticBuffers
from .memory import MemoryReport, check_fits, fit_memory_model, measure_peak_bytes, pool_reserved_bytes
from .selfcheck import relative_error, synthetic_pixels, synthetic_specs, time_ms
from .stats import RunnerStats

logger = logging.getLogger(__name__)

DEFAULT_MAX_ITEMS = 64
MAX_SPLIT = 3
"""Most graph replays one pack may be split into when that is cheaper than one padded graph."""
GraphKey = tuple[int, int]
"""(token_budget, max_seqlen)."""
PackKey = tuple[tuple[int, int, int], ...]
"""A pack's items' grids (t, h, w) in canonical order: all its exact layout and metadata depend on."""
SIGHTINGS_KEPT = 4096
"""Pack keys whose sightings (or rejection) the runner remembers, least recently seen dropped."""
RECURRING_MIN_FREE = 1 << 30
"""Free GPU memory (bytes) below which no recurring pack's graph is captured."""
LEARNED_WEIGHT = 0.5
"""Weight of the newest measurement in a route's learned cost scale (an exponential average)."""
FORGET_HALF_LIFE = 128
"""Packs a route without a graph must lose to a graph (a split, to one graph) for half of what it
learned beyond its startup estimate (a scale above 1, the cold cost) to be forgotten. A route is
measured only when it runs, so without forgetting, one slow measurement (a host hiccup, a compile
in another thread) would price it out for good. With it, a priced-out route is tried again after
a while and learns anew; what that costs shrinks with the margin it lost by (a route truly 6x over
its estimate, losing by 3x, runs again after ~300 lost packs)."""


@dataclass(frozen=True)
class GraphConfig:
    """How a runner lays out budgets and graphs (validated by the deployment's pydantic config)."""

    max_budget_tokens: int = 8192
    """Largest token budget (output tokens); larger packs run eagerly."""
    budgets: tuple[int, ...] | None = None
    """Explicit budget list; None: automatic ladder from `min_budget_tokens`."""
    min_budget_tokens: int = 64
    """Smallest budget of the automatic ladder (raised to the model's smallest item)."""
    budget_growth: float = 2.0
    """Ratio between consecutive budgets of the automatic ladder below `fine_budget_tokens`."""
    fine_budget_tokens: int = 128
    """From this budget up, the automatic ladder splits each doubling into `fine_budget_steps`."""
    fine_budget_steps: int = 8
    """Steps per doubling above `fine_budget_tokens` (1: keep doubling): no pack that large pads
    more than 1/`fine_budget_steps` of its budget. From ~128 tokens up a replay's time grows with
    its rows, padding included, in steps (Qwen3-VL-8B, H100, startup timings of one run: 2.4 ms at
    128 tokens, 3.5 at 256, 5.2 at 512, 9.4 at 1024; `encoder_bench_qwen3_session16.json`). One
    896x896 image (784 tokens) replays in 11.5 ms in the 832-token graph against 14.1 in the 1024
    one; 8 x 448x448 (1568 tokens) ran 16.1 ms in the 1664-token graph, 17.3 on the compiled exact
    route when the next budget was 2048 (`encoder_bench_qwen3_session15.md`). CUDA runners under
    attention backends other than
    "triton" keep the doubling budgets of this ladder only: they take a graph per doubling
    `max_seqlen` bucket, and 29 budgets would be ~180 graphs (`attention.graph_seqlen_buckets`).
    The router packs against the full ladder either way (its pack-fill metric then counts
    against budgets such a replica rounds up)."""
    max_items_per_pack: int | None = None
    """Most items one pack may hold; must be <= the smallest budget. None: min(64, smallest budget)."""
    max_segments_per_pack: int | None = None
    """Most attention segments (image frames; a video has one per temporal patch) any graph's
    buffers hold. None: twice the items per pack. Keep it tight: unused slots slow the
    attention kernel."""
    segment_density: int = 8
    """Each graph holds `segment_density` segments per `max_seqlen` of its rows (at least that
    many, at most `max_segments_per_pack`), so empty slots cost in proportion to rows, not to
    slots x max_seqlen. A pack with more segments than its graph holds moves up to the next
    budget whose graph holds it, or runs eagerly."""
    min_seqlen_bucket: int = 256
    """Smallest attention-length bucket, in patches; buckets double from it."""
    cuda_graphs: bool = True
    """Capture CUDA graphs (CUDA only; on CPU packs run padded without graphs)."""
    self_check: bool = True
    """Replay each graph on a synthetic pack at startup; disable any that disagrees with eager."""
    self_check_tolerance: float = 0.05
    """Largest relative error (max abs diff / max abs value) a graph may show against eager."""
    memory_fraction: float = 0.8
    """Share of free GPU memory the graphs and static buffers may take."""
    compile: bool = False
    """`torch.compile` the padded forward (dynamic shapes, one compile for every budget)
    before capture. Fuses the tower's elementwise work; costs startup time."""
    compile_exact: bool = True
    """With `compile`: packs of equal attention segments that run without a graph (larger
    than every budget, or cheaper unpadded by the measured costs) run through the compiled
    forward on their exact layout (one dense attention batch), not the transformers modules.
    Costs two more compiles at startup (one segment, several; the segment lengths are read at
    run time inside an opaque op, so the same compile also serves recurring graphs of mixed
    packs); the route is checked against eager at startup like the graphs (turned off if
    wrong) and offered only from the smallest size at which its compile was seen to hold. A
    pack that would still need a compile runs uncompiled and is counted
    (`recompile_fallbacks`). Packs of unequal segments take it under attention backend
    "triton" (one launch per layer over all segments); under the others they keep the padded
    graphs or uncompiled eager: each run of equal segments would be one more dense call's host
    time, which outside a graph cost more than it saved on some hosts (see `_compiles_exact`)."""
    recurring_graphs: int = 16
    """Most graphs of recurring packs' exact layouts kept (least recently used evicted); 0: off.
    Each costs its own input buffers (its pixels and metadata: ~18 MiB for 8 x 448x448 of
    Qwen3-VL-8B) and whatever the shared pool grows by while capturing it (both reported)."""
    recurring_after: int = 2
    """A pack gets its own graph the time its key (items' grids, in any order) is seen this often."""


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


@contextlib.contextmanager
def _exact_state():
    """The global state every compiled call runs in (budget graphs' capture, the exact route, a
    recurring pack's graph), whatever the caller's. Dynamo
    guards on global state such as grad mode: the deployment's worker thread runs with grad
    on, the benchmark under `inference_mode` (grad off); either would miss a compile made in
    the other state. Not inference mode itself: compiling views under it fails on torch 2.11
    (see `forward_padded`)."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def _moved(out: EncoderOutput, device: torch.device) -> EncoderOutput:
    deepstack = None if out.deepstack is None else out.deepstack.to(device)
    return EncoderOutput(out.tokens.to(device), deepstack)


def _shapes(specs: Sequence[ItemSpec]) -> list[tuple[int, int]]:
    """A pack's attention shapes on its exact layout: its runs of equal segments as (count,
    length), each one dense batch (cuDNN builds a graph per batch shape)."""
    return attention.segment_groups(segment_lengths(specs))


def canonical_order(specs: Sequence[ItemSpec]) -> list[int]:
    """Item indices in the order a pack runs: longest attention segment first, then most tokens,
    then by grid, stable among equal items. Outputs do not depend on the order (attention is per
    segment), so this only decides the layout."""

    def key(i: int):
        return -specs[i].frame_patches, -specs[i].output_tokens, specs[i].grid_thw

    return sorted(range(len(specs)), key=key)


def _replay_cost(entry: GraphEntry) -> float:
    """Measured replay ms; 0 when not measured (self-check off): then the graph is trusted."""
    return 0.0 if math.isnan(entry.replay_ms) else entry.replay_ms


def build_ladder(config: GraphConfig, smallest_item_tokens: int, fine: bool = True) -> tuple[tuple[int, ...], int]:
    """(budget ladder, max items per pack) for a model whose smallest item has this many tokens.
    `fine=False`: the automatic ladder without its fine steps (`fine_budget_steps`)."""
    if config.budgets is not None:
        ladder = tuple(config.budgets)
    else:
        start = max(min(config.min_budget_tokens, config.max_budget_tokens), smallest_item_tokens)
        steps = config.fine_budget_steps if fine else 1
        ladder = auto_ladder(start, config.max_budget_tokens, config.budget_growth, config.fine_budget_tokens, steps)
    max_items = config.max_items_per_pack
    if max_items is None:
        max_items = min(DEFAULT_MAX_ITEMS, min(ladder, default=1))
    return validate_ladder(ladder, max_items), max_items


class EncoderRunner:
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
        self._route_scale: dict[tuple[str, int], float] = {}
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
        self._cold_ms: float | None = None
        """What a new shape added to its first pack, learned from first packs (None: not yet)."""
        self._timing: tuple | None = None
        """A route's timing still running on the GPU: (scale key, shape, estimate, start, end)."""
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

    def _warm_exact(self, progress: Callable[[str], None]) -> None:
        """Compile the forward for exact layouts now, not on a request: attention runs dense
        batches through the grouped op, which the padded graphs never do. One segment and
        several are compiled apart (Qwen3-VL's position interpolation specialises one image);
        several equal segments serve unequal ones too (the lengths are never traced).

        The packs are a quarter of the largest budget: the exact route serves large packs, and
        each Triton kernel is autotuned on the shapes of its first run."""
        start = time.perf_counter()
        unit = self.encoder.merge_unit
        merge = math.isqrt(unit)
        rows = self.ladder[-1] * unit // 4

        def image(height: int, width: int) -> ItemSpec:
            height, width = max(merge, height // merge * merge), max(merge, width // merge * merge)
            return ItemSpec("image", (1, height, width), height * width, height * width // unit)

        one, half = math.isqrt(rows), math.isqrt(rows // 2)
        warm = ([image(one, one)], [image(half, half)] * 2)
        for specs in warm:
            pixels = synthetic_pixels(specs, self.encoder.patch_dim, self.device)
            with _exact_state():
                self.encoder.forward_eager(pixels.to(self.encoder.dtype), specs, forward=self._forward)
        torch.cuda.synchronize(self.device)
        self._exact_min_rows = min(sum(s.input_patches for s in specs) for specs in warm)
        self._exact_compiled = True
        progress(f"compiled the exact-layout forward in {time.perf_counter() - start:.1f} s")

    def _compiles_exact(self, specs: Sequence[ItemSpec]) -> bool:
        """Whether the compiled exact route takes this pack: no smaller than the smallest pack its
        compile was seen to hold for, and one attention launch per layer: equal segments (one
        dense batch), or any segments under backend "triton" (its kernel over all of them,
        `attention.exact_in_one_call`). Outside a CUDA graph this route pays host time for every
        launch: a mixed pack's several dense calls per layer (cuDNN, FlashAttention-2) made it
        26-40 ms against its padded graph's ~28 ms from host to host (~130-320 us per dense call,
        `launch_probe.json`), which its cost measured on equal packs does not price; there mixed
        packs get grouped attention in their own recurring graph, where host time is not paid.
        With one Triton launch per layer the mixed pack ran 22.2-22.9 ms against 21.0 for its
        own graph and 24.4 for its first sighting's padded graphs."""
        return (
            self._exact_compiled
            and (len({s.frame_patches for s in specs}) == 1 or attention.exact_in_one_call())
            and sum(s.input_patches for s in specs) >= self._exact_min_rows
        )

    def _compiled_exact(self, pixel_values: torch.Tensor, specs: Sequence[ItemSpec]) -> EncoderOutput | None:
        """The compiled forward on the pack's exact layout; None where that would need a compile
        (seconds, on the request path): dynamo raises instead of compiling."""
        try:
            with _exact_state(), torch.compiler.set_stance("fail_on_recompile"):
                # One copy at most: a caller's inference tensor (from its inference_mode) cannot
                # enter the compiled forward, and another dtype would recompile.
                pixel_values = pixel_values.to(self.encoder.dtype, copy=pixel_values.is_inference())
                return self.encoder.forward_eager(pixel_values, specs, forward=self._forward)
        except RuntimeError as error:
            if "fail_on_recompile" not in str(error):
                raise
            logger.debug("exact-layout pack of %d items would recompile: %s", len(specs), error)
            return None

    def _forward_exact(self, pixel_values: torch.Tensor, specs: Sequence[ItemSpec]) -> tuple[EncoderOutput, bool, bool]:
        """The pack on its exact layout: (output, whether the compiled forward ran it, whether it
        fell back because the compiled forward would have needed a compile; counted, warned once)."""
        fell_back = False
        if self._compiles_exact(specs):
            out = self._compiled_exact(pixel_values, specs)
            if out is not None:
                return out, True, False
            fell_back = True
            self.stats.recompile_fallbacks += 1
            if self.stats.recompile_fallbacks == 1:
                logger.warning("exact-layout pack of %d items would recompile; ran uncompiled", len(specs))
        return self.encoder.forward_eager(pixel_values, specs), False, fell_back

    def _forward_into_outputs(self, entry: GraphEntry) -> None:
        metadata = {name: t for name, t in entry.inputs.items() if name != "pixel_values"}
        forward = entry.forward or self._forward
        exact = entry.segments is not None
        lengths = attention.exact_segments(entry.segments) if exact else contextlib.nullcontext()
        # One fixed global state for every compiled call (see `_exact_state`): a recurring pack's
        # graph, captured on a request, then finds the compile the budget graphs made at startup.
        with _exact_state(), lengths:
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

    def _check_exact(
        self, entry: GraphEntry, pixels: torch.Tensor, specs: Sequence[ItemSpec], eager: EncoderOutput
    ) -> None:
        """The compiled exact-layout forward on the self-check pack's equal items: compared with
        eager (a wrong or non-finite result turns the route off, as a wrong graph is disabled),
        then timed into `entry.exact_ms`, scaled to the full budget. Where that forward would need
        a compile it is left unmeasured (NaN: not offered by cost); where it holds, it lowers the
        smallest size the route is offered for. Qwen2.5-VL's compile holds only from ~3420 rows
        up (inductor's matmul padding guards on the size)."""
        equal = [s for s in specs if s == specs[0]]
        rows, tokens = sum(s.input_patches for s in equal), sum(s.output_tokens for s in equal)
        out = self._compiled_exact(pixels[:rows], equal)
        if out is None:
            return
        self._mark_run(_shapes(equal))
        self._exact_min_rows = min(self._exact_min_rows, rows)
        error = relative_error(out.tokens, eager.tokens[:tokens])
        if eager.deepstack is not None:
            error = max(error, relative_error(out.deepstack, eager.deepstack[:, :tokens]))
        if not math.isfinite(error) or error > self.config.self_check_tolerance:
            self._exact_compiled = False
            logger.warning(
                "compiled exact-layout route turned off: self-check error %.3g > %s at %d rows",
                error,
                self.config.self_check_tolerance,
                rows,
            )
            return
        if self.use_graphs:
            # No warm-up: the check above just ran it.
            ms = time_ms(lambda: self._compiled_exact(pixels[:rows], equal), self.device, repeats=3, warmup=0)
            entry.exact_ms = ms * entry.key[0] / tokens

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
        self._absorb_timing()
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
        self._absorb_timing()  # before the capture marks the pack's shapes as run
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
            start = self._timer() if timed else None
            out, compiled, fell_back = self._forward_exact(pixel_values, specs)
            if timed and not fell_back:  # a fallback also paid for the failed compiled attempt
                field = "exact_ms" if compiled else "eager_ms"
                entry = self._entries(budget, max(s.frame_patches for s in specs))[0]
                estimate = self._startup_estimate_ms(entry, tokens, field)
                self._time_route((field, budget), _shapes(specs), estimate, start)
            self.stats.record_eager(parts, budget, tokens, compiled=compiled, recompile_fallback=fell_back)
            return self._split(_moved(out, output_device), specs)
        if len(parts) == 1:
            _, entry, metadata = parts[0]
            return self._run_graph(entry, metadata, pixel_values, specs, output_device)
        self.stats.split_packs += 1
        start = self._timer() if self.use_graphs else None
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
            self._time_route(("split", budget), [], sum(_replay_cost(e) for _, e, _ in parts), start)
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
        """Fill, replay and copy out, without waiting for the GPU: the outputs and finite flags."""
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
        if self.use_graphs and not bool(finite.all()):
            if not isinstance(pixel_values, torch.Tensor):
                pixel_values = torch.cat(list(pixel_values))
            eager = self.encoder.forward_eager(pixel_values, specs)
            if bool(torch.isfinite(eager.tokens).all()):
                self._disable(entry, "non-finite output at run time")
            self.stats.record_eager("nonfinite", budget, tokens)
            return self._split(_moved(eager, output_device), specs)
        self.stats.record_graph(budget, tokens, recurring=entry.recurring)
        return self._split(out, specs)

    # ---- recurring packs ----

    def _recurs(self, key: PackKey, specs: Sequence[ItemSpec]) -> bool:
        """Count a sighting of `key`; True when this is the one that earns the pack its own graph.
        Packs larger than the largest budget's rows never do (their intermediates would grow the
        shared pool past what the budgets measured)."""
        if self.config.recurring_graphs <= 0 or (self.use_graphs and self.device.type == "cuda" and self._pool is None):
            return False  # off, or the budgets' graphs not captured yet
        if sum(s.input_patches for s in specs) > self.ladder[-1] * self.encoder.merge_unit:
            return False
        seen = self._sightings.pop(key, 0)
        if seen >= 0:
            seen += 1
        self._sightings[key] = seen
        while len(self._sightings) > SIGHTINGS_KEPT:
            self._sightings.popitem(last=False)
        return seen >= self.config.recurring_after

    def _reject_recurring(self, key: PackKey, why: str, detail: str = "") -> None:
        self._sightings[key] = -1
        self.stats.recurring_rejected[why] += 1
        logger.info("no graph for a recurring pack of %d items: %s %s", len(key), why, detail)

    def _capture_recurring(
        self,
        key: PackKey,
        pixel_values: torch.Tensor,
        specs: Sequence[ItemSpec],
        plan_ms: float,
        output_device: torch.device,
    ) -> None:
        """Capture (CUDA) or set up (CPU) the pack's own exact-layout graph. Refused, and the key
        never tried again: too little free memory, a capture error, a result that disagrees with
        its own warm-up run, or (where costs are measured: graphs on) a run no faster than
        `plan_ms`, the plan's time on this pack, timed the same way (copy in, replay, copy out).
        Where the compiled forward would need a compile, the uncompiled forward is captured.

        Its inputs are its own plain tensors, as the compiled exact route's are (dynamo guards on
        whether an input is a view: views of the shared buffers would miss that compile)."""
        capture = self._pool is not None  # as the budgets' graphs were (CUDA, `cuda_graphs`)
        if capture and torch.cuda.mem_get_info(self.device)[0] < RECURRING_MIN_FREE:
            self._reject_recurring(key, "memory")
            return
        layout = self.encoder.exact_layout(specs)
        tokens = layout.token_budget
        with torch.inference_mode(False):  # not inference tensors, whatever the caller's mode
            inputs = {
                name: torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)
                for name, spec in self._input_specs(layout).items()
            }
        entry = GraphEntry(
            (tokens, layout.max_seqlen),
            layout,
            inputs,
            self._outputs.views(self._output_specs(layout)),
            segments=tuple(segment_lengths(specs)),
            pack=key,
        )
        self._fill(entry, pixel_values, self.encoder.pack_metadata(specs, layout))
        pool_before = pool_reserved_bytes(self._pool, self.device) if capture else 0
        try:
            # The warm-up picks the attention kernels its capture will (`attention.for_graph`), so
            # it builds them (cuDNN's dense plans) outside capture.
            with attention.for_graph():
                expected = self._warm_recurring(entry)
                self._mark_run(_shapes(specs))  # its attention is built now
                if capture:
                    graph = torch.cuda.CUDAGraph()
                    with self._recurring_stance(entry):
                        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                            self._forward_into_outputs(entry)
                    entry.graph = graph
            self._execute(entry)
            error = max(relative_error(entry.outputs[name], want) for name, want in expected.items())
        except Exception as exc:  # an optimisation: the pack still runs by its plan
            self._reject_recurring(key, "error", f"{type(exc).__name__}: {exc}")
            self._synchronize()
            return
        if not math.isfinite(error) or error > self.config.self_check_tolerance:
            self._reject_recurring(key, "mismatch", f"{error:.3g} against its warm-up run")
            return
        if self.use_graphs:

            def run_own() -> None:
                self._fill(entry, pixel_values, None)
                self._execute(entry)
                self._take(entry, tokens, output_device)

            entry.replay_ms = time_ms(run_own, self.device, repeats=3, warmup=0)
            if entry.replay_ms >= plan_ms:
                self._reject_recurring(key, "slower", f"{entry.replay_ms:.2f} ms >= {plan_ms:.2f} ms by its plan")
                return
        if capture:
            grown = pool_reserved_bytes(self._pool, self.device) - pool_before
            self.memory.recurring_bytes += sum(t.numel() * t.element_size() for t in inputs.values()) + grown
        self._recurring[key] = entry
        self.stats.recurring_captured += 1
        while len(self._recurring) > self.config.recurring_graphs:
            self._recurring.popitem(last=False)
            self.stats.recurring_evicted += 1

    def _recurring_stance(self, entry: GraphEntry):
        """No compile on a request: the compiled forward raises where it would need one."""
        if self._compiled and entry.forward is self._forward:
            return torch.compiler.set_stance("fail_on_recompile")
        return contextlib.nullcontext()

    def _warm_recurring(self, entry: GraphEntry) -> dict[str, torch.Tensor]:
        """Run the entry once outside capture (kernel selection, workspaces; on a side stream on
        CUDA) with the compiled forward, or the uncompiled one where that would need a compile.
        Returns copies of its outputs: what its graph must reproduce."""
        forwards = [self._forward, self.encoder.forward_padded] if self._compiled else [self.encoder.forward_padded]
        for forward in forwards:
            entry.forward = forward
            try:
                if self._side is not None:
                    side = self._side
                    side.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(side), self._recurring_stance(entry):
                        self._forward_into_outputs(entry)
                    torch.cuda.current_stream(self.device).wait_stream(side)
                else:
                    self._forward_into_outputs(entry)
                break
            except RuntimeError as error:
                if "fail_on_recompile" not in str(error):
                    raise
                self.stats.recurring_uncompiled += 1
        return {name: tensor.clone() for name, tensor in entry.outputs.items()}

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
        new = self._has_new_shape(_shapes(specs))
        cost = self._eager_estimate_ms(own[0], tokens, new)
        if self._compiles_exact(specs):
            exact = self._eager_estimate_ms(own[0], tokens, new, "exact_ms")
            if exact < cost:
                route, cost = "exact_ms", exact
        # The budget's smallest graph bounds every single-graph plan from below: no host metadata
        # is built for a plan that cannot beat eager.
        if _replay_cost(own[0]) < cost:
            single = self._place(specs, budget)
            if single is None:
                best = "capacity"
            elif _replay_cost(single[0]) < cost:
                best, cost = [(whole, *single)], _replay_cost(single[0])
        split = self._split_plan(specs, budget)
        # What splits at this budget really cost over their parts' startup timings (learned).
        split_scale = self._route_scale.get(("split", budget), 1.0)
        # Cheapest first: the parts' own token budgets bound the split's cost from below...
        if split and split_scale * sum(_replay_cost(self._entries(b, m)[0]) for _, b, m in split) < cost:
            placed = [self._place([specs[i] for i in indices], b) for indices, b, _ in split]
            # ...but a part with more segments than its budget's graphs hold moves up a budget:
            # price the graphs it really lands in.
            if all(placed) and split_scale * sum(_replay_cost(entry) for entry, _ in placed) < cost:
                best = [(indices, *where) for (indices, _, _), where in zip(split, placed)]
        if not isinstance(best, str):
            self._forget((route, budget), new)
            if split and len(best) == 1:
                self._forget(("split", budget), False)
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

    # ---- learned route costs ----

    def _timer(self):
        """A start mark: a CUDA event on the current stream (no wait), else the host clock."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _time_route(self, key: tuple[str, int], shapes: list, estimate_ms: float, start) -> None:
        """End a route's timing (`estimate_ms`: its startup estimate). CUDA: the GPU span between
        the two events, read once it is done (`_absorb_timing`, at the next pack; no wait here).
        The span includes the GPU's idle gaps while the host launches: the cost that makes a
        route host-bound."""
        if not math.isfinite(estimate_ms) or estimate_ms <= 0:
            self._mark_run(shapes)
            return
        if not isinstance(start, torch.cuda.Event):
            self._learn(key, shapes, (time.perf_counter() - start) * 1e3, estimate_ms)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        if self._timing is not None:  # still running at this pack's start: dropped, its shapes built
            self._mark_run(self._timing[1])
        self._timing = (key, shapes, estimate_ms, start, end)

    def _absorb_timing(self) -> None:
        if self._timing is not None and self._timing[-1].query():
            key, shapes, estimate_ms, start, end = self._timing
            self._timing = None
            self._learn(key, shapes, start.elapsed_time(end), estimate_ms)

    def _mark_run(self, shapes) -> None:
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

        cold = self._has_new_shape(shapes)
        self._mark_run(shapes)
        if not cold:
            self._route_scale[key] = average(self._route_scale.get(key), measured_ms / estimate_ms)
        elif key in self._route_scale:
            self._cold_ms = average(self._cold_ms, max(0.0, measured_ms - self._route_scale[key] * estimate_ms))

    def _has_new_shape(self, shapes: list) -> bool:
        """Whether one of these attention shapes was never run by a route without a graph."""
        return not all(shape in self._shapes_run for shape in shapes)

    def _forget(self, key: tuple[str, int], new: bool) -> None:
        """The route `key` lost this pack to a graph: forget a little of what it learned beyond its
        startup estimate (`FORGET_HALF_LIFE`), the cold cost too when the pack had a `new` shape."""
        factor = 0.5 ** (1 / FORGET_HALF_LIFE)
        scale = self._route_scale.get(key)
        if scale is not None and scale > 1.0:
            self._route_scale[key] = 1.0 + (scale - 1.0) * factor
        if self._cold_ms and new:
            self._cold_ms *= factor

    def _eager_estimate_ms(self, entry: GraphEntry, tokens: int, new: bool, measured: str = "eager_ms") -> float:
        """Time of a pack of `tokens` without a graph (`measured`: "eager_ms" uncompiled, "exact_ms"
        compiled): interpolated between full packs measured at startup, scaled by what that route
        measured on this budget's packs so far, plus the learned cold cost if no route without a
        graph has run the pack's attention shape yet."""
        scale = self._route_scale.get((measured, entry.key[0]), 1.0)
        cold = (self._cold_ms or 0.0) if new else 0.0
        return scale * self._startup_estimate_ms(entry, tokens, measured) + cold

    def _startup_estimate_ms(self, entry: GraphEntry, tokens: int, measured: str) -> float:
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
        """The used output rows and their finite flags, copied (once) out of the shared static
        outputs to `device`."""
        deepstack = entry.outputs.get("deepstack")
        out = EncoderOutput(
            tokens=entry.outputs["tokens"][:tokens].to(device, copy=True),
            deepstack=None if deepstack is None else deepstack[:, :tokens].to(device, copy=True),
        )
        return out, entry.outputs["finite"][:tokens].to(device, copy=True)

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
            "learned_cold_ms": None if self._cold_ms is None else round(self._cold_ms, 2),
            # a copy first: a pack on the worker thread may add a key meanwhile
            "learned_route_scale": {
                f"{field}@{budget}": round(v, 3) for (field, budget), v in list(self._route_scale.items())
            },
            "memory": self.memory.summary() if self.use_graphs else None,
            "stats": self.stats.snapshot(),
        }
