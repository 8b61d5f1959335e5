"""The router (ingress): HTTP and handle entry points over one path.

request items -> intake (decode pool: inspect, check the request, decode) -> encode queue
(cache, dedup, packing, encoder replicas) -> references to the results. The handle returns
the references (callers read the tensors from the encoder replicas); HTTP reads them and
serializes (safetensors or JSON) off the event loop. Client errors are `RequestError`s with
a 4xx and a body naming the item and the limit; anything else is logged and becomes a 500.
"""

import asyncio
import json
import logging
import os
import time

import psutil
import ray
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from encoder_graphs.config import Ladder
from models import load_preprocessor

from . import chat as chat_api
from .config import AppConfig
from .encode_queue import EncodeQueue, ResultsLost
from .errors import RequestError, overloaded
from .fleet import EncoderFleet
from .http import create_api, http_ingress
from .intake import Intake, raw_from_http, raw_from_python
from .metrics import RouterMetrics, refresh_gauges
from .ref_hold import ReferenceHold
from .responses import encode_response_json, json_body, safetensors_body
from .results import EncodeResult, ItemRef
from .routing import replica_reports
from .schemas import EncodeRequest

logger = logging.getLogger("ray.serve")

api = create_api()


def set_proxy_access_log(enabled: bool) -> None:
    """Serve's proxies log a line per request unless Serve's global logging config says not to,
    and `serve run` of a YAML cannot set that config: so the router sets it, keeping the rest."""
    try:
        client = serve.context._get_global_client()
        current, _ = ray.get(client._controller._get_logging_config.remote())
        if current.enable_access_log != enabled:
            client.update_global_logging_config(current.model_copy(update={"enable_access_log": enabled}))
    except Exception:  # logging must never stop the router
        logger.warning("could not set the proxies' access log to %s", enabled, exc_info=True)


def attach_hint(app_name: str) -> str:
    """How a Python process on a node of this cluster gets this application's handle."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    env = "RAY_AUTH_MODE=token " if is_token_auth_enabled() else ""
    address = ray.get_runtime_context().gcs_address
    return f"{env}RAY_ADDRESS={address} python, then ray.init(); serve.get_app_handle({app_name!r})"


def server_timing(seconds: dict[str, float]) -> str:
    """A `Server-Timing` header (W3C): where the request's time went in the service, in ms.
    `encode` is from the decoded items' queueing to their results (the router's queue, the trip
    to the replica and back); `replica_queue` and `forward` are those of the slowest item's pack;
    `serialize` is a `float` JSON body's, or a streamed body's first part only (the rest follows)."""
    return ", ".join(f"{name};dur={value * 1e3:.2f}" for name, value in seconds.items())


DESCRIBE_TIMEOUT_S = 2.0
"""How long `/v1/models/{id}` waits for an encoder replica's own description."""


@serve.ingress(api)
class EncoderRouter:
    def __init__(self, config: AppConfig, encoder: DeploymentHandle, llm: DeploymentHandle | None, ladder: Ladder):
        start = time.perf_counter()
        self.config = config
        self.encoder = encoder
        self.llm = llm
        self.metrics = RouterMetrics()
        self.rejected: dict[str, int] = {}
        self.embedding_bytes_received = 0
        """Embedding bytes this router read from the object store (HTTP responses only)."""
        self.encoded_again = 0
        """HTTP requests whose results were lost with their replica after encoding, encoded again."""
        self.handed_out = ReferenceHold(config.router.handle_hold_s)
        self.family, _ = load_preprocessor(config.model.preset, config.model.family, config.model.path)
        self.ladder = ladder.budgets  # the app builder's, as every encoder replica's
        self.fleet = EncoderFleet(serve.get_replica_context().app_name)
        self.fleet.start()
        self.queue = EncodeQueue(
            config, ladder.budgets, ladder.max_items, ladder.max_segments, encoder, self.fleet, self.metrics
        )
        self.intake = Intake(config)
        self.intake.start()
        self._described: tuple[float, dict] | None = None
        self._stop_gauges = refresh_gauges(self._set_gauges)
        api.state.router = self  # the serving app's handlers reach the router through this
        self._http_views = http_ingress() != "serve-proxy"  # our own server writes views of the results
        set_proxy_access_log(config.router.log_requests)
        logger.info(
            "router ready in %.1f s (%d decode workers + 1 for small images, HTTP through %s). Attach from Python: %s",
            time.perf_counter() - start,
            self.intake.pool.size - 1,
            http_ingress(),
            attach_hint(serve.get_replica_context().app_name),
        )

    def _set_gauges(self) -> None:
        self.metrics.queued_tokens.set(self.queue.scheduler.queued_tokens)
        self.metrics.cache_bytes.set(self.queue.cache.bytes)

    def __del__(self):
        self.fleet.stop()
        self.intake.close()

    # ---- the shared path ----

    async def encode_raw(self, raws, use_cache: bool, timing: dict[str, float] | None = None, read_here: bool = False):
        """Decode and encode request items: (decoded items, references to their results). `timing`
        gets the seconds each stage took; `read_here`: this router reads the results (HTTP), and
        encodes again what it finds lost, so cache hits need no check first."""
        start = time.perf_counter()
        decoded = await self.intake.decode(raws, self.queue.check_room, "" if use_cache else None)
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

    # ---- HTTP ----

    @api.post("/v1/encode")
    async def encode_http(self, body: EncodeRequest) -> Response:
        if body.model is not None and body.model != self.config.model.model_id:
            raise RequestError(
                404, f"model {body.model!r} is not served here; see /v1/models", "model", "invalid_request_error"
            )
        self.intake.check_item_count(len(body.items))
        raws = [raw_from_http(i, item) for i, item in enumerate(body.items)]
        timing: dict[str, float] = {}
        decoded, encoded = await self.encode_raw(raws, body.cache, timing, read_here=True)
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
        content = await asyncio.to_thread(encode_response_json, model, results, body.encoding_format)
        timing["serialize"] = time.perf_counter() - serialize_start
        headers = {"Server-Timing": server_timing(timing)}
        return Response(content=content, media_type="application/json", headers=headers)

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 when a request can be served now; else 503 with the reason and Retry-After."""
        if not self.fleet.ready or self.intake.pool.alive == 0:
            reason = self.fleet.why_not_ready() if not self.fleet.ready else "no decode worker is running"
            return JSONResponse(
                overloaded(reason, self.config.router.retry_after_s).body(),
                status_code=503,
                headers={"Retry-After": str(self.config.router.retry_after_s)},
            )
        return JSONResponse({"status": "ok", "encoder_replicas": self.fleet.running})

    @api.get("/v1/models")
    async def models(self) -> dict:
        """The served models, OpenAI-shaped; details at `/v1/models/{id}`."""
        ids = [self.config.model.model_id] + ([self.config.llm.model_id] if self.config.llm else [])
        return {
            "object": "list",
            "data": [{"id": i, "object": "model", "owned_by": "vlm-encoder-serve"} for i in dict.fromkeys(ids)],
        }

    @api.get("/v1/models/{model_id:path}")
    async def model_detail(self, model_id: str) -> Response:
        """The encoder's (or the LLM's) state: replicas, warm-up, packing, cache, decode pool."""
        detail = {}
        if model_id == self.config.model.model_id:
            detail["encoder"] = {
                "family": self.family,
                "budgets": list(self.ladder),
                "replicas": self.fleet.states,
                # every replica's warm-up as its last routing report gave it (the `replica` below is one)
                "replica_warmup": {rid: r["warmup"] for rid, r in replica_reports().items() if "warmup" in r},
                "router": self.router_stats(),
                "replica": await self._describe(self.encoder),
            }
        if self.config.llm is not None and model_id == self.config.llm.model_id:
            detail["llm"] = await self._describe(self.llm)
        if not detail:
            raise RequestError(404, f"model {model_id!r} is not served here; see /v1/models", "model", "not_found")
        body = {"id": model_id, "object": "model", "owned_by": "vlm-encoder-serve", **detail}
        return Response(json.dumps(body, indent=2), media_type="application/json")

    async def _describe(self, handle: DeploymentHandle) -> dict:
        """One replica's own description, waited for at most `DESCRIBE_TIMEOUT_S` (under load the
        call queues behind work); then the last one, marked with its age, or `{"status": "busy"}`."""
        response = handle.describe.remote()
        try:
            described = await asyncio.wait_for(response, DESCRIBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            response.cancel()
            if self._described is None:
                return {"status": "busy", "detail": f"no replica answered within {DESCRIBE_TIMEOUT_S} s"}
            at, last = self._described
            return {**last, "stale_s": round(time.monotonic() - at, 1)}
        self._described = (time.monotonic(), described)
        return described

    @api.post("/v1/chat/completions")
    async def chat_http(self, body: chat_api.ChatRequest):
        return await chat_api.complete(self, body)

    # ---- Python handle ----

    async def encode(self, items: list, cache: bool = True, as_refs: bool = False) -> list[ItemRef]:
        """Encode PIL images, encoded image bytes, or {"type": "video", "frames": [...] | "video": bytes}
        dicts. Returns `EncodeResult`s (tensors read from the encoder replica on first use) or, with
        `as_refs`, `ItemRef`s (metadata and the reference only)."""
        timing: dict[str, float] = {}
        try:
            raws = [raw_from_python(index, item) for index, item in enumerate(items)]
            decoded, encoded = await self.encode_raw(raws, cache, timing)
        except RequestError as error:  # over HTTP the exception handler counts it
            self.count_rejection(error.status)
            raise
        kind = ItemRef if as_refs else EncodeResult
        timing_ms = {stage: round(seconds * 1e3, 3) for stage, seconds in timing.items()}
        self.handed_out.hold([e.ref for e in encoded])
        return [
            kind(i, d.spec.modality, d.spec.grid_thw, d.spec.output_tokens, e.ref, timing_ms=timing_ms)
            for i, (d, e) in enumerate(zip(decoded, encoded))
        ]

    async def chat(self, messages: list[dict], **params) -> dict:
        """The chat endpoint through the Python handle: OpenAI-shaped messages in, a chat.completion out."""
        try:
            return await chat_api.complete(self, chat_api.parse_request({"messages": messages, **params}))
        except RequestError as error:
            self.count_rejection(error.status)
            raise

    # ---- bookkeeping ----

    def count_rejection(self, status: int) -> None:
        """Count a refused request by reason (for the model detail and the metric)."""
        reason = {
            408: "slow_client",
            499: "disconnected",
            413: "limit",
            415: "format",
            503: "overloaded",
            504: "timeout",
        }.get(status, "not_found" if status == 404 else "invalid" if status < 500 else "failed")
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        self.metrics.rejected.inc(tags={"reason": reason})

    def router_stats(self) -> dict:
        return {
            **self.queue.stats(),
            "rejected": dict(self.rejected),
            "embedding_bytes_received": self.embedding_bytes_received,
            "encoded_again": self.encoded_again,
            "handle_refs_held": len(self.handed_out),
            "decode_pool": self.intake.describe(),
            "http_ingress": http_ingress(),
            "pid": os.getpid(),
            "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
            # without the object store's shared pages this process has touched (HTTP responses)
            "private_mb": round(psutil.Process().memory_full_info().uss / 2**20, 1),
        }
