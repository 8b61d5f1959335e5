"""The router's pack scheduler: queues items per modality and sends packs when they close.

A pack closes when it fills `target_fill` of the largest budget, when it cannot take more
items (items or segments per pack), when its oldest item has waited `max_wait_s`, or at once
when none of this router's packs is in flight (work-conserving: a lone request does not wait
`max_wait_s`; under load packs are in flight, and items wait and join fuller packs).
Packs are formed oldest first (`encoder_graphs.packing`), so no item starves. Items whose
request went away (cancelled future) are dropped before their pack is sent. Queued plus
in-flight tokens are bounded: `submit` refuses work above `max_queued_tokens`.
No Ray here: `dispatch` is any coroutine function that encodes one pack.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import torch

from encoder_graphs.packing import PackItem, pack_items
from models.protocol import ItemOutput, ItemSpec

from ..errors import Overloaded  # its home is light: the decode pool raises it too

logger = logging.getLogger("ray.serve")


@dataclass(eq=False)
class QueuedItem:
    """One item waiting for a pack; its future gets the item's output."""

    pixels: torch.Tensor
    spec: ItemSpec
    request_id: str
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.monotonic)


@dataclass
class PackStats:
    """What the scheduler has sent so far."""

    packs: int = 0
    items: int = 0
    requests: int = 0
    """Sum over packs of the distinct requests in each pack."""
    tokens: int = 0
    budget_tokens: int = 0
    dropped_cancelled: int = 0
    abandoned_packs: int = 0
    """Packs withdrawn once handed to dispatch (waiting for a replica slot, sent, or already
    computing there): every request with items in them went away."""
    failed_packs: int = 0
    retried_packs: int = 0
    """Packs resent after their encoder replica died."""
    split_packs: int = 0
    """Failed packs rerun item by item, so a failing item fails only its own request."""
    max_requests_in_a_pack: int = 0
    held_for_room: int = 0
    """Times a closed pack waited because every encoder slot was taken (it grows meanwhile)."""

    def record(self, items: Sequence[QueuedItem], budget: int | None) -> None:
        requests = len({item.request_id for item in items})
        self.packs += 1
        self.items += len(items)
        self.requests += requests
        self.max_requests_in_a_pack = max(self.max_requests_in_a_pack, requests)
        tokens = sum(item.spec.output_tokens for item in items)
        self.tokens += tokens
        self.budget_tokens += budget or tokens

    def snapshot(self) -> dict:
        return {
            "packs": self.packs,
            "items": self.items,
            "requests": self.requests,
            "mean_items_per_pack": round(self.items / self.packs, 3) if self.packs else 0.0,
            "mean_requests_per_pack": round(self.requests / self.packs, 3) if self.packs else 0.0,
            "max_requests_in_a_pack": self.max_requests_in_a_pack,
            "mean_fill": round(self.tokens / self.budget_tokens, 4) if self.budget_tokens else 0.0,
            "dropped_cancelled": self.dropped_cancelled,
            "abandoned_packs": self.abandoned_packs,
            "failed_packs": self.failed_packs,
            "retried_packs": self.retried_packs,
            "split_packs": self.split_packs,
            "held_for_room": self.held_for_room,
        }


Dispatch = Callable[[str, list[QueuedItem]], Awaitable[list[ItemOutput]]]


def never_retry(error: Exception) -> bool:
    return False


def _detached_task(coroutine) -> asyncio.Task:
    """A task that does not inherit the submitting request's context: packs carry items of many
    requests, so they must not carry one request's Serve metadata (its request id, its
    cancellation when that client leaves)."""
    loop = asyncio.get_running_loop()
    return contextvars.Context().run(loop.create_task, coroutine)


def _withdraw_if_unwanted(dispatch: asyncio.Future, items: list[QueuedItem], _done: asyncio.Future) -> None:
    """Withdraw a sent pack once none of its items is awaited (their requests gone): the encoder
    replica drops it if it has not started it, instead of spending a forward on nobody."""
    if not dispatch.done() and all(item.future.done() for item in items):
        # Next round, not now: a dispatch task cancelled before its first step would skip the
        # code that gives back the replica slot it reserved.
        asyncio.get_running_loop().call_soon(dispatch.cancel)


def packs_in_flight(running: int, per_replica: int, slots: int | None, routers: int) -> int:
    """Packs one router keeps in flight: `per_replica` for each running encoder replica, but no more
    than its share of the replicas' slots (`slots`: their `max_ongoing_requests`, summed) among
    `routers` routers. Beyond the slots a replica refuses the pack and Serve retries it with
    backoff, where later requests cannot join it; below, it waits here, where they can. At least 1."""
    wanted = max(1, running) * per_replica
    if slots is None:
        return wanted
    return max(1, min(wanted, slots // max(1, routers)))


class PackScheduler:
    def __init__(
        self,
        ladder: Sequence[int],
        max_items: int,
        max_segments: int,
        dispatch: Dispatch,
        max_wait_s: float,
        target_fill: float,
        max_queued_tokens: int,
        retries: int = 0,
        retryable: Callable[[Exception], bool] = never_retry,
        final_error: Callable[[Exception, bool], Exception] = lambda error, retried: error,
        on_pack: Callable[[list[QueuedItem], int | None], None] | None = None,
        max_inflight_packs: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`clock`: the clock `max_wait_s` is counted on, the one items' `enqueued_at` is read on
        (`QueuedItem`'s default: time.monotonic); a test passes its event loop's virtual clock."""
        self.ladder = tuple(ladder)
        self.max_items = max_items
        self.max_segments = max_segments
        self.max_wait_s = max_wait_s
        self.target_fill = target_fill
        self.max_queued_tokens = max_queued_tokens
        self._dispatch = dispatch
        self.retries = retries
        self._retryable = retryable
        self._final_error = final_error
        self._on_pack = on_pack
        self._max_inflight = max_inflight_packs
        self._clock = clock
        self._queue: list[QueuedItem] = []
        self._wake = asyncio.Event()
        self._inflight_tokens = 0
        self._tasks: set[asyncio.Task] = set()
        self._ids = itertools.count()
        self.stats = PackStats()
        self._loop_task: asyncio.Task | None = None

    @property
    def queued_tokens(self) -> int:
        return self.waiting_tokens + self._inflight_tokens

    @property
    def waiting_tokens(self) -> int:
        """Tokens queued here, not yet handed to dispatch."""
        return sum(item.spec.output_tokens for item in self._queue)

    def check_room(self, tokens: int) -> None:
        """Raise Overloaded if `tokens` more would exceed the bound."""
        if self.queued_tokens + tokens > self.max_queued_tokens:
            raise Overloaded(
                f"{self.queued_tokens} tokens are queued or in flight; {tokens} more would exceed "
                f"max_queued_tokens={self.max_queued_tokens}"
            )

    def submit(self, items: Sequence[QueuedItem]) -> None:
        """Queue a request's items (all or none)."""
        self.check_room(sum(item.spec.output_tokens for item in items))
        self._queue.extend(items)
        self._ensure_running()
        self._wake.set()

    def _ensure_running(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = _detached_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                timeout = self._send_closed_packs()
            except Exception:  # never let the loop die silently with items queued
                logger.exception("pack scheduler iteration failed")
                timeout = 0.1
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _send_closed_packs(self) -> float | None:
        """Send every closed pack; return seconds until the next pack closes by waiting (None: idle)."""
        live = [item for item in self._queue if not item.future.done()]
        self.stats.dropped_cancelled += len(self._queue) - len(live)
        self._queue = live
        if not live:
            return None
        by_key = {id(item): item for item in live}
        queue = [PackItem(id(i), i.spec.modality, i.spec.output_tokens, i.spec.segments) for i in live]
        now = self._clock()
        next_deadline = None
        sent: set[int] = set()
        for pack in pack_items(queue, self.ladder, self.max_items, self.max_segments):
            items = [by_key[p.key] for p in pack.items]
            deadline = min(item.enqueued_at for item in items) + self.max_wait_s
            idle = not self._tasks  # nothing of ours in flight: waiting would only leave the encoder idle
            if not (self._closed(pack, items) or deadline <= now or idle):
                next_deadline = deadline if next_deadline is None else min(next_deadline, deadline)
            elif self._has_room():
                sent.update(id(item) for item in items)
                self._send(pack.modality, items, pack.token_budget)
            else:  # every replica slot is taken: items wait here, where later ones join their packs
                self.stats.held_for_room += 1
                next_deadline = None
                break
        self._queue = [item for item in live if id(item) not in sent]
        return None if next_deadline is None else max(0.0, next_deadline - now)

    def _has_room(self) -> bool:
        return self._max_inflight is None or len(self._tasks) < self._max_inflight()

    def _closed(self, pack, items: list[QueuedItem]) -> bool:
        segments = sum(item.spec.segments for item in items)
        return (
            pack.token_budget is None
            or pack.tokens >= self.target_fill * self.ladder[-1]
            or len(items) >= self.max_items
            or segments >= self.max_segments
        )

    def _send(self, modality: str, items: list[QueuedItem], budget: int | None) -> None:
        self.stats.record(items, budget)
        if self._on_pack is not None:
            self._on_pack(items, budget)
        tokens = sum(item.spec.output_tokens for item in items)
        self._inflight_tokens += tokens
        task = _detached_task(self._deliver(modality, items, tokens))
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._wake.set()  # a slot is free: held packs may go

    async def _deliver(self, modality: str, items: list[QueuedItem], tokens: int) -> None:
        try:
            await self._attempt(modality, items, retries_left=self.retries)
        finally:
            self._inflight_tokens -= tokens

    async def _attempt(self, modality: str, items: list[QueuedItem], retries_left: int) -> None:
        """Run a pack; resend it if its replica died; if it failed otherwise, run its halves one
        after the other (recursively), so that a failing item fails only its own request and the
        pack's slot never holds more than one pack in flight."""
        live = [item for item in items if not item.future.done()]
        if not live:
            return
        dispatch = asyncio.ensure_future(self._dispatch(modality, live))
        watch = functools.partial(_withdraw_if_unwanted, dispatch, live)
        for item in live:
            item.future.add_done_callback(watch)
        try:
            try:
                outputs = await dispatch
            finally:
                for item in live:
                    item.future.remove_done_callback(watch)
        except asyncio.CancelledError:
            if all(item.future.done() for item in live):  # every requester left: withdrawn
                self.stats.abandoned_packs += 1
                return
            for item in live:  # nobody may wait forever on a pack that was cancelled under it
                if not item.future.done():
                    item.future.set_exception(self._final_error(ConnectionAbortedError("pack cancelled"), False))
            raise
        except Exception as error:
            self.stats.failed_packs += 1
            if self._retryable(error) and retries_left > 0:
                self.stats.retried_packs += 1
                logger.warning("pack of %d items failed (%r); resending", len(live), error)
                return await self._attempt(modality, live, retries_left - 1)
            if len(live) > 1 and not self._retryable(error):
                self.stats.split_packs += 1
                half = len(live) // 2
                await self._attempt(modality, live[:half], retries_left)
                await self._attempt(modality, live[half:], retries_left)
                return
            final = self._final_error(error, self.retries > retries_left)
            for item in live:
                if not item.future.done():
                    item.future.set_exception(final)
            return
        for item, output in zip(live, outputs):
            if not item.future.done():
                item.future.set_result(output)

    def next_pack_id(self) -> int:
        return next(self._ids)
