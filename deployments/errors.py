"""Errors that reach the client as 4xx/5xx with an OpenAI-style body naming the item and the limit."""

from __future__ import annotations

import logging


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


SERVE_REQUEST_FAILED = "Request failed."
"""The message Serve's replica logs, with the traceback, for whatever a replica method raised."""


class RefusalsInOneLine(logging.Filter):
    """Serve logs every exception a replica method raises with its traceback (echoed to the
    caller's driver too); a `RequestError` is an answer, not a fault: one line, INFO for a 4xx,
    WARNING for a 5xx. Added to the "ray.serve" logger; only Serve's own "Request failed." record
    is rewritten, never one of ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if isinstance(record.exc_info, tuple) else None
        if record.msg == SERVE_REQUEST_FAILED and isinstance(error, RequestError):
            record.levelno = logging.INFO if error.status < 500 else logging.WARNING
            record.levelname = logging.getLevelName(record.levelno)
            record.msg, record.args = "request answered %d: %s", (error.status, error.message)
            record.exc_info, record.exc_text = None, None
        return True


def log_refusals_in_one_line() -> None:
    """Install `RefusalsInOneLine` on Serve's logger once per process."""
    serve_logger = logging.getLogger("ray.serve")
    if not any(isinstance(f, RefusalsInOneLine) for f in serve_logger.filters):
        serve_logger.addFilter(RefusalsInOneLine())
