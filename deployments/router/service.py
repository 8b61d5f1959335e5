"""The router's encode path: request items -> intake (decode pool) -> encode queue -> results.

This is the heavy half of the router (torch, transformers, the media libraries): `EncoderRouter`
imports it in its constructor only after spawning the decode pool's template, so that the two
processes import those libraries at the same time instead of one after the other.
"""

from __future__ import annotations

import time

from fastapi.responses import Response, StreamingResponse
from ray.serve.handle import DeploymentHandle

from encoder_graphs.config import Ladder
from models import load_preprocessor

from ..config import AppConfig
from ..decode.pool import Template
from ..metrics import RouterMetrics
from ..results import EncodeResult, ItemRef
from . import chat
from .cache import cache_scope
from .encode_queue import EncodeQueue, ResultsLost
from .fleet import EncoderFleet
from .http import http_ingress
from .intake import Intake, raw_from_http
from .ref_hold import ReferenceHold
from .responses import float_json_body, json_body, safetensors_body
from .schemas import ChatRequest, EncodeRequest

HANDLE_TENANT = "handle"
"""The tenant of every handle caller: they hold the cluster token, which lets them do anything anyway."""


def server_timing(seconds: dict[str, float]) -> str:
    """A `Server-Timing` header (W3C): where the request's time went in the service, in ms.
    `encode` is from the decoded items' queueing to their results (the router's queue, the trip
    to the replica and back); `replica_queue` and `forward` are those of the slowest item's pack;
    `serialize` is a streamed body's first part only (the rest follows)."""
    return ", ".join(f"{name};dur={value * 1e3:.2f}" for name, value in seconds.items())


class EncodeService:
    """Decodes and encodes a router's requests, and serializes its HTTP responses."""

    def __init__(
        self,
        config: AppConfig,
        ladder: Ladder,
        encoder: DeploymentHandle,
        llm: DeploymentHandle | None,
        fleet: EncoderFleet,
        metrics: RouterMetrics,
    ):
        self.config = config
        self.llm = llm
        self.fleet = fleet
        self.metrics = metrics
        self.family, _ = load_preprocessor(config.model.preset, config.model.family, config.model.path)
        self.queue = EncodeQueue(config, ladder.budgets, ladder.max_items, ladder.max_segments, encoder, fleet, metrics)
        self.intake = Intake(config)
        self.handed_out = ReferenceHold(config.router.handle_hold_s)
        self.embedding_bytes_received = 0
        """Embedding bytes this router read from the object store (HTTP responses only)."""
        self.encoded_again = 0
        """HTTP requests whose results were lost with their replica after encoding, encoded again."""
        self._http_views = http_ingress() != "serve-proxy"  # our own server writes views of the results

    def start(self, template: Template) -> None:
        """Start the decode pool from the template the router spawned (blocking)."""
        self.intake.start(template)

    def cache_scope(self, use_cache: bool, tenant: str | None, salt: str | None) -> str | None:
        """The request's cache scope (`cache.cache_scope`); None: no cache for it."""
        return cache_scope(self.config.router.cache_sharing, tenant, salt) if use_cache else None

    async def encode_raw(
        self, raws, scope: str | None, timing: dict[str, float] | None = None, read_here: bool = False, check_specs=None
    ):
        """Decode and encode request items: (decoded items, references to their results). `scope`:
        the cache scope its items share entries within (None: none). `timing` gets the seconds each
        stage took; `read_here`: this router reads the results (HTTP), and encodes again what it
        finds lost, so cache hits need no check first; `check_specs(specs)` may refuse the request
        once its items are inspected, before they are decoded."""
        start = time.perf_counter()
        decoded = await self.intake.decode(raws, self.queue.check_room, scope, check_specs)
        decoded_at = time.perf_counter()
        self.metrics.preprocess_seconds.observe(decoded_at - start)
        encoded = await self.queue.encode(decoded, check_hits=not read_here)
        if timing is not None:
            timing["decode"] = decoded_at - start
            timing["encode"] = time.perf_counter() - decoded_at
            slowest = max(encoded, key=lambda e: e.queue_s + e.forward_s, default=None)
            timing["replica_queue"] = 0.0 if slowest is None else slowest.queue_s
            timing["forward"] = 0.0 if slowest is None else slowest.forward_s
        if decoded:
            self.metrics.vision_tokens.inc(sum(d.spec.output_tokens for d in decoded))
        return decoded, encoded

    async def encode_http(self, body: EncodeRequest, tenant: str | None) -> Response:
        """`/v1/encode`: encode, read the results from the replicas, serialize them. `tenant`: what
        names the caller's tenant (the configured header's value), None if it sent none."""
        self.intake.check_item_count(len(body.items))
        raws = [raw_from_http(i, item) for i, item in enumerate(body.items)]
        timing: dict[str, float] = {}
        scope = self.cache_scope(body.cache, tenant, body.cache_salt)
        decoded, encoded = await self.encode_raw(raws, scope, timing, read_here=True)
        fetch_start = time.perf_counter()
        try:
            outputs = await self.queue.fetch(encoded)
        except ResultsLost:  # the replica died after encoding: the decoded items are still here
            self.encoded_again += 1
            encoded = await self.queue.encode(decoded)
            outputs = await self.queue.fetch(encoded)
        timing["fetch"] = time.perf_counter() - fetch_start
        self.embedding_bytes_received += sum(e.nbytes for e in encoded)
        results = [
            EncodeResult(i, d.spec.modality, d.spec.grid_thw, d.spec.output_tokens, e.ref, _output=output)
            for i, (d, e, output) in enumerate(zip(decoded, encoded, outputs))
        ]
        model = self.config.model.model_id
        serialize_start = time.perf_counter()
        if body.encoding_format != "float":  # streamed: `serialize` covers what comes before the tensors
            binary = body.encoding_format == "safetensors"
            if binary:
                length, chunks = safetensors_body(model, results, body.dtype, views=self._http_views)
            else:
                length, chunks = json_body(model, results)
            timing["serialize"] = time.perf_counter() - serialize_start
            headers = {"Server-Timing": server_timing(timing), "Content-Length": str(length)}
            media_type = "application/octet-stream" if binary else "application/json"
            return StreamingResponse(chunks, media_type=media_type, headers=headers)
        chunks = float_json_body(model, results)  # streamed too, in blocks of rows, without a Content-Length
        timing["serialize"] = time.perf_counter() - serialize_start
        headers = {"Server-Timing": server_timing(timing)}
        return StreamingResponse(chunks, media_type="application/json", headers=headers)

    async def encode(self, items: list, cache: bool, as_refs: bool, cache_salt: str | None = None) -> list[ItemRef]:
        """The handle's `encode`: `EncodeResult`s, or `ItemRef`s with `as_refs`; the references are
        held for `router.handle_hold_s`. Handle callers are one tenant (`HANDLE_TENANT`)."""
        timing: dict[str, float] = {}
        raws = self.intake.from_python(items)
        decoded, encoded = await self.encode_raw(raws, self.cache_scope(cache, HANDLE_TENANT, cache_salt), timing)
        kind = ItemRef if as_refs else EncodeResult
        timing_ms = {stage: round(seconds * 1e3, 3) for stage, seconds in timing.items()}
        self.handed_out.hold([e.ref for e in encoded])
        return [
            kind(i, d.spec.modality, d.spec.grid_thw, d.spec.output_tokens, e.ref, timing_ms=timing_ms)
            for i, (d, e) in enumerate(zip(decoded, encoded))
        ]

    async def chat(self, body: ChatRequest, tenant: str | None = HANDLE_TENANT):
        """A chat completion (a streamed response when `body.stream`); `tenant` as for `encode_http`
        (the default: the handle's caller)."""
        return await chat.complete(self, body, self.cache_scope(True, tenant, body.cache_salt))

    @property
    def decode_workers_alive(self) -> int:
        return self.intake.pool.alive

    def set_gauges(self) -> None:
        self.metrics.queued_tokens.set(self.queue.scheduler.queued_tokens)
        self.metrics.cache_bytes.set(self.queue.cache.bytes)

    def stats(self) -> dict:
        return {
            **self.queue.stats(),
            "embedding_bytes_received": self.embedding_bytes_received,
            "encoded_again": self.encoded_again,
            "handle_refs_held": len(self.handed_out),
            "decode_pool": self.intake.describe(),
        }

    def close(self) -> None:
        self.intake.close()
