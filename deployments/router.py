"""The router (ingress): HTTP and handle entry points over one path.

request items -> intake (decode pool: inspect, check the request, decode) -> encode queue
(cache, dedup, packing, encoder replicas) -> references to the results. The handle returns
the references (callers read the tensors from the encoder replicas); HTTP reads them and
serializes (safetensors or JSON) off the event loop. Client errors are `RequestError`s with
a 4xx and a body naming the item and the limit; anything else is logged and becomes a 500.

This module declares the routes and imports neither torch nor transformers; the path itself is
`service.EncodeService`, which the constructor imports after spawning the decode pool's template,
so that both processes import those libraries at the same time.
"""

import asyncio
import json
import logging
import os
import time
from typing import TYPE_CHECKING

import psutil
import ray
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from encoder_graphs.config import Ladder

from .config import AppConfig
from .decode_pool import Template
from .errors import RequestError, log_refusals_in_one_line, overloaded
from .fleet import EncoderFleet
from .http import create_api, http_ingress
from .metrics import RouterMetrics, refresh_gauges
from .process import before_constructor
from .routing import replica_reports
from .schemas import ChatRequest, EncodeRequest, parse_chat_request

if TYPE_CHECKING:
    from .results import ItemRef

logger = logging.getLogger("ray.serve")
IMPORTED = time.monotonic()
"""The end of this module's imports, for the replica's startup line."""

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


DESCRIBE_TIMEOUT_S = 2.0
"""How long `detail()` waits for a replica's own description."""
DETAIL_TTL_S = 1.0
"""How long `/v1/models/{id}` reuses its last `detail()` (with `router.expose_detail`)."""


@serve.ingress(api)
class EncoderRouter:
    def __init__(self, config: AppConfig, encoder: DeploymentHandle, llm: DeploymentHandle | None, ladder: Ladder):
        start = time.perf_counter()
        before = before_constructor(IMPORTED)
        log_refusals_in_one_line()
        template = Template.spawn()  # first: it imports torch and transformers while this process does
        try:
            from .service import EncodeService  # torch, transformers: the whole encode path

            self.config = config
            self.encoder = encoder
            self.llm = llm
            self.metrics = RouterMetrics()
            self.rejected: dict[str, int] = {}
            self.ladder = ladder.budgets  # the app builder's, as every encoder replica's
            self.fleet = EncoderFleet(serve.get_replica_context().app_name)
            self.fleet.start()
            self.service = EncodeService(config, ladder, encoder, llm, self.fleet, self.metrics)
            self.service.start(template)  # sends the template its setup, waits for it, forks the workers
        except BaseException:
            template.close()  # no decode process outlives a router that failed to start
            self._close()
            raise
        self._described: dict[str, tuple[float, dict]] = {}
        """Each deployment's last description and when it came (`_describe`)."""
        self._detail: tuple[float, dict] | None = None
        self._detail_task: asyncio.Future | None = None
        self._stop_gauges = refresh_gauges(self.service.set_gauges)
        # the constructor runs on the replica's event loop, where the cache lives
        self._forget_departed = asyncio.get_running_loop().create_task(self.service.queue.forget_departed_forever())
        api.state.router = self  # the serving app's handlers reach the router through this
        set_proxy_access_log(config.router.log_requests)
        logger.info(
            "router ready in %.1f s (before it: imports %.1f s, Serve's setup %.1f s; %d decode workers + 1 for "
            "small images, HTTP through %s). Attach from Python: %s",
            time.perf_counter() - start,
            before.imports_s,
            before.setup_s,
            self.service.intake.pool.size - 1,
            http_ingress(),
            attach_hint(serve.get_replica_context().app_name),
        )

    def __del__(self):
        self._close()

    def _close(self) -> None:
        """Stop what the constructor started, as far as it got."""
        if (task := getattr(self, "_forget_departed", None)) is not None:
            task.cancel()
        if (fleet := getattr(self, "fleet", None)) is not None:
            fleet.stop()
        if (service := getattr(self, "service", None)) is not None:
            service.close()

    # ---- HTTP ----

    @api.post("/v1/encode")
    async def encode_http(self, body: EncodeRequest, request: Request) -> Response:
        if body.model is not None and body.model != self.config.model.model_id:
            raise RequestError(404, f"model {body.model!r} is not served here; see /v1/models", "model")
        try:
            return await self.service.encode_http(body, self._tenant(request))
        except asyncio.CancelledError:  # the client went away (Serve cancels its request)
            self.count_rejection(499)
            raise

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 when a request can be served now; else 503 with the reason and Retry-After."""
        if not self.fleet.ready or self.service.decode_workers_alive == 0:
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
        return {
            "object": "list",
            "data": [
                {"id": i, "object": "model", "owned_by": "vlm-encoder-serve"} for i in dict.fromkeys(self._model_ids())
            ],
        }

    @api.get("/v1/models/{model_id:path}")
    async def model_detail(self, model_id: str) -> Response:
        """The encoder's public state (family, budgets, replicas, their warm-up); with
        `router.expose_detail`, also what operators read through the handle's `detail()`."""
        if model_id not in self._model_ids():
            raise RequestError(404, f"model {model_id!r} is not served here; see /v1/models", "model")
        if self.config.router.expose_detail:
            detail = await self._detail_snapshot()
        elif model_id == self.config.model.model_id:
            detail = {"encoder": self._public_detail()}
        else:
            detail = {}
        body = {"id": model_id, "object": "model", "owned_by": "vlm-encoder-serve"}
        body.update({part: value for part, value in detail.items() if model_id == self._part_model(part)})
        return Response(json.dumps(body, indent=2), media_type="application/json")

    def _model_ids(self) -> list[str]:
        return [self.config.model.model_id] + ([self.config.llm.model_id] if self.config.llm else [])

    def _part_model(self, part: str) -> str:
        return self.config.model.model_id if part == "encoder" else self.config.llm.model_id

    def _public_detail(self) -> dict:
        """What any client may see: nothing about other callers' requests (no cache, pack or queue
        counters), and nothing that costs more than reading this router's own state."""
        reports = replica_reports()
        return {
            "family": self.service.family,
            "budgets": list(self.ladder),
            "replicas": self.fleet.states,
            # every replica's warm-up as its last routing report gave it
            "replica_warmup": {rid: r["warmup"] for rid, r in reports.items() if "warmup" in r},
        }

    async def _detail_snapshot(self) -> dict:
        """`detail()`, computed at most once per `DETAIL_TTL_S` however many clients poll: one
        computation is shared by every request that arrives while it runs."""
        now = time.monotonic()
        if self._detail is not None and now - self._detail[0] < DETAIL_TTL_S:
            return self._detail[1]
        if self._detail_task is None or self._detail_task.done():
            self._detail_task = asyncio.ensure_future(self.detail())
        detail = await asyncio.shield(self._detail_task)
        self._detail = (time.monotonic(), detail)
        return detail

    async def detail(self) -> dict:
        """The service's state for operators (through the handle: callers that hold the cluster
        token): the encoder's replicas, warm-up, packing, cache and decode pool, one replica's own
        description, and the LLM's."""
        reports = replica_reports()
        encoder = {
            **self._public_detail(),
            "replica_work": {rid: r["work"] for rid, r in reports.items() if "work" in r},
            "router": await asyncio.to_thread(self.router_stats),
            "replica": await self._describe(self.encoder),
        }
        detail = {"encoder": encoder}
        if self.llm is not None:
            detail["llm"] = await self._describe(self.llm)
        return detail

    async def _describe(self, handle: DeploymentHandle) -> dict:
        """One replica's own description, waited for at most `DESCRIBE_TIMEOUT_S` (under load the
        call queues behind work); then the last one, marked with its age, or `{"status": "busy"}`."""
        response = handle.describe.remote()
        name = handle.deployment_name
        try:
            described = await asyncio.wait_for(response, DESCRIBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            response.cancel()
            if name not in self._described:
                return {"status": "busy", "detail": f"no replica answered within {DESCRIBE_TIMEOUT_S} s"}
            at, last = self._described[name]
            return {**last, "stale_s": round(time.monotonic() - at, 1)}
        self._described[name] = (time.monotonic(), described)
        return described

    @api.post("/v1/chat/completions")
    async def chat_http(self, body: ChatRequest, request: Request):
        try:
            return await self.service.chat(body, self._tenant(request))
        except asyncio.CancelledError:  # the client went away (Serve cancels its request)
            self.count_rejection(499)
            raise

    # ---- Python handle ----

    def _tenant(self, request: Request) -> str | None:
        """Who the HTTP caller is for the cache (`router.tenant_header`), None if it did not say."""
        value = request.headers.get(self.config.router.tenant_header)
        return None if value is None else f"http:{value}"

    async def encode(
        self, items: list, cache: bool = True, as_refs: bool = False, cache_salt: str | None = None
    ) -> "list[ItemRef]":
        """Encode PIL images, encoded image bytes, or {"type": "video", "frames": [...] | "video": bytes}
        dicts. Returns `EncodeResult`s (tensors read from the encoder replica on first use) or, with
        `as_refs`, `ItemRef`s (metadata and the reference only). `cache_salt`: share cache entries only
        with calls that give the same salt."""
        try:
            return await self.service.encode(items, cache, as_refs, cache_salt)
        except RequestError as error:  # over HTTP the exception handler counts it
            self.count_rejection(error.status)
            raise
        except asyncio.CancelledError:  # the caller cancelled its response
            self.count_rejection(499)
            raise

    async def chat(self, messages: list[dict], **params) -> dict:
        """The chat endpoint through the Python handle: OpenAI-shaped messages in, a chat.completion out."""
        try:
            return await self.service.chat(parse_chat_request({"messages": messages, **params}))
        except RequestError as error:
            self.count_rejection(error.status)
            raise
        except asyncio.CancelledError:  # the caller cancelled its response
            self.count_rejection(499)
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
            **self.service.stats(),
            "rejected": dict(self.rejected),
            "http_ingress": http_ingress(),
            "pid": os.getpid(),
            "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
            # without the object store's shared pages this process has touched (HTTP responses)
            "private_mb": round(psutil.Process().memory_full_info().uss / 2**20, 1),
        }
