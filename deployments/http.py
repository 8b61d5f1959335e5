"""The FastAPI app of the router: error bodies, the request-size guard, rejection counting.

Serve pickles the ingress class by value, so module globals seen by its methods and by
these handlers are different copies. Everything shared therefore goes through the app
object that actually serves requests: `request.app.state.router` (set by the router).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from .errors import RequestError
from .schemas import ErrorResponse

logger = logging.getLogger("ray.serve")

ERRORS = {status: {"model": ErrorResponse} for status in (400, 404, 413, 415, 500, 503, 504)}


class BodyLimit:
    """ASGI middleware: 413 for bodies over the router's `max_request_bytes`. A declared
    Content-Length is refused before reading; otherwise (chunked) the body is read up to the
    limit and refused as soon as it passes it. The router parses the whole body anyway, so
    reading it here first holds no more than the limit."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        router = getattr(scope.get("app").state, "router", None) if scope["type"] == "http" else None
        if router is None:
            return await self.app(scope, receive, send)
        limit = router.config.limits.max_request_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await _too_large(router, send, f"request body of {int(declared)} bytes", limit)
        chunks, received, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > limit:
                return await _too_large(router, send, f"request body of more than {limit} bytes", limit)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _too_large(router, send, what: str, limit: int) -> None:
    router.count_rejection(413)
    error = RequestError(413, f"{what} exceeds max_request_bytes={limit}")
    await JSONResponse(error.body(), status_code=413)({"type": "http"}, None, send)


def create_api() -> FastAPI:
    api = FastAPI(
        title="VLM vision-encoder service",
        description="Encodes images and videos with a VLM's vision tower; packs requests into CUDA-graph budgets.",
        responses=ERRORS,
    )
    api.add_middleware(BodyLimit)
    api.add_exception_handler(RequestError, _request_error)
    api.add_exception_handler(RequestValidationError, _validation_error)
    api.add_exception_handler(Exception, _unexpected_error)
    return api


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
    _count(request, 400)
    first = exc.errors()[0]
    location = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return JSONResponse(RequestError(400, f"body is not valid JSON: {first.get('msg')}").body(), status_code=400)
    if len(location) >= 2 and location[0] == "items" and isinstance(location[1], int):
        param = f"items[{location[1]}]"
    else:
        param = ".".join(str(part) for part in location) or None
    fields = ".".join(str(part) for part in location[2:])
    message = f"{param or 'body'}{'.' + fields if fields else ''}: {first.get('msg', 'invalid')}"
    return JSONResponse(RequestError(400, message, param=param).body(), status_code=400)
