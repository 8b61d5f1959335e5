"""The FastAPI app of the router: error bodies, the request-size guards, rejection counting.

Serve pickles the ingress class by value, so module globals seen by its methods and by
these handlers are different copies. Everything shared therefore goes through the app
object that actually serves requests: `request.app.state.router` (set by the router).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException

from ..errors import RequestError
from .json_values import json_path, largest_container, values_past
from .schemas import ErrorResponse, error_param, request_error

logger = logging.getLogger("ray.serve")


def http_ingress() -> str:
    """How HTTP reaches the routers: "haproxy" (HAProxy in front of each router's own HTTP
    server: `RAY_SERVE_ENABLE_HA_PROXY=1` where Ray starts), "direct" (each router's own server,
    no balancer) or "serve-proxy" (Serve's Python proxy, one process per node: the default)."""
    from ray.serve._private import constants

    if constants.RAY_SERVE_ENABLE_HA_PROXY:
        return "haproxy"
    return "direct" if constants.RAY_SERVE_ENABLE_DIRECT_INGRESS else "serve-proxy"


ERRORS = {status: {"model": ErrorResponse} for status in (400, 404, 408, 413, 415, 500, 503, 504)}


class BodyLimit:
    """ASGI middleware: the request body within `max_request_bytes`, `body_timeout_s` and
    `json_value_limit(config)` values.

    A declared Content-Length over the limit is refused before reading; otherwise the body is
    read up to the limit (413 as soon as it passes it) and within the time limit (408: a slow
    client must not hold a request slot). The router parses the whole body anyway, so reading
    it here first holds no more than the limit. A JSON body is then refused for the values it
    holds, counted on its bytes, before the framework parses it: a parsed tree and its validation
    errors grow with the values, ~1 KB of errors per two bytes of `0,`. A client that leaves,
    mid-upload or while its response streams, is counted, not logged as an error."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        router = getattr(scope.get("app").state, "router", None) if scope["type"] == "http" else None
        if router is None:
            return await self.app(scope, receive, send)
        limits, settings = router.config.limits, router.config.router
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limits.max_request_bytes:
            what = f"request body of {int(declared)} bytes exceeds max_request_bytes={limits.max_request_bytes}"
            return await _refuse(router, send, RequestError(413, what))
        client = _Client(receive, router)
        chunks, received, more = [], 0, True
        deadline = asyncio.get_running_loop().time() + settings.body_timeout_s
        while more:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(client.receive(), max(remaining, 0.001))
            except asyncio.TimeoutError:
                error = RequestError(408, f"request body not received within body_timeout_s={settings.body_timeout_s}")
                return await _refuse(router, send, error)
            if message["type"] != "http.request":
                return  # the client went away (counted)
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > limits.max_request_bytes:
                what = f"request body of more than {limits.max_request_bytes} bytes exceeds max_request_bytes"
                return await _refuse(router, send, RequestError(413, f"{what}={limits.max_request_bytes}"))
            more = message.get("more_body", False)
        if _is_json(scope):
            body = b"".join(chunks)
            chunks, limit = [body], json_value_limit(router.config)
            past = values_past(body, limit)
            if past is not None:
                return await _refuse(router, send, too_many_values(body[:past], limit))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await client.receive()

        await self.app(scope, replay, send)


MIN_JSON_VALUES = 1 << 16
"""The fewest JSON values a request body may hold, whatever the limits below it."""


def json_value_limit(config) -> int:
    """Most JSON values (and keys) a request body may hold: room for the largest request the
    limits allow (`max_items_per_request` videos of `max_video_frames` frames; a chat prompt of
    `llm.max_prompt_tokens`), at least `MIN_JSON_VALUES`."""
    limits = config.limits
    encode = limits.max_items_per_request * (limits.max_video_frames + 8) + 64
    chat = 4 * config.llm.max_prompt_tokens if config.llm is not None else 0
    return max(MIN_JSON_VALUES, encode, chat)


def too_many_values(prefix: bytes, limit: int) -> RequestError:
    """The refusal of a body of more than `limit` values, given its part up to the first value
    past it: 413 naming its largest list or object where that one holds most of them; 400 where
    even that part is not JSON."""
    try:
        largest = largest_container(prefix)
    except ValueError as error:
        return RequestError(400, f"body is not valid JSON: {error}")
    what = f"request body of more than {limit} JSON values, more than a request within the limits holds "
    what += f"(max_items_per_request videos of max_video_frames frames, at least {MIN_JSON_VALUES})"
    if largest is None or largest[1] < limit // 2:
        return RequestError(413, what)
    path, entries = largest
    where = json_path(path) or "body"
    return RequestError(413, f"{where}: more than {entries} entries, in a {what}", error_param(path))


def _is_json(scope) -> bool:
    """Whether the framework parses this request's body as JSON (its Content-Type says so)."""
    content_type = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
    return content_type == b"application/json" or (
        content_type.startswith(b"application/") and content_type.endswith(b"+json")
    )


class _Client:
    """One request's client messages, where a client that left is an `http.disconnect`, counted
    once (as 499) and repeated on every later call. Serve's proxy reports it by raising
    `TaskCancelledError` instead, after which its `receive` would wait forever."""

    DISCONNECT = {"type": "http.disconnect"}

    def __init__(self, receive, router):
        self._receive, self._router = receive, router
        self.gone = False

    async def receive(self) -> dict:
        if self.gone:
            return self.DISCONNECT
        try:
            message = await self._receive()
        except TaskCancelledError:
            message = self.DISCONNECT
        if message["type"] == "http.disconnect":
            self.gone = True
            self._router.count_rejection(499)
        return message


async def _refuse(router, send, error: RequestError) -> None:
    router.count_rejection(error.status)
    await JSONResponse(error.body(), status_code=error.status)({"type": "http"}, None, send)


def create_api() -> FastAPI:
    api = FastAPI(
        title="VLM vision-encoder service",
        description="Encodes images and videos with a VLM's vision tower; packs requests into CUDA-graph budgets.",
        responses=ERRORS,
    )
    api.add_middleware(BodyLimit)
    api.add_exception_handler(RequestError, _request_error)
    api.add_exception_handler(RequestValidationError, _validation_error)
    api.add_exception_handler(HTTPException, _http_error)
    api.add_exception_handler(Exception, _unexpected_error)
    framework_openapi = api.openapi

    def openapi() -> dict:
        """FastAPI's schema, with the lengths of the lists the app's limits bound (once it serves)."""
        schema = framework_openapi()
        router = getattr(api.state, "router", None)
        if router is not None:
            with_limits(schema, router.config.limits)  # on FastAPI's cached schema: the same each time
        return schema

    api.openapi = openapi
    return api


def with_limits(schema: dict, limits) -> None:
    """Set `maxItems` of an encode request's items and a video's frames to the app's limits."""
    components = schema.get("components", {}).get("schemas", {})
    if "EncodeRequest" in components:
        components["EncodeRequest"]["properties"]["items"]["maxItems"] = limits.max_items_per_request
    if "VideoItem" in components:
        frames = components["VideoItem"]["properties"]["frames"]
        for form in frames.get("anyOf", [frames]):
            if form.get("type") == "array":
                form["maxItems"] = limits.max_video_frames


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """The framework's own errors (unknown path, wrong method, unreadable body) in our shape."""
    _count(request, exc.status_code)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(
        RequestError(exc.status_code, message, error_type=kind).body(), status_code=exc.status_code, headers=exc.headers
    )


def _count(request: Request, status: int) -> None:
    router = getattr(request.app.state, "router", None)
    if router is not None:
        router.count_rejection(status)


async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
    _count(request, exc.status)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """Anything not foreseen: logged with its traceback, a 500 with the documented body."""
    logger.exception("unexpected error on %s", request.url.path, exc_info=exc)
    _count(request, 500)
    error = RequestError(500, "internal error; the details are in the service log", error_type="internal_error")
    return JSONResponse(error.body(), status_code=500)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0]
    if first.get("loc") in (("body",), ()) and isinstance(first.get("input"), bytes):  # not parsed: not JSON
        _count(request, 415)
        sent_as = request.headers.get("content-type") or "none"
        message = f"send the body as JSON, with Content-Type: application/json (got {sent_as})"
        return JSONResponse(RequestError(415, message).body(), status_code=415)
    error = request_error(errors)
    _count(request, error.status)
    return JSONResponse(error.body(), status_code=error.status)
