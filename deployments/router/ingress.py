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
import concurrent.futures
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import psutil
import ray
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from encoder_graphs.config import Ladder

from ..config import AppConfig
from ..decode.pool import Template
from ..errors import RequestError, log_refusals_in_one_line, overloaded
from ..metrics import RouterMetrics, refresh_gauges
from ..process import before_constructor
from .fleet import EncoderFleet
from .http import create_api, http_ingress
from .routing import replica_reports
from .schemas import ChatRequest, EncodeRequest, parse_chat_request

if TYPE_CHECKING:
    from ..results import ItemRef

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


FIRST_READING_S = 2.0
"""The longest the constructor waits for its first reading of Serve's status (`/health` says "not
read yet" until it comes)."""
STARTING = "the router is starting (its decode pool and encode path are being set up)"
"""Why the router cannot serve yet, while its background setup runs."""


@serve.ingress(api)
class EncoderRouter:
    """The constructor returns quickly (after at most `FIRST_READING_S`), so that Serve routes HTTP
    to this replica from its first moment and `/health` answers 503 with what is missing instead of
    hanging (a readiness probe with a short timeout would fail instead); the slow part (the decode
    pool, torch, the encode path) is set up on a thread, and the ready line says when it is done."""

    def __init__(self, config: AppConfig, encoder: DeploymentHandle, llm: DeploymentHandle | None, ladder: Ladder):
        self._start = time.perf_counter()
        self._before = before_constructor(IMPORTED)
        log_refusals_in_one_line()
        self.config = config
        if not encoder.is_initialized:
            # its request router now, not at the first pack: `/v1/models/{id}` reads the replicas'
            # warm-up from it, and a router that had served nothing showed none (with six routers
            # behind HAProxy, a readiness probe on it never passed)
            encoder._init()
        self.encoder = encoder
        if llm is not None and llm.deployment_name == encoder.deployment_name:  # `llm.colocate`: one deployment
            # a handle of its own, so a request router of its own: a FIFO router gives the replica it
            # picks for one request to the oldest waiting one, which must not be a pack for a generation
            llm = serve.get_deployment_handle(llm.deployment_name, llm.app_name)
        self.llm = llm
        self.metrics = RouterMetrics()
        self.rejected: dict[str, int] = {}
        self.ladder = ladder.budgets  # the app builder's, as every encoder replica's
        self.service = None
        """The encode path (`service.EncodeService`), once the background setup has built it."""
        self.setup_error: str | None = None
        """Why the background setup failed (Serve's health check then replaces this replica)."""
        self._ready = threading.Event()
        self._described: dict[str, tuple[float, dict]] = {}
        """Each deployment's last description and when it came (`_describe`)."""
        self._detail: tuple[float, dict] | None = None
        self._detail_task: asyncio.Future | None = None
        self._stop_gauges: threading.Event | None = None
        self.fleet = EncoderFleet(
            serve.get_replica_context().app_name,
            deployment=encoder.deployment_name,  # `ColocatedReplica` where one deployment serves both
            llm=None if llm is None else llm.deployment_name,
        )
        self.fleet.start(FIRST_READING_S)  # later readings come in the background
        self._loop = asyncio.get_running_loop()  # the replica's event loop, where the embedding cache lives
        self._forget_departed: concurrent.futures.Future | None = None
        api.state.router = self  # the serving app's handlers reach the router through this
        threading.Thread(target=self._set_up, args=(ladder,), name="router-setup", daemon=True).start()

    def _set_up(self, ladder: Ladder) -> None:
        """The slow part of starting: the decode pool's template (spawned first: it imports torch
        and transformers while this process does), the encode path, then the ready line."""
        try:
            template = Template.spawn()
            try:
                from .service import EncodeService  # torch, transformers: the whole encode path

                service = EncodeService(self.config, ladder, self.encoder, self.llm, self.fleet, self.metrics)
                try:
                    service.start(template)  # sends the template its setup, waits for it, forks the workers
                except BaseException:
                    service.close()
                    raise
            except BaseException:
                template.close()  # no decode process outlives a router that failed to start
                raise
            self.service = service
            self._stop_gauges = refresh_gauges(service.set_gauges)
            self._forget_departed = asyncio.run_coroutine_threadsafe(
                service.queue.forget_departed_forever(), self._loop
            )
            set_proxy_access_log(self.config.router.log_requests)
        except Exception as error:
            self.setup_error = f"the router failed to start: {type(error).__name__}: {error}"
            logger.exception("router setup failed; Serve's health check replaces this replica")
            return
        finally:
            self._ready.set()
        logger.info(
            "router ready in %.1f s (before it: imports %.1f s, Serve's setup %.1f s; %d decode workers + 1 for "
            "small images, HTTP through %s). Attach from Python: %s",
            time.perf_counter() - self._start,
            self._before.imports_s,
            self._before.setup_s,
            self.service.intake.pool.size - 1,
            http_ingress(),
            attach_hint(serve.get_replica_context().app_name),
        )

    def check_health(self) -> None:
        """Serve's replica health check: a router whose setup failed is replaced."""
        if self.setup_error is not None:
            raise RuntimeError(self.setup_error)

    def _serving(self):
        """The encode path, or 503 (Retry-After) while it is being set up or if its setup failed."""
        if self.service is None:
            raise overloaded(self.setup_error or STARTING, self.config.router.retry_after_s)
        return self.service

    async def _serving_when_ready(self):
        """The encode path for a handle caller: waits for the setup (at most `request_timeout_s`),
        as a handle call waits for a replica that is starting."""
        if self.service is None and self.setup_error is None:
            await asyncio.to_thread(self._ready.wait, self.config.router.request_timeout_s)
        return self._serving()

    def missing(self) -> list[str]:
        """What keeps the application from serving every request now (empty: nothing)."""
        reasons = []
        if self.service is None:
            reasons.append(self.setup_error or STARTING)
        elif self.service.decode_workers_alive == 0:
            reasons.append("no decode worker is running")
        if not self.fleet.ready:
            reasons.append(self.fleet.why_not_ready())
        if not self.fleet.llm_ready:
            reasons.append(self.fleet.why_llm_not_ready())
        return reasons

    def __del__(self):
        self._close()

    def _close(self) -> None:
        """Stop what the constructor and the setup started, as far as they got."""
        if (task := getattr(self, "_forget_departed", None)) is not None:
            task.cancel()
        if (fleet := getattr(self, "fleet", None)) is not None:
            fleet.stop()
        if (service := getattr(self, "service", None)) is not None:
            service.close()
        if (stop := getattr(self, "_stop_gauges", None)) is not None:
            stop.set()

    # ---- HTTP ----

    @api.post("/v1/encode")
    async def encode_http(self, body: EncodeRequest, request: Request) -> Response:
        if body.model is not None and body.model != self.config.model.model_id:
            raise RequestError(404, f"model {body.model!r} is not served here; see /v1/models", "model")
        try:
            return await self._serving().encode_http(body, self._tenant(request))
        except asyncio.CancelledError:  # the client went away (Serve cancels its request)
            self.count_rejection(499)
            raise

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 when every part of the application can serve now (the router's encode path, an
        encoder replica, and in E/PD an LLM replica); else 503 with Retry-After, whose message
        names every missing part (also listed under `missing`). Answers at once from the router's
        first moment: it reads only the router's state and the last readings of Serve's status."""
        missing = self.missing()
        if missing:
            body = overloaded("; ".join(missing), self.config.router.retry_after_s).body()
            body["missing"] = missing
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(self.config.router.retry_after_s)})
        body = {"status": "ok", "encoder_replicas": self.fleet.running}
        if self.fleet.llm is not None:
            body["llm_replicas"] = self.fleet.llm.running
        return JSONResponse(body)

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
            "family": self._serving().family,
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
            "router": await asyncio.to_thread(self.router_stats) if self.service is not None else {"status": STARTING},
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
            return await self._serving().chat(body, self._tenant(request))
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
            return await (await self._serving_when_ready()).encode(items, cache, as_refs, cache_salt)
        except RequestError as error:  # over HTTP the exception handler counts it
            self.count_rejection(error.status)
            raise
        except asyncio.CancelledError:  # the caller cancelled its response
            self.count_rejection(499)
            raise

    async def chat(self, messages: list[dict], **params) -> dict:
        """The chat endpoint through the Python handle: OpenAI-shaped messages in, a chat.completion out."""
        try:
            service = await self._serving_when_ready()
            return await service.chat(parse_chat_request({"messages": messages, **params}))
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
