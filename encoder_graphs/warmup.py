"""Startup in two parts (`WarmUp`): `prepare`, synchronous and seconds long, after which every pack
runs eagerly on its exact layout; then `run`, meant for a background thread: startup costs, the
compile, each graph built, checked (`graph_checks.py`; or captured on an earlier warm-up's record of
its check, `warmup_record.py`) and switched live one at a time (the traffic's budgets first), the
compiled exact route, and full speed. It works on the runner's parts (`parts.py`), never on the runner.

Threading invariant: a graph is captured only while holding the parts' `device_lock`, which
every pack (and the replica's device-side preprocessing) also holds, and until the warm-up ends
no other thread captures or calls a compiled forward (`RecurringGraphs.enabled`, live flags), so
no other thread's stream work, allocation, sync or dynamo stance can meet a capture or a compile.
The warm-up runs compiles and reference forwards outside the lock, on tensors of its own.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .budgets import sample_budgets
from .buffers import StaticBuffers
from .compile_cache import regions_name
from .entry import DISABLED, LIVE, PENDING, GraphEntry, GraphKey
from .graph_checks import UPCOMING_GRAPHS, CheckPipeline
from .parts import RunnerParts
from .preflight import check_eager, check_memory, raise_recompile_limits
from .route_costs import attention_shapes
from .selfcheck import best_ms, pack_error, synthetic_pixels
from .table import input_specs
from .warm_capture import CaptureResult, capture_graph
from .warmup_record import fingerprint

logger = logging.getLogger(__name__)

COST_SAMPLES = 5
"""Budgets at which the routes without a graph are timed at startup (interpolated between)."""
PROGRESS_LINES = 10
"""Log lines the graph stage writes (one per graph refused besides)."""

Progress = Callable[[str], None]


@dataclass(frozen=True)
class WarmupStatus:
    """Where a runner's warm-up stands (for `/v1/models`, metrics and logs)."""

    stage: str
    """"created", "prepared", "costs", "compile", "graphs", "exact", "done", "stopped" or "failed"."""
    graphs_live: int
    graphs_total: int
    compiled: bool | None
    """Whether the padded forward is compiled yet (None: `compile` off)."""
    exact_route: bool | None
    """Whether the compiled exact-layout route serves (None: not configured)."""
    stage_seconds: dict[str, float]
    full_speed: bool
    """Every graph built or refused, every configured route live: nothing left to warm."""
    from_record: bool = False
    """Whether the graphs were captured on an earlier warm-up's record, without startup checks and
    timings (each is still checked on its first real pack)."""

    def as_dict(self) -> dict:
        return asdict(self)


class WarmUp:
    """Drives a runner's startup through the parts it shares with the serving path."""

    def __init__(self, parts: RunnerParts):
        self.parts = parts
        self.stage = "created"
        self.stage_seconds: dict[str, float] = {}
        compiled = parts.forwards.compiled is not None
        self.compiled: bool | None = False if compiled else None
        self.exact_ok: bool | None = False if compiled and parts.config.compile_exact else None
        self.checks = CheckPipeline(parts)
        self._built: list[GraphEntry] = []
        """Graphs built and checked that go live only at the end (compiled forwards without graphs)."""
        self._private_inputs: StaticBuffers | None = None
        """Inputs the compiles run on, shaped as the table's shared ones (freed at the end)."""
        self._upcoming: list[GraphKey] = []
        self._fingerprint_found: str | None = None

    @property
    def full_speed(self) -> bool:
        """Every graph built or refused, every configured route live."""
        return self.parts.demand.full_speed

    # ---- status ----

    def status(self) -> WarmupStatus:
        parts, table = self.parts, self.parts.table
        return WarmupStatus(
            self.stage,
            table.live_count(),
            len(table.entries),
            self.compiled,
            None if self.exact_ok is None else parts.exact.live,
            dict(self.stage_seconds),
            self.full_speed,
            parts.record.record is not None,
        )

    # ---- prepare ----

    def prepare(self, progress: Progress) -> None:
        """Memory check (CUDA graphs), the eager path checked on a reference pack: seconds."""
        start = time.perf_counter()
        parts = self.parts
        if parts.forwards.compiled is not None:
            raise_recompile_limits(len(parts.table.entries))
        if parts.use_graphs:
            parts.memory.predicted_pool_bytes = check_memory(
                parts.encoder, parts.table.budgets, parts.table.static_bytes, parts.config.memory_fraction
            )
        check_eager(parts.encoder, parts.config.self_check_tolerance)
        self.stage = "prepared"
        self.stage_seconds["prepare"] = round(time.perf_counter() - start, 3)
        progress(
            f"prepared in {self.stage_seconds['prepare']:.1f} s: every pack runs eagerly until its graph is live "
            f"({len(parts.table.entries)} graphs to warm up{self._no_cuda_graphs()})"
        )

    def _no_cuda_graphs(self) -> str:
        """What a "graph" is without CUDA graphs, for the log: a padded budget run eagerly."""
        return "" if self.parts.use_graphs else "; no CUDA graphs here: a graph is a padded budget run eagerly"

    # ---- the background warm-up ----

    def run(self, progress: Progress, stop: threading.Event) -> WarmupStatus:
        """Every stage in turn until full speed, or until `stop` is set (between steps)."""
        parts = self.parts
        start = time.perf_counter()
        if parts.record.load(parts.table.entries) is not None:
            progress(
                f"warm-up record {parts.compile_cache.path}: graphs are captured on its checks and timings, "
                "each still checked on its first real pack"
            )
        stages = (
            ("costs", parts.use_graphs, self._measure_costs),
            ("compile", parts.forwards.compiled is not None, self._compile),
            ("graphs", True, self._build_graphs),
            ("exact", parts.forwards.compiled is not None and parts.config.compile_exact, self._compile_exact),
        )
        try:
            for stage, wanted, step in stages:
                if not wanted:
                    continue
                self.stage = stage
                began = time.perf_counter()
                step(progress, stop)
                if stop.is_set():
                    self.stage = "stopped"
                    progress(f"warm-up stopped during {stage}")
                    return self.status()
                self.stage_seconds[stage] = round(time.perf_counter() - began, 3)
                progress(f"warm-up: {stage} done in {self.stage_seconds[stage]:.1f} s")
            self._finish()
        except Exception:
            self.stage = "failed"
            raise
        finally:
            if parts.precompiled is not None:
                parts.precompiled.compiling = False
            self._private_inputs = None  # only the warm-up compiles: stopped, failed or done
            self.checks.release()
        status = self.status()
        progress(
            f"full speed {time.perf_counter() - start:.1f} s into the warm-up: {status.graphs_live}/"
            f"{status.graphs_total} graphs live, compiled {status.compiled}, exact route {status.exact_route}"
            f"{self._no_cuda_graphs()}"
        )
        return status

    def _measure_costs(self, progress: Progress, stop: threading.Event) -> None:
        """The uncompiled eager route timed on full packs of a few budgets: what plans compare
        graphs with (its reference run, outside the lock, warms it). From the record where used."""
        parts, encoder, record = self.parts, self.parts.encoder, self.parts.record.record
        if record is not None and "eager_ms" in record.costs:
            parts.costs.set_startup("eager_ms", record.costs["eager_ms"])
            return
        points = []
        for budget in sample_budgets(parts.table.budgets, COST_SAMPLES):
            if stop.is_set():
                return
            specs = self.checks.sample_specs(parts.table.by_budget[budget][0].key)
            pixels = synthetic_pixels(specs, encoder.patch_dim, encoder.device, seed=budget).to(encoder.dtype)
            encoder.forward_eager(pixels, specs)
            with parts.device_lock:
                ms = best_ms(lambda: encoder.forward_eager(pixels, specs), encoder.device)
            points.append((sum(s.output_tokens for s in specs), ms))
        parts.costs.set_startup("eager_ms", points)

    def _compile(self, progress: Progress, stop: threading.Event) -> None:
        """Load the compile cache (and the precompiled regions), then compile the padded forward on
        the largest graph's layout. Precompiled regions compile a variant on a miss from here on,
        until the warm-up ends."""
        parts = self.parts
        if parts.compile_cache is not None:
            loaded = parts.compile_cache.load()
            progress(f"compile cache {parts.compile_cache.path}: {loaded} artifacts loaded")
        if parts.precompiled is not None:
            self._load_regions(progress)
            parts.precompiled.compiling = True
        largest = parts.table.entries[max(parts.table.entries)]
        began = time.perf_counter()
        self._warm_compiled(largest)
        self.compiled = True
        progress(f"compiled the padded forward in {time.perf_counter() - began:.1f} s")

    def _regions_fingerprint(self) -> str | None:
        """The fingerprint naming our code version's precompiled regions, taken once, when they load
        (None: no sources to hash, or no cache: neither loaded nor saved)."""
        if self.parts.compile_cache is None:
            return None
        if self._fingerprint_found is None:
            self._fingerprint_found = fingerprint({"regions": "aot"}) or ""
        return self._fingerprint_found or None

    def _load_regions(self, progress: Progress) -> None:
        """The precompiled regions' variants from the cache, verified; one that does not load (or
        traced a source that changed since) drops them all: the regions compile as without them."""
        parts, found = self.parts, self._regions_fingerprint()
        blobs = None if found is None else parts.compile_cache.load_regions(found)
        if not blobs:
            return
        began = time.perf_counter()
        try:
            loaded = parts.precompiled.load(blobs)
        except Exception as error:  # noqa: BLE001 - ours, yet unusable here: compile instead
            logger.warning("precompiled regions %s not loaded (%s); compiling them anew", regions_name(found), error)
            return
        progress(
            f"precompiled regions: {loaded} variants loaded from {regions_name(found)} "
            f"in {time.perf_counter() - began:.1f} s"
        )

    def _warm_compiled(self, entry: GraphEntry) -> None:
        """The compiled forward once on private inputs shaped as `entry`'s, outside the lock:
        whatever it compiles, no pack waits for. Dynamo guards on a view's base (its size against
        the view's), so the private inputs are views of bases sized as the shared buffers' are."""
        encoder = self.parts.encoder
        if self._private_inputs is None:
            layouts = [input_specs(encoder, e.layout) for e in self.parts.table.entries.values()]
            self._private_inputs = StaticBuffers(layouts, encoder.device)
        specs = input_specs(encoder, entry.layout)
        private = self._private_inputs.views(specs)
        for name, host in encoder.pack_metadata([], entry.layout).items():
            private[name].copy_(host)
        with self._capturing():
            self.parts.io.compute(entry, private)

    def _capturing(self):
        return self.parts.encoder.capturing() if self.parts.use_graphs else contextlib.nullcontext()

    def _build_graphs(self, progress: Progress, stop: threading.Event) -> None:
        """Every graph in turn; the log gets a line per tenth of them and one per graph refused."""
        parts, checks = self.parts, self.checks
        table = parts.table
        total = len(table.entries)
        every = max(1, total // PROGRESS_LINES)
        done = 0
        if parts.checks:
            with parts.device_lock:
                pending = [e.key for e in table.entries.values() if e.state == PENDING and self._recorded_ms(e) is None]
            checks.expect(pending)
        while True:
            if stop.is_set():
                checks.unchecked = None  # never launched: it stays pending, never live
                return
            entry = self._next_entry()
            if entry is None and checks.unchecked is not None:
                with parts.device_lock:
                    checks.settle(checks.launch())
                continue
            if entry is None:
                refs = checks.release()
                if refs is not None:
                    progress(
                        f"graph checks: eager references in {refs.eager_forwards} forwards of {refs.eager_rows} rows "
                        f"in all, at most {refs.peak_bytes / 2**20:.0f} MiB held"
                    )
                return
            began = time.perf_counter()
            self._build(entry)
            done += 1
            grown = parts.memory.graph_bytes.get(entry.key, 0) / 2**20
            state = "captured" if checks.unchecked and checks.unchecked.entry is entry else entry.state
            message = (
                f"graph {done}/{total} {state if state != PENDING else 'checked'}: budget {entry.key[0]} "
                f"tokens, max_seqlen {entry.key[1]} (+{grown:.1f} MiB, {(time.perf_counter() - began) * 1e3:.0f} ms)"
            )
            if done % every == 0 or done == total or entry.state == DISABLED:
                progress(message)
            else:
                logger.debug(message)

    def _next_entry(self) -> GraphEntry | None:
        """The largest graph first where graphs share a pool (it sizes the pool); then those the
        traffic served so far needed, most needed first; then the cheapest (smallest) first.
        Also notes the graphs likely built after it (`_upcoming`: their references may be
        computed with its own)."""
        parts = self.parts
        with parts.device_lock:
            unchecked = self.checks.unchecked.entry if self.checks.unchecked else None
            pending = [
                e
                for e in parts.table.entries.values()
                if e.state == PENDING and e not in self._built and e is not unchecked
            ]
            self._upcoming = sorted(e.key for e in pending)[: UPCOMING_GRAPHS + 1]
            if not pending:
                return None
            if parts.capture is not None and not parts.capture.started:
                return max(pending, key=lambda e: e.key)
            demand = parts.demand.counts
            demanded = [e for e in pending if demand[e.key]]
            if demanded:
                return max(demanded, key=lambda e: (demand[e.key], -e.key[0], -e.key[1]))
            return min(pending, key=lambda e: e.key)

    def _build(self, entry: GraphEntry) -> None:
        """One step: the eager reference (no lock), then under the lock the capture and one checked
        run, also the timed one; live if it passed. A captured graph's checked run overlaps the
        next capture (`graph_checks.py`). The compiled forward runs on the entry's layout outside
        the lock first only where it must: without graphs (the check calls it under the lock), or
        where the capture found it would compile (then captured again). On the record a graph is
        captured and goes live unchecked, its time the record's: its first real pack is its check."""
        parts, checks = self.parts, self.checks
        compiled = parts.forwards.compiled is not None
        if compiled and parts.capture is None:
            self._warm_compiled(entry)
        check = None
        recorded = self._recorded_ms(entry)
        if recorded is not None:  # checked and timed by an earlier warm-up: captured only
            entry.replay_ms = recorded
        elif parts.checks:
            upcoming = [key for key in self._upcoming if self._recorded_ms(parts.table.entries[key]) is None]
            check = checks.make(entry, upcoming)
        for may_compile in (compiled and parts.capture is not None, False):
            with parts.device_lock:
                earlier = checks.launch_unchecked()
                try:
                    result = CaptureResult.CAPTURED
                    if parts.capture is not None:
                        settle = None if earlier is None else (lambda: checks.settle(earlier))
                        result = capture_graph(parts, entry, may_compile, settle)
                    if result is CaptureResult.FAILED:
                        return
                    if result is CaptureResult.CAPTURED:
                        self._captured(entry, check, compiled)
                        return
                    parts.stats.layout_compiles += 1  # NEEDS_COMPILE: compiled outside the lock, then again
                finally:
                    if earlier is not None:
                        checks.settle(earlier)
            self._warm_compiled(entry)

    def _captured(self, entry: GraphEntry, check, compiled: bool) -> None:
        """After the capture (or without graphs), under the lock: a graph is checked while the next
        is captured; without one the check runs now; then live, or at the end where it calls the
        compiled forward without a graph."""
        parts, checks = self.parts, self.checks
        if check is not None and entry.graph is not None:
            checks.unchecked = check  # checked while the next graph is captured
            return
        if check is not None and not checks.settle(checks.launch(check)):
            return
        if parts.capture is None and compiled:
            self._built.append(entry)  # the serving thread calls no compiled forward yet
        else:
            entry.state = LIVE

    def _recorded_ms(self, entry: GraphEntry) -> float | None:
        """The entry's replay ms from the record (None: no record, or it refused the graph then)."""
        return self.parts.record.recorded_ms(entry.key)

    def _compile_exact(self, progress: Progress, stop: threading.Event) -> None:
        """Compile the exact route, check it against eager at a few budgets and time it there (on
        the record: checked at the first of them it runs, its times and smallest pack the record's).
        An error or a mismatch leaves it off: an optimisation, the runner serves without it."""
        parts, encoder, record = self.parts, self.parts.encoder, self.parts.record.record
        self.exact_ok = False
        try:
            parts.exact.compile(parts.table.budgets[-1] * encoder.merge_unit, progress)
        except Exception:
            logger.exception("compiling the exact-layout route failed; packs without a graph run uncompiled")
            return
        recorded = record is not None and record.exact_min_rows is not None
        budgets = sample_budgets(parts.table.budgets, COST_SAMPLES)
        points = []
        for budget in budgets:
            if stop.is_set():
                return
            specs = self.checks.sample_specs(parts.table.by_budget[budget][0].key)
            equal = [s for s in specs if s == specs[0]]
            pixels = synthetic_pixels(equal, encoder.patch_dim, encoder.device, seed=budget).to(encoder.dtype)
            out = parts.exact.run_compiled(pixels, equal)
            if out is None:  # would need a compile at this size: left unmeasured
                continue
            error = pack_error(out.tokens, out.deepstack, encoder.forward_eager(pixels, equal))
            if not math.isfinite(error) or error > parts.config.self_check_tolerance:
                logger.warning("compiled exact-layout route turned off: error %.3g at budget %d", error, budget)
                return
            parts.costs.mark_run(attention_shapes(equal))
            parts.exact.min_rows = min(parts.exact.min_rows, sum(s.input_patches for s in equal))
            if recorded:  # one check passed: its times are the record's
                break
            if parts.use_graphs:
                with parts.device_lock:
                    ms = best_ms(lambda: parts.exact.run_compiled(pixels, equal), encoder.device)
                points.append((sum(s.output_tokens for s in equal), ms))
        if recorded:
            parts.exact.min_rows = record.exact_min_rows
            points = list(record.costs.get("exact_ms", ()))
        parts.costs.set_startup("exact_ms", points)
        self.exact_ok = True

    def _finish(self) -> None:
        """Switch on what the serving thread may only use once no warm-up step can run: compiled
        forwards without graphs, the exact route, recurring graphs; then save the compile cache."""
        parts = self.parts
        with parts.device_lock:
            if parts.precompiled is not None:
                parts.precompiled.compiling = False  # serving: a miss runs uncompiled
            for entry in self._built:
                if entry.enabled:
                    entry.state = LIVE
            parts.exact.live = bool(self.exact_ok)
            parts.recurring.enabled = True
            if parts.use_graphs:
                parts.memory.peak_allocated_bytes = torch.cuda.max_memory_allocated(parts.device)
            parts.demand.full_speed = True
            self.stage = "done"
        if parts.compile_cache is not None and parts.forwards.compiled is not None:
            parts.compile_cache.save()
        found = self._regions_fingerprint()
        if parts.precompiled is not None and parts.precompiled.new and found is not None:
            try:
                parts.compile_cache.save_regions(found, parts.precompiled.serialized())
            except Exception:  # noqa: BLE001 - an optimisation for later starts: this one serves on
                logger.exception("the precompiled regions could not be saved; later starts compile them again")
        exact_rows = parts.exact.min_rows if self.exact_ok else None
        parts.record.save(parts.table.entries, parts.costs.startup, exact_rows)
