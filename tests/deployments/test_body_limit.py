"""The router's request-body guard as an ASGI middleware, without Ray: how a client that leaves is seen."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from ray.exceptions import TaskCancelledError

from deployments.config import AppConfig
from deployments.router.http import BodyLimit


class Router:
    """What the middleware reads of the router: its config, and where it counts refusals."""

    def __init__(self):
        self.config = AppConfig()
        self.counted: list[int] = []

    def count_rejection(self, status: int) -> None:
        self.counted.append(status)


def run(messages, listens: int) -> tuple[Router, list[dict]]:
    """The middleware in front of an app that reads the body, then listens `listens` times for a
    disconnect (as a streaming response does); `messages` are what the client side gives, an
    exception raised where it is one."""
    router = Router()
    seen: list[dict] = []

    async def app(scope, receive, send):
        seen.append(await receive())
        for _ in range(listens):
            seen.append(await receive())

    async def receive():
        message = messages.pop(0)
        if isinstance(message, BaseException):
            raise message
        return message

    scope = {"type": "http", "headers": [], "app": SimpleNamespace(state=SimpleNamespace(router=router))}
    asyncio.run(BodyLimit(app)(scope, receive, None))
    return router, seen


def test_a_client_that_leaves_while_its_response_streams_is_one_disconnect_counted_once():
    """Serve's proxy raises TaskCancelledError where ASGI has a message, and would then wait
    forever: the app sees a disconnect each time it listens, and the refusal is counted once."""
    body = {"type": "http.request", "body": b"{}", "more_body": False}
    router, seen = run([body, TaskCancelledError()], listens=3)
    assert seen == [body] + [{"type": "http.disconnect"}] * 3
    assert router.counted == [499]
    router, seen = run([body, {"type": "http.disconnect"}], listens=2)  # as uvicorn says it
    assert seen == [body] + [{"type": "http.disconnect"}] * 2 and router.counted == [499]


def test_a_client_that_leaves_mid_upload_is_counted_and_the_app_never_runs():
    part = {"type": "http.request", "body": b"{", "more_body": True}
    for gone in (TaskCancelledError(), {"type": "http.disconnect"}):
        router, seen = run([part, gone], listens=0)
        assert seen == [] and router.counted == [499]
