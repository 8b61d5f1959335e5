"""A stopping encoder replica waits until nobody holds a reference to the results it stored.

An encoder replica owns the results it puts in its object store (Ray 2.56 removed `ray.put`'s
`_owner`, so they cannot be handed to a longer-lived process): once it exits, a caller that has
not read its result yet gets a 503 (send again). When Serve stops a replica (scale-down, a config
update), it first takes it out of routing and waits for its ongoing requests, quiesces it (late
packs are refused, and the router places them elsewhere), then calls its `__del__`; there the
replica waits until every result it stored is out of scope everywhere (read and dropped by the
caller, the router's hold of handle results expired, the routers' caches gone by this replica:
`EncodeQueue.forget_departed`), or until the deployment's `graceful_shutdown_timeout_s`, after
which Serve kills it anyway, is about to run out.

Ray's owner keeps an entry in its reference table for each object it owns while any process
holds a reference: the entries of this replica's results are what it waits on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable

import ray
from ray import serve
from ray.serve._private.constants import DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S, DEFAULT_GRACEFUL_SHUTDOWN_WAIT_LOOP_S

logger = logging.getLogger("ray.serve")

POLL_S = 0.2
"""Between two looks at the reference table while draining."""
MARGIN_S = 1.0
"""Left of Serve's shutdown budget when the drain gives up: the replica's exit itself takes some."""
PRUNE_AT = 4096
"""Ids remembered before those no longer referenced are dropped (then twice as many remain, at most)."""


def reference_table() -> set[bytes]:
    """The object ids (hex, as bytes) this process's reference table holds: its own objects that
    some process still references, and those it borrows."""
    return set(ray._private.worker.global_worker.core_worker.get_all_reference_counts())


class StoredResults:
    """The ids of the results this replica stored, to tell how many are still referenced."""

    def __init__(self):
        self._ids: set[bytes] = set()
        self._lock = threading.Lock()  # store threads add, the drain reads
        self._prune_at = PRUNE_AT

    def add(self, refs: Iterable) -> None:
        with self._lock:
            self._ids.update(ref.hex().encode() for ref in refs)
            if len(self._ids) >= self._prune_at:
                self._ids &= reference_table()
                self._prune_at = max(PRUNE_AT, 2 * len(self._ids))

    def held(self) -> int:
        """Results of this replica that some process still references (and forgets the others)."""
        with self._lock:
            self._ids &= reference_table()
            return len(self._ids)


def shutdown_budget_s() -> float:
    """How long the drain may wait: the deployment's `graceful_shutdown_timeout_s` (after which Serve
    kills the replica), less the wait loop Serve spent on ongoing requests before calling `__del__`
    and a margin. Serve's defaults where the replica context does not say."""
    config = getattr(serve.get_replica_context(), "_deployment_config", None)
    timeout_s = getattr(config, "graceful_shutdown_timeout_s", DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S)
    loop_s = getattr(config, "graceful_shutdown_wait_loop_s", DEFAULT_GRACEFUL_SHUTDOWN_WAIT_LOOP_S)
    return max(0.0, timeout_s - loop_s - MARGIN_S)


async def wait_until_read(results: StoredResults, budget_s: float) -> int:
    """Wait until none of `results` is referenced, at most `budget_s`; the number still held then
    (their readers get a 503 and send again). Logged either way."""
    start = time.monotonic()
    held = first = await asyncio.to_thread(results.held)
    if held:
        logger.info("stopping: waiting up to %.1f s for %d stored results to be read", budget_s, held)
    while held and time.monotonic() - start < budget_s:
        await asyncio.sleep(POLL_S)
        held = await asyncio.to_thread(results.held)
    waited = time.monotonic() - start
    if held:
        logger.warning(
            "stopping with %d of %d stored results unread after %.1f s (graceful_shutdown_timeout_s): "
            "their callers get a 503 and send again",
            held,
            first,
            waited,
        )
    elif first:
        logger.info("stopping: all %d stored results were read within %.1f s", first, waited)
    return held
