"""A warm-up capture's result values (`warm_capture.py`): what each attempt comes to, and the
attempts `capture_graph` makes on them (CPU: a stand-in capture that runs the real forward)."""

from __future__ import annotations

import pytest
import torch

from encoder_graphs.config import GraphConfig
from encoder_graphs.parts import build_parts
from encoder_graphs.warm_capture import CaptureResult, again_after_warm_run, attempt_result, capture_graph
from models import from_preset


def a_recompile_error() -> RuntimeError:
    """What dynamo raises when a compiled function would recompile under "fail_on_recompile"."""
    torch._dynamo.reset()
    add_one = torch.compile(lambda x: x + 1, backend="eager")
    add_one(torch.zeros(3))
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            add_one(torch.zeros(3, dtype=torch.int64))
    except RuntimeError as error:
        return error
    finally:
        torch._dynamo.reset()
    raise AssertionError("dynamo recompiled under fail_on_recompile")


def test_an_attempt_that_would_recompile_needs_a_compile_where_allowed_else_keeps_the_uncompiled_forward():
    error = a_recompile_error()
    assert attempt_result(error, guarded=True, may_compile=True) is CaptureResult.NEEDS_COMPILE
    assert attempt_result(error, guarded=True, may_compile=False) is CaptureResult.RETRY_UNCOMPILED
    assert attempt_result(error, guarded=False, may_compile=True) is CaptureResult.FAILED  # not the compiled forward's


@pytest.mark.parametrize("may_compile", [True, False])
def test_an_attempt_without_error_is_captured_and_any_other_error_fails(may_compile):
    assert attempt_result(None, guarded=True, may_compile=may_compile) is CaptureResult.CAPTURED
    failed = RuntimeError("operation not permitted when stream is capturing")
    assert attempt_result(failed, guarded=True, may_compile=may_compile) is CaptureResult.FAILED
    assert attempt_result(MemoryError(), guarded=False, may_compile=may_compile) is CaptureResult.FAILED


def test_an_attempt_is_tried_again_after_a_warm_run_only_once_it_failed_unwarmed_or_dropped_the_compile():
    assert again_after_warm_run(CaptureResult.FAILED, warmed=False)
    assert not again_after_warm_run(CaptureResult.FAILED, warmed=True)
    assert again_after_warm_run(CaptureResult.RETRY_UNCOMPILED, warmed=True)
    assert not again_after_warm_run(CaptureResult.CAPTURED, warmed=False)
    assert not again_after_warm_run(CaptureResult.NEEDS_COMPILE, warmed=False)


class FailingCapture:
    """A stand-in for `GraphCapture` on CPU: its warm run and capture run the real forward; its
    first `failures` captures raise, as a lazy initialisation inside a capture does."""

    def __init__(self, failures: int, started: bool = True):
        self.failures, self.started = failures, started
        self.calls: list[str] = []

    def warm(self, run) -> None:
        self.calls.append("warm")
        run()

    def capture(self, entry, run) -> int:
        self.calls.append("capture")
        run()
        if self.failures:
            self.failures -= 1
            raise RuntimeError("operation not permitted when stream is capturing")
        return 0


@pytest.fixture(scope="module")
def encoder():
    return from_preset("qwen3-vl-tiny", seed=4)


@pytest.mark.parametrize(
    ("failures", "result", "calls"),
    [
        (0, CaptureResult.CAPTURED, ["capture"]),
        (1, CaptureResult.CAPTURED, ["capture", "warm", "capture"]),  # again after a warm run
        (2, CaptureResult.FAILED, ["capture", "warm", "capture"]),  # failed after one: disabled
    ],
)
def test_a_capture_that_fails_unwarmed_is_tried_once_more_after_a_warm_run(encoder, failures, result, calls):
    parts = build_parts(encoder, GraphConfig(budgets=(64,)))
    parts.capture = FailingCapture(failures)
    (entry,) = parts.table.entries.values()
    read = []
    assert capture_graph(parts, entry, before_warm_run=lambda: read.append(1)) is result
    assert parts.capture.calls == calls and len(read) == calls.count("warm")  # the earlier check read first
    assert entry.enabled == (result is CaptureResult.CAPTURED)


def test_the_first_capture_into_the_pool_takes_a_warm_run(encoder):
    parts = build_parts(encoder, GraphConfig(budgets=(64,)))
    parts.capture = FailingCapture(0, started=False)
    (entry,) = parts.table.entries.values()
    assert capture_graph(parts, entry) is CaptureResult.CAPTURED and parts.capture.calls == ["warm", "capture"]
