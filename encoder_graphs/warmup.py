"""Startup in two parts (`WarmUp`): `prepare`, synchronous and seconds long, after which every pack
runs eagerly on its exact layout; then `run`, meant for a background thread: startup costs, the
compile, each graph built, checked (or captured on an earlier warm-up's record of its check,
`warmup_record.py`) and switched live one at a time (the traffic's budgets first), the compiled
exact route, and full speed.

Threading invariant: a graph is captured only while holding the runner's `device_lock`, which
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
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from .budgets import sample_budgets
from .buffers import StaticBuffers
from .entry import DISABLED, LIVE, PENDING, GraphEntry, GraphKey
from .preflight import check_eager, check_memory, raise_recompile_limits
from .references import References, SamplePack
from .route_costs import attention_shapes
from .selfcheck import DeviceTimer, best_ms, pack_error, sample_frame, synthetic_pixels, synthetic_specs
from .table import input_specs
from .warmup_record import WarmupRecord, fingerprint, forget, graph_times
from .warmup_record import load as load_record
from .warmup_record import save as save_record

if TYPE_CHECKING:
    from .runner import EncoderRunner

logger = logging.getLogger(__name__)

COST_SAMPLES = 5
"""Budgets at which the routes without a graph are timed at startup (interpolated between)."""
PROGRESS_LINES = 10
"""Log lines the graph stage writes (one per graph refused besides)."""
RETIME_MS = 20.0
"""A graph whose checked (first) run took less is timed on the best of two more: the first includes
the graph's upload, which counts in a short replay."""
UPCOMING_GRAPHS = 16
"""Graphs, in the order they are likely built, whose references one eager forward may also take."""

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
    """Drives a runner's startup through its public parts (table, I/O, capture, routes, costs)."""

    def __init__(self, runner: EncoderRunner):
        self.runner = runner
        self.stage = "created"
        self.stage_seconds: dict[str, float] = {}
        compiled = runner.forwards.compiled is not None
        self.compiled: bool | None = False if compiled else None
        self.exact_ok: bool | None = False if compiled and runner.config.compile_exact else None
        self.full_speed = False
        self._demand: Counter[GraphKey] = Counter()
        """Packs served so far per graph they needed (read and written under the device lock)."""
        self._built: list[GraphEntry] = []
        """Graphs built and checked that go live only at the end (compiled forwards without graphs)."""
        self._private_inputs: StaticBuffers | None = None
        """Inputs the compiles run on, shaped as the table's shared ones (freed at the end)."""
        self._references: References | None = None
        """Sample items' eager outputs for the graph checks (freed at the end)."""
        self._upcoming: list[GraphKey] = []
        self._unchecked: _Check | None = None
        """The graph captured last, not yet checked: its checked run overlaps the next capture."""
        self._record: WarmupRecord | None = None
        """An earlier warm-up's checks and timings for this table (`warmup_record.py`), if used."""

    # ---- status ----

    def status(self) -> WarmupStatus:
        table = self.runner.table
        return WarmupStatus(
            self.stage,
            table.live_count(),
            len(table.entries),
            self.compiled,
            None if self.exact_ok is None else self.runner.exact.live,
            dict(self.stage_seconds),
            self.full_speed,
            self._record is not None,
        )

    def note_demand(self, budget: int, longest: int) -> None:
        """A pack that fits `budget` was served before its graph was live: build that one sooner."""
        needed = self.runner.table.needed(budget, longest)
        if needed is not None and not needed.live:
            self._demand[needed.key] += 1

    # ---- prepare ----

    def prepare(self, progress: Progress) -> None:
        """Memory check (CUDA graphs), the eager path checked on a reference pack: seconds."""
        start = time.perf_counter()
        runner = self.runner
        if runner.forwards.compiled is not None:
            raise_recompile_limits(len(runner.table.entries))
        if runner.use_graphs:
            runner.memory.predicted_pool_bytes = check_memory(
                runner.encoder, runner.table.budgets, runner.table.static_bytes, runner.config.memory_fraction
            )
        check_eager(runner.encoder, runner.config.self_check_tolerance)
        self.stage = "prepared"
        self.stage_seconds["prepare"] = round(time.perf_counter() - start, 3)
        progress(
            f"prepared in {self.stage_seconds['prepare']:.1f} s: every pack runs eagerly until its graph is live "
            f"({len(runner.table.entries)} graphs to warm up{self._no_cuda_graphs()})"
        )

    def _no_cuda_graphs(self) -> str:
        """What a "graph" is without CUDA graphs, for the log: a padded budget run eagerly."""
        return "" if self.runner.use_graphs else "; no CUDA graphs here: a graph is a padded budget run eagerly"

    # ---- the background warm-up ----

    def run(self, progress: Progress, stop: threading.Event) -> WarmupStatus:
        """Every stage in turn until full speed, or until `stop` is set (between steps)."""
        runner = self.runner
        start = time.perf_counter()
        self._record = self._load_record()
        if self._record is not None:
            progress(
                f"warm-up record {runner.compile_cache.path}: graphs are captured on its checks and timings, "
                "each still checked on its first real pack"
            )
        stages = (
            ("costs", runner.use_graphs, self._measure_costs),
            ("compile", runner.forwards.compiled is not None, self._compile),
            ("graphs", True, self._build_graphs),
            ("exact", runner.forwards.compiled is not None and runner.config.compile_exact, self._compile_exact),
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
            self._private_inputs = None  # only the warm-up compiles: stopped, failed or done
            self._references = None
        status = self.status()
        progress(
            f"full speed {time.perf_counter() - start:.1f} s into the warm-up: {status.graphs_live}/"
            f"{status.graphs_total} graphs live, compiled {status.compiled}, exact route {status.exact_route}"
            f"{self._no_cuda_graphs()}"
        )
        return status

    def _fingerprint(self) -> str | None:
        """What a record must have been made with, besides the compile cache key (model, layouts,
        environment): our code, the check tolerance, the forward compiled or not."""
        runner = self.runner
        return fingerprint(
            {"tolerance": runner.config.self_check_tolerance, "compiled": runner.forwards.compiled is not None}
        )

    def _load_record(self) -> WarmupRecord | None:
        runner = self.runner
        if not (runner.config.reuse_checks and runner.compile_cache is not None and self._checks):
            return None
        found = self._fingerprint()
        return None if found is None else load_record(runner.compile_cache, runner.table.entries, found)

    def _save_record(self) -> None:
        """Record this warm-up's checks and timings for later starts (only where it made them all)."""
        runner = self.runner
        if self._record is not None or runner.compile_cache is None or not self._checks:
            return
        found = self._fingerprint() if runner.config.reuse_checks else None
        if found is None:
            return
        exact_rows = runner.exact.min_rows if self.exact_ok else None
        record = WarmupRecord(graph_times(runner.table.entries), dict(runner.costs.startup), exact_rows, found)
        saved = save_record(runner.compile_cache, record)
        if saved is not None:
            logger.info("saved the warm-up record %s", saved)

    def record_failed(self, entry: GraphEntry) -> None:
        """A graph captured on the record failed its first-pack check: the record goes, and the
        next start checks every graph again."""
        record = self._record
        if record is not None and record.graphs.get(entry.key) is not None:
            logger.warning("graph %s, captured on the warm-up record, failed its first pack: record removed", entry.key)
            forget(self.runner.compile_cache, record.fingerprint)

    def _recorded_ms(self, entry: GraphEntry) -> float | None:
        """The entry's replay ms from the record (None: no record, or it refused the graph then)."""
        return None if self._record is None else self._record.graphs.get(entry.key)

    def _measure_costs(self, progress: Progress, stop: threading.Event) -> None:
        """The uncompiled eager route timed on full packs of a few budgets: what plans compare
        graphs with (its reference run, outside the lock, warms it). From the record where used."""
        runner, encoder = self.runner, self.runner.encoder
        if self._record is not None and "eager_ms" in self._record.costs:
            runner.costs.set_startup("eager_ms", self._record.costs["eager_ms"])
            return
        points = []
        for budget in sample_budgets(runner.table.budgets, COST_SAMPLES):
            if stop.is_set():
                return
            specs = self._sample_specs(runner.table.by_budget[budget][0].key)
            pixels = synthetic_pixels(specs, encoder.patch_dim, encoder.device, seed=budget).to(encoder.dtype)
            encoder.forward_eager(pixels, specs)
            with runner.device_lock:
                ms = best_ms(lambda: encoder.forward_eager(pixels, specs), encoder.device)
            points.append((sum(s.output_tokens for s in specs), ms))
        runner.costs.set_startup("eager_ms", points)

    def _compile(self, progress: Progress, stop: threading.Event) -> None:
        """Load the compile cache, then compile the padded forward on the largest graph's layout."""
        runner = self.runner
        if runner.compile_cache is not None:
            loaded = runner.compile_cache.load()
            progress(f"compile cache {runner.compile_cache.path}: {loaded} artifacts loaded")
        largest = runner.table.entries[max(runner.table.entries)]
        began = time.perf_counter()
        self._warm_compiled(largest)
        self.compiled = True
        progress(f"compiled the padded forward in {time.perf_counter() - began:.1f} s")

    def _warm_compiled(self, entry: GraphEntry) -> None:
        """The compiled forward once on private inputs shaped as `entry`'s, outside the lock:
        whatever it compiles, no pack waits for. Dynamo guards on a view's base (its size against
        the view's), so the private inputs are views of bases sized as the shared buffers' are."""
        encoder = self.runner.encoder
        if self._private_inputs is None:
            layouts = [input_specs(encoder, e.layout) for e in self.runner.table.entries.values()]
            self._private_inputs = StaticBuffers(layouts, encoder.device)
        specs = input_specs(encoder, entry.layout)
        private = self._private_inputs.views(specs)
        for name, host in encoder.pack_metadata([], entry.layout).items():
            private[name].copy_(host)
        with self._capturing():
            self.runner.io.compute(entry, private)

    def _capturing(self):
        return self.runner.encoder.capturing() if self.runner.use_graphs else contextlib.nullcontext()

    def _build_graphs(self, progress: Progress, stop: threading.Event) -> None:
        """Every graph in turn; the log gets a line per tenth of them and one per graph refused."""
        table = self.runner.table
        total = len(table.entries)
        every = max(1, total // PROGRESS_LINES)
        done = 0
        if self._checks:
            with self.runner.device_lock:
                pending = [e.key for e in table.entries.values() if e.state == PENDING and self._recorded_ms(e) is None]
            self.references.expect(self._sample_specs(key) for key in pending)
        while True:
            if stop.is_set():
                self._unchecked = None  # never launched: it stays pending, never live
                return
            entry = self._next_entry()
            if entry is None and self._unchecked is not None:
                with self.runner.device_lock:
                    self._settle(self._launch())
                continue
            if entry is None:
                if self._references is not None:
                    refs = self._references
                    progress(
                        f"graph checks: eager references in {refs.eager_forwards} forwards of {refs.eager_rows} rows "
                        f"in all, at most {refs.peak_bytes / 2**20:.0f} MiB held"
                    )
                self._references = None
                return
            began = time.perf_counter()
            self._build(entry)
            done += 1
            grown = self.runner.memory.graph_bytes.get(entry.key, 0) / 2**20
            state = "captured" if self._unchecked and self._unchecked.entry is entry else entry.state
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
        runner = self.runner
        with runner.device_lock:
            unchecked = self._unchecked.entry if self._unchecked else None
            pending = [
                e
                for e in runner.table.entries.values()
                if e.state == PENDING and e not in self._built and e is not unchecked
            ]
            self._upcoming = sorted(e.key for e in pending)[: UPCOMING_GRAPHS + 1]
            if not pending:
                return None
            if runner.capture is not None and not runner.capture.started:
                return max(pending, key=lambda e: e.key)
            demanded = [e for e in pending if self._demand[e.key]]
            if demanded:
                return max(demanded, key=lambda e: (self._demand[e.key], -e.key[0], -e.key[1]))
            return min(pending, key=lambda e: e.key)

    def _build(self, entry: GraphEntry) -> None:
        """One step: the eager reference (no lock), then under the lock the capture and one checked
        run, also the timed one; live if it passed. A captured graph's checked run is launched
        under the next step's lock, before that step's capture, and read after it: the GPU
        replays one graph while the host captures the next. The compiled forward runs on the
        entry's layout outside the lock first only where it must: without graphs (the check
        calls it under the lock), or where the capture found it would compile (then captured again).
        On the record a graph is captured and goes live unchecked, its time the record's: its first
        real pack is its check."""
        runner = self.runner
        compiled = runner.forwards.compiled is not None
        if compiled and runner.capture is None:
            self._warm_compiled(entry)
        check = None
        recorded = self._recorded_ms(entry)
        if recorded is not None:  # checked and timed by an earlier warm-up: captured only
            entry.replay_ms = recorded
        elif self._checks:
            sample = self._sample_pack(entry.key)
            upcoming = [
                self._sample_specs(key)
                for key in self._upcoming
                if key != entry.key and self._recorded_ms(self.runner.table.entries[key]) is None
            ]
            self.references.prepare([sample.specs, *upcoming[:UPCOMING_GRAPHS]])
            reference = self.references.reference(sample)
            metadata = runner.encoder.pack_metadata(sample.specs, entry.layout)
            check = _Check(entry, sample.pixels, sample.specs, metadata, reference)
        for may_warm in (compiled and runner.capture is not None, False):
            with runner.device_lock:
                earlier = self._launch() if self._unchecked is not None else None
                try:
                    if runner.capture is not None and not self._capture(entry, may_warm, earlier):
                        return
                except _Warm:
                    runner.stats.layout_compiles += 1
                else:
                    if check is not None and entry.graph is not None:
                        self._unchecked = check  # checked while the next graph is captured
                        return
                    if check is not None and not self._settle(self._launch(check)):
                        return
                    if runner.capture is None and compiled:
                        self._built.append(entry)  # the serving thread calls no compiled forward yet
                    else:
                        entry.state = LIVE
                    return
                finally:
                    if earlier is not None:
                        self._settle(earlier)
            self._warm_compiled(entry)

    @property
    def _checks(self) -> bool:
        """Whether graphs are checked against eager (a padded budget run without graphs is only
        where it is compiled; uncompiled, it is the eager path itself)."""
        runner = self.runner
        return runner.config.self_check and (runner.use_graphs or runner.forwards.compiled is not None)

    def _capture(self, entry: GraphEntry, may_warm: bool = False, earlier: _Launched | None = None) -> bool:
        """Capture (picking kernels as for a graph); where the compiled forward would compile,
        `_Warm` (`may_warm`: the caller compiles outside the lock and comes back), else again with
        the uncompiled forward. False: disabled.

        PyTorch asks for a warm run on a side stream before a capture, so that lazy
        initialisation never happens inside one; here only the first capture into the pool and
        a capture tried again take one (after the first, one per graph cost as much as the
        capture itself). A capture that fails without one is tried once more after one; the
        check after every capture (on the record: its first real pack's) catches a graph that
        went wrong. A warm run writes the shared
        outputs, so the `earlier` graph's checked run is read first."""
        runner = self.runner
        io, capture = runner.io, runner.capture
        io.fill_empty(entry)
        warm = not capture.started
        for _ in range(3):  # at most one retry each: with the uncompiled forward, after a warm run
            if warm and earlier is not None:  # its check (and retiming) fills the shared buffers
                self._settle(earlier)
                io.fill_empty(entry)
            try:
                with runner.encoder.capturing(), self._no_recompile(entry, may_warm):
                    if warm:
                        capture.warm(lambda: io.forward_into(entry))
                    runner.memory.graph_bytes[entry.key] = capture.capture(entry, lambda: io.forward_into(entry))
                return True
            except _Warm:
                raise
            except _Retry:
                warm = True
                continue
            except Exception as exc:  # one graph lost; the packs it would serve run elsewhere
                if not warm:
                    logger.warning("capturing graph %s failed without a warm run (%r): again after one", entry.key, exc)
                    warm = True
                    continue
                logger.exception("capturing graph %s failed", entry.key)
                runner.table.disable(entry, f"capture failed: {type(exc).__name__}")
                return False
        runner.table.disable(entry, "capture failed")
        return False

    @contextlib.contextmanager
    def _no_recompile(self, entry: GraphEntry, may_warm: bool = False):
        """Under the lock the compiled forward must not compile: where it would, `_Warm` if
        `may_warm`, else the entry keeps the uncompiled forward (counted)."""
        compiled = self.runner.forwards.compiled
        if compiled is None or entry.forward is not None:
            yield
            return
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                yield
        except RuntimeError as error:
            if "fail_on_recompile" not in str(error):
                raise
            if may_warm:
                raise _Warm from error
            self.runner.stats.recompile_fallbacks += 1
            logger.warning("graph %s would recompile under the device lock; it keeps the uncompiled forward", entry.key)
            entry.forward = self.runner.forwards.plain
            raise _Retry from error

    def _launch(self, check: _Check | None = None) -> _Launched:
        """The checked run of `check`'s graph (default: the one captured last), launched on the
        sample pack and not waited for. With graphs that run is also the one timed (copies in and
        out included: a split pays them per part), on CUDA events, so a capture meanwhile does not
        count; a graph costs one replay here, not two."""
        if check is None:
            check, self._unchecked = self._unchecked, None
        runner, entry = self.runner, check.entry
        for name, rows in entry.outputs.items():  # a graph that leaves them unwritten fails the check
            if rows.is_floating_point():
                (rows[: check.tokens] if name != "deepstack" else rows[:, : check.tokens]).fill_(math.nan)
        if entry.graph is None:  # the forward itself (no graph: CPU, or `cuda_graphs: false`)
            runner.io.fill(entry, check.pixels, check.metadata)
            runner.io.forward_into(entry)
            return _Launched(check)
        timer = DeviceTimer(runner.device)
        runner.io.launch(entry, check.metadata, check.pixels, check.specs, runner.device)
        return _Launched(check, timer.stop())

    def _settle(self, launched: _Launched) -> bool:
        """Read a launched check (once): the graph against the eager reference, disabled on a
        mismatch; its time, where the run was short (`RETIME_MS`: a graph's first launch includes
        its upload), the best of two more. Whether it passed."""
        if launched.passed is not None:
            return launched.passed
        runner, check = self.runner, launched.check
        entry, tokens = check.entry, check.tokens
        replay_ms = launched.timer.ms() if launched.timer is not None else math.nan
        deepstack = entry.outputs.get("deepstack")
        error = pack_error(
            entry.outputs["tokens"][:tokens], None if deepstack is None else deepstack[:, :tokens], check.reference
        )
        entry.self_check_error = error
        if not math.isfinite(error) or error > runner.config.self_check_tolerance:
            runner.table.disable(entry, f"self-check error {error:.3g} > {runner.config.self_check_tolerance}")
            launched.passed = False
            return False
        if replay_ms < RETIME_MS:
            launch = lambda: runner.io.launch(entry, check.metadata, check.pixels, check.specs, runner.device)  # noqa: E731
            replay_ms = best_ms(launch, runner.device)
        entry.replay_ms = replay_ms
        if entry.graph is not None and entry.state == PENDING:  # a graph goes live once checked
            entry.state = LIVE
        launched.passed = True
        return True

    @property
    def references(self) -> References:
        """The graph checks' eager references (made on first use)."""
        if self._references is None:
            rows = self.runner.table.budgets[-1] * self.runner.encoder.merge_unit
            self._references = References(self.runner.encoder, batch_rows=rows)
        return self._references

    def _sample_specs(self, key: GraphKey) -> list:
        """The items of the sample pack that checks and times graph `key`."""
        budget, seqlen = key
        frame = sample_frame([e.key[1] for e in self.runner.table.by_budget.get(budget, [])], seqlen)
        return synthetic_specs(self.runner.encoder, budget, seqlen, self.runner.ladder.max_items, frame)

    def _sample_pack(self, key: GraphKey) -> SamplePack:
        return self.references.pack(self._sample_specs(key))

    def _compile_exact(self, progress: Progress, stop: threading.Event) -> None:
        """Compile the exact route, check it against eager at a few budgets and time it there (on
        the record: checked at the first of them it runs, its times and smallest pack the record's).
        An error or a mismatch leaves it off: an optimisation, the runner serves without it."""
        runner, encoder = self.runner, self.runner.encoder
        self.exact_ok = False
        try:
            runner.exact.compile(runner.table.budgets[-1] * encoder.merge_unit, progress)
        except Exception:
            logger.exception("compiling the exact-layout route failed; packs without a graph run uncompiled")
            return
        recorded = self._record is not None and self._record.exact_min_rows is not None
        budgets = sample_budgets(runner.table.budgets, COST_SAMPLES)
        points = []
        for budget in budgets:
            if stop.is_set():
                return
            specs = self._sample_specs(runner.table.by_budget[budget][0].key)
            equal = [s for s in specs if s == specs[0]]
            pixels = synthetic_pixels(equal, encoder.patch_dim, encoder.device, seed=budget).to(encoder.dtype)
            out = runner.exact.run_compiled(pixels, equal)
            if out is None:  # would need a compile at this size: left unmeasured
                continue
            error = pack_error(out.tokens, out.deepstack, encoder.forward_eager(pixels, equal))
            if not math.isfinite(error) or error > runner.config.self_check_tolerance:
                logger.warning("compiled exact-layout route turned off: error %.3g at budget %d", error, budget)
                return
            runner.costs.mark_run(attention_shapes(equal))
            runner.exact.min_rows = min(runner.exact.min_rows, sum(s.input_patches for s in equal))
            if recorded:  # one check passed: its times are the record's
                break
            if runner.use_graphs:
                with runner.device_lock:
                    ms = best_ms(lambda: runner.exact.run_compiled(pixels, equal), encoder.device)
                points.append((sum(s.output_tokens for s in equal), ms))
        if recorded:
            runner.exact.min_rows = self._record.exact_min_rows
            points = list(self._record.costs.get("exact_ms", ()))
        runner.costs.set_startup("exact_ms", points)
        self.exact_ok = True

    def _finish(self) -> None:
        """Switch on what the serving thread may only use once no warm-up step can run: compiled
        forwards without graphs, the exact route, recurring graphs; then save the compile cache."""
        runner = self.runner
        with runner.device_lock:
            for entry in self._built:
                if entry.enabled:
                    entry.state = LIVE
            runner.exact.live = bool(self.exact_ok)
            runner.recurring.enabled = True
            if runner.use_graphs:
                runner.memory.peak_allocated_bytes = torch.cuda.max_memory_allocated(runner.device)
            self.full_speed = True
            self.stage = "done"
        if runner.compile_cache is not None and runner.forwards.compiled is not None:
            runner.compile_cache.save()
        self._save_record()


@dataclass
class _Check:
    """What one graph's check needs: the sample pack and its eager reference."""

    entry: GraphEntry
    pixels: torch.Tensor
    specs: list
    metadata: dict[str, torch.Tensor]
    reference: object

    @property
    def tokens(self) -> int:
        return sum(s.output_tokens for s in self.specs)


@dataclass
class _Launched:
    check: _Check
    timer: DeviceTimer | None = None
    passed: bool | None = None


class _Retry(Exception):
    """A locked step that must run again with the uncompiled forward."""


class _Warm(Exception):
    """A capture that would compile: the compiled forward runs on the layout outside the lock first."""
