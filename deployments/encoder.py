"""The encoder replica: one tower (one GPU, or CPU), its graphs, and a queue of packs.

Loading and capture happen in the constructor, with progress in the log. A pack arrives
as uint8 resized pixels; the replica normalizes and patchifies it on its own device with
the model's processor, runs it through the graph runner, and returns per-item CPU tensors.
Packs run one at a time (the GPU is the bottleneck); others wait here and count as
queued tokens, which the router and the autoscaler read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass

import ray
import torch
from ray import serve

from encoder_graphs.config import Ladder
from encoder_graphs.runner import EncoderRunner
from models import from_checkpoint, from_preset
from models.protocol import ItemOutput, ItemSpec, from_wire, to_wire

from .config import AppConfig
from .metrics import EncoderMetrics, refresh_gauges

logger = logging.getLogger("ray.serve")


@dataclass
class PackRequest:
    """One pack on its way to an encoder replica."""

    pack_id: int
    modality: str
    pixels: list[torch.Tensor]
    """uint8 resized items (`[3, h, w]` or `[T, 3, h, w]`; InternVL: `[tiles, 3, h, w]`), in pack order."""
    specs: list[ItemSpec]

    @property
    def tokens(self) -> int:
        return sum(spec.output_tokens for spec in self.specs)

    def __reduce__(self):  # pixels as numpy: a pickled tensor costs 6x more router CPU per byte
        return (_pack_from_wire, (self.pack_id, self.modality, [to_wire(p) for p in self.pixels], self.specs))


def _pack_from_wire(pack_id: int, modality: str, pixels: list, specs: list[ItemSpec]) -> PackRequest:
    return PackRequest(pack_id, modality, [from_wire(p) for p in pixels], specs)


@dataclass
class PackResult:
    """An encoded pack: per-item references into this replica's object store, and where the time went."""

    outputs: list
    """`ray.ObjectRef` of each item's `ItemOutput`, in pack order: callers, the router and the LLM
    replica pass these along, and whoever needs the tensors reads them from here."""
    item_bytes: list[int]
    replica: str
    """This replica's actor id (its objects are lost if it dies)."""
    queue_s: float
    """Waiting in the replica for the device."""
    forward_s: float
    """Normalize, patchify, encode and copy to host."""


def output_bytes(output: ItemOutput) -> int:
    return output.tokens.nbytes + (0 if output.deepstack is None else output.deepstack.nbytes)


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, dtype)


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


@serve.deployment(max_ongoing_requests=8, health_check_period_s=10)
class EncoderReplica:
    def __init__(self, config: AppConfig, ladder: Ladder):
        start = time.perf_counter()
        if config.model.device == "cpu":
            torch.set_num_threads(max(1, torch.get_num_threads()))
        self.encoder = load_encoder(config)
        self.loaded_s = time.perf_counter() - start
        logger.info("loaded %s on %s in %.1f s", self.encoder.name, self.encoder.device, self.loaded_s)
        # ---- warm-up: ready after `prepare` (packs run eagerly), graphs go live in the background
        self.runner = EncoderRunner(self.encoder, config.graphs, ladder)
        self.runner.prepare(progress=logger.info)
        self._stop_warmup = threading.Event()
        self._warmup = threading.Thread(
            target=self.runner.warm_up, args=(logger.info, self._stop_warmup), name="graph-warm-up", daemon=True
        )
        self._warmup.start()
        # ---- end warm-up
        self._lock = threading.Lock()
        self._counter_lock = threading.Lock()
        self.metrics = EncoderMetrics()
        self._queued_tokens = 0
        self._inflight_tokens = 0
        self._stop_gauges = refresh_gauges(self._set_gauges)
        self.actor_id = ray.get_runtime_context().get_actor_id()
        self.ready_s = time.perf_counter() - start
        logger.info(
            "encoder replica ready in %.1f s (weights %.1f s, prepare %.1f s): packs run eagerly while "
            "%d graphs warm up in the background; the log says when it is at full speed",
            self.ready_s,
            self.loaded_s,
            self.runner.warmup_status().stage_seconds.get("prepare", 0.0),
            self.runner.warmup_status().graphs_total,
        )

    def _set_gauges(self) -> None:
        status = self.runner.warmup_status()
        self.metrics.queued_tokens.set(self._queued_tokens)
        self.metrics.graphs_live.set(status.graphs_live)
        self.metrics.full_speed.set(1 if status.full_speed else 0)

    async def encode_pack(self, pack: PackRequest) -> PackResult:
        self._count(queued=pack.tokens)
        return await asyncio.to_thread(self._run, pack, time.perf_counter())

    def _count(self, queued: int = 0, inflight: int = 0) -> None:
        with self._counter_lock:
            self._queued_tokens += queued
            self._inflight_tokens += inflight

    def _run(self, pack: PackRequest, arrived: float) -> PackResult:
        # One pack at a time on the device; the runner's device lock also keeps this pack's
        # device-side preprocessing out of a warm-up capture.
        with self._lock, self.runner.device_lock:
            started = time.perf_counter()
            self._count(queued=-pack.tokens, inflight=pack.tokens)
            try:
                outputs = self._encode(pack)
            except RuntimeError as error:
                if "CUDA error" in str(error):  # sticky: this process cannot use the GPU any more
                    logger.critical("CUDA error in encoder replica, exiting so Serve replaces it: %s", error)
                    os._exit(1)  # callers see the replica die and resend the pack elsewhere
                raise
            finally:
                self._count(inflight=-pack.tokens)
            forward_s = time.perf_counter() - started
        # Into this replica's object store, outside the device lock: the next pack may start.
        result = PackResult(
            [ray.put(out) for out in outputs],
            [output_bytes(out) for out in outputs],
            self.actor_id,
            queue_s=started - arrived,
            forward_s=forward_s,
        )
        try:
            self._observe(pack, result)
        except Exception:  # metrics must never fail a pack
            logger.exception("recording metrics failed")
        return result

    def _observe(self, pack: PackRequest, result: PackResult) -> None:
        metrics, report = self.metrics, self.runner.stats.last
        if pack.tokens:
            metrics.vision_tokens.inc(pack.tokens)
        metrics.queued_tokens.set(self._queued_tokens)
        metrics.queue_seconds.observe(result.queue_s)
        metrics.forward_seconds.observe(result.forward_s)
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

    def _encode(self, pack: PackRequest) -> list[ItemOutput]:
        device = self.encoder.device
        pixel_values = self.encoder.preprocessor.pixel_values(pack.pixels, pack.modality, device=device)
        # One device-to-host copy for the whole pack; items are views of it.
        return self.runner.run(pixel_values.to(self.encoder.dtype), pack.specs, output_device="cpu")

    def record_routing_stats(self) -> dict:
        return {
            "queued_tokens": self._queued_tokens + self._inflight_tokens,
            "live_budgets": list(self.runner.live_budgets()),  # budgets whose packs replay a live graph
        }

    def record_autoscaling_stats(self) -> dict:
        return {"queued_tokens": float(self._queued_tokens), "inflight_tokens": float(self._inflight_tokens)}

    def describe(self) -> dict:
        return {
            "model": self.encoder.name,
            "family": self.encoder.family,
            "device": str(self.encoder.device),
            "dtype": str(self.encoder.dtype).removeprefix("torch."),
            "ready_s": round(self.ready_s, 2),
            "pid": os.getpid(),
            "queued_tokens": self._queued_tokens,
            "inflight_tokens": self._inflight_tokens,
            **self.runner.describe(),
        }

    def check_health(self) -> None:
        if self.encoder.device.type == "cuda":
            with self.runner.device_lock:  # never a device-wide sync during a warm-up capture
                torch.cuda.synchronize(self.encoder.device)  # surfaces a sticky CUDA error; Serve restarts us

    def __del__(self) -> None:
        stop = getattr(self, "_stop_warmup", None)
        if stop is not None:  # Serve shutting the replica down: the warm-up stops between steps
            stop.set()
