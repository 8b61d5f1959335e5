"""One warm-up graph's capture under the device lock (`capture_graph`), steered by what each attempt
returns (`CaptureResult`), never by exceptions.

PyTorch asks for a warm run on a side stream before a capture, so that lazy initialisation never
happens inside one; here only the first capture into the pool and a capture tried again take one
(after the first, one per graph cost as much as the capture itself). A capture that fails without
one is tried once more after one; the check after every capture (on the record: its first real
pack's) catches a graph that went wrong. Under the lock the compiled forward must not compile:
where it would, the caller compiles outside the lock and comes back, or the graph keeps the
uncompiled forward."""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Callable

import torch

from .entry import GraphEntry
from .execute import would_compile
from .parts import RunnerParts

logger = logging.getLogger(__name__)

ATTEMPTS = 3
"""At most one retry each: with the uncompiled forward, after a warm run."""


class CaptureResult(enum.Enum):
    """What one capture attempt, or a graph's whole capture, came to."""

    CAPTURED = "captured"
    NEEDS_COMPILE = "needs compile"
    """The compiled forward would compile on the layout: the caller compiles it outside the lock and comes back."""
    RETRY_UNCOMPILED = "retry uncompiled"
    """It would compile and may not here: the graph keeps the uncompiled forward, captured again after a warm run."""
    FAILED = "failed"


def attempt_result(error: BaseException | None, guarded: bool, may_compile: bool) -> CaptureResult:
    """What an attempt that raised `error` (None: none) came to. `guarded`: the compiled forward ran
    under dynamo's "fail_on_recompile" stance; `may_compile`: the caller may compile and come back."""
    if error is None:
        return CaptureResult.CAPTURED
    if guarded and would_compile(error):
        return CaptureResult.NEEDS_COMPILE if may_compile else CaptureResult.RETRY_UNCOMPILED
    return CaptureResult.FAILED


def again_after_warm_run(result: CaptureResult, warmed: bool) -> bool:
    """Whether an attempt that came to `result` is tried once more, after a warm run: one that kept
    the uncompiled forward, or one that failed without a warm run."""
    return result is CaptureResult.RETRY_UNCOMPILED or (result is CaptureResult.FAILED and not warmed)


def capture_graph(
    parts: RunnerParts,
    entry: GraphEntry,
    may_compile: bool = False,
    before_warm_run: Callable[[], object] | None = None,
) -> CaptureResult:
    """Capture `entry`'s graph (picking kernels as for a graph) into the shared pool; the caller
    holds the device lock. CAPTURED, NEEDS_COMPILE (only where `may_compile`), or FAILED (the graph
    is disabled). A warm run writes the shared outputs: `before_warm_run` reads what must be read
    first (the previous graph's checked run)."""
    io, capture = parts.io, parts.capture
    io.fill_empty(entry)
    warm = not capture.started
    for _ in range(ATTEMPTS):
        if warm and before_warm_run is not None:  # its check (and retiming) fills the shared buffers
            before_warm_run()
            io.fill_empty(entry)
        guarded = parts.forwards.compiled is not None and entry.forward is None
        error = None
        try:
            with parts.encoder.capturing(), _no_recompile(guarded):
                if warm:
                    capture.warm(lambda: io.forward_into(entry))
                parts.memory.graph_bytes[entry.key] = capture.capture(entry, lambda: io.forward_into(entry))
        except Exception as exc:  # noqa: BLE001 - classified below; one graph lost at worst
            error = exc
        result = attempt_result(error, guarded, may_compile)
        if result in (CaptureResult.CAPTURED, CaptureResult.NEEDS_COMPILE):
            return result
        if result is CaptureResult.RETRY_UNCOMPILED:
            parts.stats.recompile_fallbacks += 1
            logger.warning("graph %s would recompile under the device lock; it keeps the uncompiled forward", entry.key)
            entry.forward = parts.forwards.plain
        elif again_after_warm_run(result, warm):
            logger.warning("capturing graph %s failed without a warm run (%r): again after one", entry.key, error)
        else:  # one graph lost; the packs it would serve run elsewhere
            logger.error("capturing graph %s failed", entry.key, exc_info=error)
            parts.table.disable(entry, f"capture failed: {type(error).__name__}")
            return CaptureResult.FAILED
        warm = True
    parts.table.disable(entry, "capture failed")
    return CaptureResult.FAILED


def _no_recompile(guarded: bool) -> contextlib.AbstractContextManager:
    """Dynamo's "fail_on_recompile" stance where the compiled forward runs (`guarded`)."""
    return torch.compiler.set_stance("fail_on_recompile") if guarded else contextlib.nullcontext()
