"""Errors that reach the client as 4xx/5xx with an OpenAI-style body naming the item and the limit."""

from __future__ import annotations


class RequestError(Exception):
    """A request the service refuses; `status` and `body()` go to the client as is."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        error_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param}}

    def __reduce__(self):  # survives pickling across Ray actors with all its fields
        return (type(self), (self.status, self.message, self.param, self.error_type, self.headers))


class Overloaded(Exception):
    """More work than a queue takes (queued tokens, decode jobs); the router answers 503."""


def item_error(index: int, status: int, message: str) -> RequestError:
    """An error about `items[index]`."""
    return RequestError(status, f"items[{index}]: {message}", param=f"items[{index}]")


def overloaded(message: str, retry_after_s: int, kind: type[RequestError] = RequestError) -> RequestError:
    return kind(503, message, error_type="overloaded_error", headers={"Retry-After": str(retry_after_s)})
