"""The encoder replica: one tower (one GPU, or CPU), its graphs, and a queue of packs.

Loading and capture happen in the constructor, with progress in the log. A pack arrives
as uint8 resized pixels; the replica normalizes and patchifies it on its own device with
the model's processor, runs it through the graph runner, and returns per-item CPU tensors.
Packs run one forward at a time (the GPU is the bottleneck); packs that wait meanwhile (from
every router) are merged into the next forward where they fit its largest budget, so packing
does not stop at a router's edge. Waiting packs count as queued tokens, which the routers and
the autoscaler read. A replica that Serve stops waits until the results it stored have been read
(`drain.py`) before it exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

import ray
import torch

from encoder_graphs.config import Ladder
from encoder_graphs.packing import PackItem, pack_items
from encoder_graphs.runner import EncoderRunner
from models import from_checkpoint, from_preset
from models.protocol import ItemOutput

from ..config import AppConfig
from ..metrics import EncoderMetrics, refresh_gauges
from ..process import before_constructor
from ..wire import PackRequest, PackResult, item_to_wire, resolve_dtype
from .drain import StoredResults, shutdown_budget_s, wait_until_read
from .replica_counters import ReplicaCounters
from .replica_startup import WarmupTimeline, cache_filled, waits_for_warm_up, warm_up_line

logger = logging.getLogger("ray.serve")
IMPORTED = time.monotonic()
"""The end of this module's imports, for the replica's startup line."""


@dataclass
class Waiting:
    """A pack waiting at this replica for the device."""

    pack: PackRequest
    arrived: float
    future: asyncio.Future

    def as_item(self, key: int) -> PackItem:
        """The pack as one item of the packer: its tokens, segments and item count."""
        specs = self.pack.specs
        return PackItem(key, self.pack.modality, self.pack.tokens, sum(s.segments for s in specs), len(specs))


@dataclass
class Ran:
    """A forward's outcome, before its results are stored."""

    per_pack: list
    """Each pack's item outputs, or the exception its own run raised."""
    started: float
    forward_s: float
    report: object
    """The runner's report of that forward (`encoder_graphs.stats.PackReport`), None if it failed."""


def exit_on_cuda_error(error: Exception) -> None:
    """A CUDA error is sticky: this process cannot use the GPU any more. Exit, so that Serve
    replaces the replica and its callers resend their packs elsewhere."""
    if isinstance(error, RuntimeError) and "CUDA error" in str(error):
        logger.critical("CUDA error in encoder replica, exiting so Serve replaces it: %s", error)
        os._exit(1)


def load_encoder(config: AppConfig):
    model = config.model
    if model.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device is 'cuda' but this replica sees no CUDA device (is num_gpus set to 1?)")
    dtype = resolve_dtype(model.dtype, model.device)
    if model.path is not None:
        encoder = from_checkpoint(
            model.path, family=model.family, dtype=dtype, device=model.device, attention=model.attention
        )
    else:
        encoder = from_preset(
            model.preset, family=model.family, dtype=dtype, device=model.device, attention=model.attention
        )
    logger.info("attention: %s", encoder.compile_identity().get("attention"))
    return encoder


class EncoderReplica:
    def __init__(self, config: AppConfig, ladder: Ladder):
        start = time.perf_counter()
        self.before = before_constructor(IMPORTED)
        sys.setswitchinterval(config.model.switch_interval_ms / 1e3)
        if config.model.device == "cpu":
            torch.set_num_threads(max(1, torch.get_num_threads()))
        self.encoder = load_encoder(config)
        self.model_id = config.model.model_id  # the served name: `encoder.name` is a checkpoint's path
        self.loaded_s = time.perf_counter() - start
        logger.info("loaded %s on %s in %.1f s", self.encoder.name, self.encoder.device, self.loaded_s)
        # ---- warm-up: after `prepare` packs run eagerly; graphs go live in the background, which a
        # replica on a filled compile cache waits for before it takes traffic (`replica_startup.py`)
        self.runner = EncoderRunner(self.encoder, config.graphs, ladder)
        self.runner.prepare(progress=logger.info)
        self._stop_warmup = threading.Event()
        waits = waits_for_warm_up(config.replica.warm_up_before_ready, cache_filled(self.runner))
        self._warmup = threading.Thread(target=self._warm_up, args=(waits,), name="graph-warm-up", daemon=True)
        self._warmup.start()
        if waits:
            self._warmup.join(config.replica.warm_up_wait_s)
        # ---- end warm-up
        self.ladder = ladder
        self._waiting: list[Waiting] = []
        self._drain: asyncio.Task | None = None
        self._storing: set[asyncio.Task] = set()
        self.counters = ReplicaCounters()
        self.stored = StoredResults()
        """What this replica's object store holds for callers: a stopping replica waits for it."""
        self._ended_with_work: float | None = None
        """When the last forward ended, if packs were waiting then."""
        self.metrics = EncoderMetrics()
        self._stop_gauges = refresh_gauges(self._set_gauges)
        self.actor_id = ray.get_runtime_context().get_actor_id()
        self.ready_s = time.perf_counter() - start
        then = self._ready_then(waits, config.replica.warm_up_wait_s)
        logger.info(
            "encoder replica ready in %.1f s (weights %.1f s, prepare %.1f s; before it: imports %.1f s, Serve's "
            "setup %.1f s, %.1f s since its worker process started): %s",
            self.ready_s,
            self.loaded_s,
            self.runner.warmup_status().stage_seconds.get("prepare", 0.0),
            self.before.imports_s,
            self.before.setup_s,
            self.before.process_s,
            then,
        )

    def _warm_up(self, waited: bool) -> None:
        """The warm-up (in its thread), then one line of where its seconds went."""
        timeline = WarmupTimeline(logger.info)
        try:
            self.runner.warm_up(timeline, self._stop_warmup)
        finally:
            logger.info(warm_up_line(self.runner.warmup_status(), timeline, waited))

    def _ready_then(self, waited: bool, wait_s: float) -> str:
        """What the ready line says comes next."""
        status = self.runner.warmup_status()
        if status.full_speed:
            return f"at full speed ({status.graphs_live}/{status.graphs_total} graphs live)"
        if waited:
            return f"warm-up not done within replica.warm_up_wait_s={wait_s:g}: packs run eagerly while it goes on"
        if self.runner.use_graphs:
            return (
                f"packs run eagerly while {status.graphs_total} graphs warm up in the background; "
                "the log says when it is at full speed"
            )
        # nothing to capture on this device: the table's budgets still shape the packs
        return f"packs run eagerly ({self.encoder.device.type}: no CUDA graphs)"

    def _set_gauges(self) -> None:
        status = self.runner.warmup_status()
        self.metrics.queued_tokens.set(self.counters.queued_tokens)
        self.metrics.graphs_live.set(status.graphs_live)
        self.metrics.full_speed.set(1 if status.full_speed else 0)

    async def encode_pack(self, pack: PackRequest) -> PackResult:
        self.counters.count(queued=pack.tokens)
        if pack.router:
            self.counters.router_said(pack.router, pack.router_waiting_tokens, pack.router_report)
        waiting = Waiting(pack, time.perf_counter(), asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        if self._drain is None or self._drain.done():
            self._drain = asyncio.get_running_loop().create_task(self._run_waiting())
        return await waiting.future  # a caller that gives up cancels it: its pack is dropped

    async def _run_waiting(self) -> None:
        """Run the waiting packs, one forward at a time, the oldest first with those that fit beside
        it. A forward's results are stored while the next forward runs."""
        batch: list[Waiting] = []
        try:
            while self._waiting:
                batch = self._next_batch()
                if not batch:  # every waiting caller gave up
                    continue
                try:
                    ran = await asyncio.to_thread(self._compute, batch)
                except Exception as error:
                    ran = Ran([error] * len(batch), time.perf_counter(), 0.0, None)
                packs = [waiting.pack for waiting in batch]
                self.counters.ran(len(packs), sum(p.requests for p in packs), sum(p.tokens for p in packs))
                store = asyncio.get_running_loop().create_task(self._deliver(batch, ran))
                self._storing.add(store)
                store.add_done_callback(self._storing.discard)
                batch = []
        finally:  # stopped abnormally (the replica shutting down): no caller waits forever
            for waiting in batch + self._waiting:
                if not waiting.future.done():
                    waiting.future.set_exception(RuntimeError("the encoder replica stopped"))

    def _next_batch(self) -> list[Waiting]:
        live = []
        for waiting in self._waiting:
            if waiting.future.done():  # its caller gave up
                self.counters.count(queued=-waiting.pack.tokens)
            else:
                live.append(waiting)
        if not live:
            self._waiting = []
            return []
        ladder = self.ladder
        first = pack_items(
            [w.as_item(i) for i, w in enumerate(live)], ladder.budgets, ladder.max_items, ladder.max_segments
        )[0]
        chosen = {item.key for item in first.items}  # the oldest pack and those that fit beside it
        self._waiting = [w for i, w in enumerate(live) if i not in chosen]
        return [w for i, w in enumerate(live) if i in chosen]

    def _compute(self, batch: list[Waiting]) -> Ran:
        """The batch's packs as one forward (on the device, under its lock): each pack's outputs,
        or the error of its own run alone if the merged forward failed."""
        packs = [waiting.pack for waiting in batch]
        tokens = sum(pack.tokens for pack in packs)
        # One drain task runs forwards one at a time; the runner's device lock also keeps this
        # forward's device-side preprocessing out of a warm-up capture.
        with self.runner.device_lock:
            started = time.perf_counter()
            if self._ended_with_work is not None:
                self.counters.add_seconds("between", started - self._ended_with_work)
            self.counters.count(queued=-tokens, inflight=tokens)
            try:
                outputs = self._forward(packs)
                per_pack, offset = [], 0
                for pack in packs:
                    per_pack.append(outputs[offset : offset + len(pack.specs)])
                    offset += len(pack.specs)
            except Exception as error:
                exit_on_cuda_error(error)
                # merged: each pack runs alone, so a failure stays its own
                per_pack = [error] if len(packs) == 1 else [self._alone(pack) for pack in packs]
            finally:
                self.counters.count(inflight=-tokens)
            failed = all(isinstance(outputs, Exception) for outputs in per_pack)
            ended = time.perf_counter()
            self._ended_with_work = ended if self._waiting else None
            return Ran(per_pack, started, ended - started, None if failed else self.runner.stats.last)

    def _alone(self, pack: PackRequest) -> list[ItemOutput] | Exception:
        try:
            return self._forward([pack])
        except Exception as error:
            exit_on_cuda_error(error)
            return error

    async def _deliver(self, batch: list[Waiting], ran: Ran) -> None:
        try:
            results = await asyncio.to_thread(self._store, batch, ran)
        except Exception as error:
            results = [error] * len(batch)
        for waiting, result in zip(batch, results):
            if waiting.future.done():
                continue
            if isinstance(result, BaseException):
                waiting.future.set_exception(result)
            else:
                waiting.future.set_result(result)

    def _store(self, batch: list[Waiting], ran: Ran) -> list[PackResult | Exception]:
        """Each pack's outputs into this replica's object store (off the device lock: the next
        forward runs meanwhile)."""
        started = time.perf_counter()
        results: list[PackResult | Exception] = []
        for waiting, outputs in zip(batch, ran.per_pack):
            if isinstance(outputs, Exception):
                results.append(outputs)
                continue
            try:
                refs = [ray.put(item_to_wire(out)) for out in outputs]
                self.stored.add(refs)
                results.append(
                    PackResult(
                        refs,
                        [out.nbytes for out in outputs],
                        self.actor_id,
                        queue_s=ran.started - waiting.arrived,
                        forward_s=ran.forward_s,
                        merged=len(batch),
                    )
                )
            except Exception as error:
                results.append(error)
        self.counters.add_seconds("store", time.perf_counter() - started)
        try:
            self._observe([w.pack for w in batch], results, ran.report)
        except Exception:  # metrics must never fail a pack
            logger.exception("recording metrics failed")
        return results

    def _observe(self, packs: list[PackRequest], results: list[PackResult | Exception], report) -> None:
        metrics = self.metrics
        done = [r for r in results if isinstance(r, PackResult)]
        tokens = sum(pack.tokens for pack, r in zip(packs, results) if isinstance(r, PackResult))
        if tokens:
            metrics.vision_tokens.inc(tokens)
        metrics.queued_tokens.set(self.counters.queued_tokens)
        for result in done:
            metrics.queue_seconds.observe(result.queue_s)
        if not done or report is None:
            return
        metrics.forward_seconds.observe(done[0].forward_s)
        if report.graph and report.recurring:  # the pack's own graph: no padding computed
            metrics.graph_hits.inc(tags={"budget": "recurring"})
            metrics.computed_tokens.inc(report.real_tokens)
        elif report.graph:
            metrics.graph_hits.inc(tags={"budget": str(report.budget)})
            if report.budget > report.real_tokens:
                metrics.padded_tokens.inc(report.budget - report.real_tokens)
            metrics.computed_tokens.inc(report.budget)
        else:
            # compiled: "true" (compiled on the exact layout), "false", or "fallback" (it would have
            # needed a compile on the request path and ran uncompiled)
            compiled = "fallback" if report.recompile_fallback else str(report.compiled).lower()
            metrics.eager_fallbacks.inc(tags={"reason": report.eager_reason, "compiled": compiled})
            if report.budget is not None:
                metrics.graph_misses.inc(tags={"budget": str(report.budget)})

    def _forward(self, packs: list[PackRequest]) -> list[ItemOutput]:
        """Packs of one modality as one forward; their items' outputs in order."""
        started = time.perf_counter()
        pixels = [p for pack in packs for p in pack.pixels]
        specs = [spec for pack in packs for spec in pack.specs]
        pixel_values = self.encoder.preprocessor.pixel_values(pixels, packs[0].modality, device=self.encoder.device)
        expected = sum(spec.input_patches for spec in specs)
        if pixel_values.shape[0] != expected:  # the graphs would read rows that are not there
            raise ValueError(f"the pack's pixels make {pixel_values.shape[0]} patches, its specs say {expected}")
        pixel_values = pixel_values.to(self.encoder.dtype)
        prepared = time.perf_counter()
        self.counters.add_seconds("preprocess", prepared - started)
        # One device-to-host copy for the whole forward; items are views of it.
        outputs = self.runner.run(pixel_values, specs, output_device="cpu")
        self.counters.add_seconds("run", time.perf_counter() - prepared)
        return outputs

    def record_routing_stats(self) -> dict:
        return {
            "queued_tokens": self.counters.load_tokens,
            "live_budgets": list(self.runner.live_budgets()),  # budgets whose packs replay a live graph
            "warmup": self._warmup_summary(),  # for the routers' `/v1/models`, one entry per replica
            # likewise: what each replica did, for rates between two reports
            "work": self.counters.work_summary(self.runner.stats),
        }

    def _before_summary(self) -> dict:
        return {key: round(value, 2) for key, value in self.before._asdict().items()}

    def _warmup_summary(self) -> dict:
        return {
            "pid": os.getpid(),
            "before_constructor": self._before_summary(),  # imports, Serve's setup, the worker's age
            "ready_s": round(self.ready_s, 2),
            # stage, graphs live of total, full speed, stage seconds, from_record (captured on an
            # earlier warm-up's checks)
            **self.runner.warmup_status().as_dict(),
        }

    def record_autoscaling_stats(self) -> dict:
        """This replica's tokens and the routers' held-back ones (`ReplicaCounters.autoscaling_stats`)."""
        return self.counters.autoscaling_stats()

    def describe(self) -> dict:
        return {
            "model": self.model_id,
            "family": self.encoder.family,
            "device": str(self.encoder.device),
            "dtype": str(self.encoder.dtype).removeprefix("torch."),
            "ready_s": round(self.ready_s, 2),
            "before_constructor": self._before_summary(),  # imports, Serve's setup, the worker's age
            "queued_tokens": self.counters.queued_tokens,
            "inflight_tokens": self.counters.inflight_tokens,
            # pid, forwards, merged packs and requests, tokens, step seconds
            **self.counters.work_summary(self.runner.stats),
            **self.counters.per_forward(),  # packs and requests per forward
            **self.runner.describe(),
        }

    def check_health(self) -> None:
        if self.encoder.device.type == "cuda":
            with self.runner.device_lock:  # never a device-wide sync during a warm-up capture
                torch.cuda.synchronize(self.encoder.device)  # surfaces a sticky CUDA error; Serve restarts us

    async def __del__(self) -> None:
        """Serve stopping the replica (after its ongoing packs, with new ones refused): the warm-up
        stops between steps, and the replica waits for the results it stored to be read (`drain.py`)."""
        stop = getattr(self, "_stop_warmup", None)
        if stop is not None:
            stop.set()
        stored = getattr(self, "stored", None)
        if stored is not None:
            await wait_until_read(stored, shutdown_budget_s())
