"""From decoded items to encoded ones: cache, in-flight dedup, packing, dispatch to encoder replicas.

An item's result is an `Encoded`: a reference to its tensors in the object store of the
encoder replica that made them. The router never holds embedding bytes on this path; the
HTTP handlers fetch what they serialize, the handle's callers fetch for themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from ..config import AppConfig
from ..decode.media import DecodedItem
from ..errors import Overloaded, RequestError, overloaded
from ..metrics import RouterMetrics
from ..wire import PackRequest, item_from_wire
from .cache import EmbeddingCache, InflightTable
from .fleet import EncoderFleet
from .routing import replica_slots, routed_replicas
from .scheduler import PackScheduler, QueuedItem, packs_in_flight

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Encoded:
    """One encoded item, held by reference."""

    ref: Any
    """`ray.ObjectRef` of the item's wire form (`wire.item_to_wire`), owned by the replica that made it."""
    nbytes: int
    replica: str
    """The encoder replica's actor id: its objects are lost if it dies."""
    queue_s: float = 0.0
    """How long its pack waited at the replica for the device (0 for a cached result)."""
    forward_s: float = 0.0
    """The forward its pack ran in (0 for a cached result)."""


def replica_failed(error: Exception) -> bool:
    """The encoder replica died or lost its GPU (retryable elsewhere), not a problem of the input."""
    unavailable = (ReplicaUnavailableError, DeploymentUnavailableError)
    if isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, *unavailable)):
        return True
    return "CUDA error" in str(error) or "CUDA out of memory" in str(error)


def _done(value) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


LIVENESS_CHECK_S = 2.0
"""How often a replica whose cached results a handle or LLM request would use is checked for death."""


DEPARTED_CHECK_S = 1.0
"""How often the router drops the cache entries of replicas it no longer routes to (`forget_departed`)."""


def replica_dead(actor_id: str) -> bool:
    """Whether Ray's control store says the actor died (unknown: False). Ray's own state API needs
    the dashboard, which a cluster may run without; this reads the control store directly."""
    try:
        from ray._private import state

        return (state.actors(actor_id=actor_id) or {}).get("State") == "DEAD"
    except Exception:  # noqa: BLE001 - unknown is not dead
        return False


class ResultsLost(RequestError):
    """Results encoded, then lost with the replica that held them before this router read them (a
    503 if the request is not encoded again)."""


class EncodeQueue:
    def __init__(
        self,
        config: AppConfig,
        ladder: tuple[int, ...],
        max_items: int,
        max_segments: int,
        encoder: DeploymentHandle,
        fleet: EncoderFleet,
        metrics: RouterMetrics,
    ):
        self.config = config
        self.encoder = encoder
        self.fleet = fleet
        self.router_id = uuid.uuid4().hex[:12]
        """Names this queue's packs to the replicas, which report its unplaced tokens per router."""
        self._unplaced_tokens = 0
        """Tokens of packs waiting for a replica slot (`choose_replica`)."""
        self._reports = itertools.count(1)
        """Sequence numbers of the unplaced-token figures this router's packs carry."""
        self.metrics = metrics
        router = config.router
        self.scheduler = PackScheduler(
            ladder,
            max_items,
            max_segments,
            self._dispatch,
            max_wait_s=router.max_wait_ms / 1e3,
            target_fill=router.target_fill,
            max_queued_tokens=router.max_queued_tokens,
            retries=router.pack_retries,
            retryable=replica_failed,
            final_error=self._pack_error,
            on_pack=self._observe_pack,
            max_inflight_packs=self.max_packs_in_flight,
        )
        self.cache = EmbeddingCache(router.cache_bytes)
        self.inflight = InflightTable()
        self._liveness_checked: dict[str, float] = {}

    def max_packs_in_flight(self) -> int:
        return packs_in_flight(
            self.fleet.running, self.config.router.packs_in_flight_per_replica, replica_slots(), self.fleet.routers
        )

    def check_room(self, tokens: int) -> None:
        """503 at once when the service cannot take `tokens` more (no replica, or the queue is full)."""
        if not self.fleet.ready:
            raise overloaded(self.fleet.why_not_ready(), self.config.router.retry_after_s)
        try:
            self.scheduler.check_room(tokens)
        except Overloaded as exc:
            raise overloaded(str(exc), self.config.router.retry_after_s) from None

    async def encode(self, decoded: list[DecodedItem], check_hits: bool = False) -> list[Encoded]:
        """Each item's result: from the cache, from an identical item in flight, or from a new pack.
        `check_hits`: the results will be read elsewhere (a handle caller, the LLM), where a lost one
        cannot be encoded again, so a hit made by a replica that has died is dropped first."""
        if check_hits:
            await self._drop_dead_hits(decoded)
        request_id = uuid.uuid4().hex
        waits, mine, new = [], [], []  # futures to await; (key, future) this request holds; items to queue
        for item in decoded:
            key = item.key
            cached = None if key is None else self.cache.get(key)
            if cached is not None:
                self.metrics.cache_hits.inc()
                waits.append(_done(replace(cached, queue_s=0.0, forward_s=0.0)))
                continue
            shared = None if key is None else self.inflight.join(key)
            if shared is not None:
                self.metrics.cache_dedup.inc()
                waits.append(shared)
                mine.append((key, shared))
                continue
            queued = QueuedItem(item.pixels, item.spec, request_id, asyncio.get_running_loop().create_future())
            if key is not None:
                self.metrics.cache_misses.inc()
                self.inflight.start(key, queued.future)
                queued.future.add_done_callback(lambda future, key=key: self._remember(key, future))
            new.append(queued)
            waits.append(queued.future)
            mine.append((key, queued.future))
        try:
            self.scheduler.submit(new)
            self.metrics.queued_tokens.set(self.scheduler.queued_tokens)
            shielded = asyncio.gather(*(asyncio.shield(future) for future in waits))
            shielded.add_done_callback(_retrieved)  # a request that left never reads it
            return await asyncio.wait_for(shielded, self.config.router.request_timeout_s)
        except Overloaded as exc:
            raise overloaded(str(exc), self.config.router.retry_after_s) from None
        except asyncio.TimeoutError:
            raise RequestError(
                504,
                f"request not done within request_timeout_s={self.config.router.request_timeout_s}",
                error_type="timeout_error",
            ) from None
        finally:
            for key, future in mine:  # nothing stays queued for a request that is gone, unless shared
                last = key is None or self.inflight.leave(key, future)
                if last and not future.done():
                    future.cancel()

    async def _drop_dead_hits(self, decoded: list[DecodedItem]) -> None:
        """Drop the cache entries of replicas that died (asked of Ray at most every
        `LIVENESS_CHECK_S` per replica), among those this request would hit."""
        now = time.monotonic()
        replicas = {entry.replica for item in decoded if item.key is not None and (entry := self.cache.peek(item.key))}
        due = [r for r in replicas if now - self._liveness_checked.get(r, -LIVENESS_CHECK_S) >= LIVENESS_CHECK_S]
        for replica in due:
            self._liveness_checked[replica] = now
        dead = await asyncio.gather(*(asyncio.to_thread(replica_dead, r) for r in due))
        for replica, gone in zip(due, dead):
            if gone:
                logger.warning("encoder replica %s died: dropping its cached results", replica)
                self.cache.forget_replica(replica)
                self._liveness_checked.pop(replica, None)

    def forget_departed(self) -> int:
        """Drop the cache entries of replicas no longer routed to; how many replicas' entries went. A
        stopping replica waits until nobody references its results (`drain.py`): this cache's
        references would keep it waiting for its whole shutdown budget."""
        routed = routed_replicas()
        if routed is None:  # no request router yet: nothing known
            return 0
        departed = self.cache.replicas() - routed
        for replica in departed:
            self.cache.forget_replica(replica)
        if departed:
            self.metrics.cache_bytes.set(self.cache.bytes)
        return len(departed)

    async def forget_departed_forever(self, period_s: float = DEPARTED_CHECK_S) -> None:
        """`forget_departed` every `period_s`, on the router's event loop (where the cache lives)."""
        while True:
            await asyncio.sleep(period_s)
            try:
                self.forget_departed()
            except Exception:  # the cache must never stop the router
                logger.exception("dropping departed replicas' cache entries failed")

    def _remember(self, key: bytes, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.cache.put(key, future.result())
            self.metrics.cache_bytes.set(self.cache.bytes)

    async def _dispatch(self, modality: str, items: list[QueuedItem]) -> list[Encoded]:
        pixels, specs = [i.pixels for i in items], [i.spec for i in items]
        requests = len({i.request_id for i in items})
        pack = PackRequest(self.scheduler.next_pack_id(), modality, pixels, specs, requests, router=self.router_id)
        start = time.perf_counter()
        try:
            result = await self._send(pack)
        except ray.exceptions.RayActorError as error:  # its objects are gone: so are its cache entries
            if getattr(error, "actor_id", None):
                self.cache.forget_replica(error.actor_id)
            raise
        self.metrics.transfer_seconds.observe(max(0.0, time.perf_counter() - start - result.queue_s - result.forward_s))
        return [
            Encoded(ref, nbytes, result.replica, result.queue_s, result.forward_s)
            for ref, nbytes in zip(result.outputs, result.item_bytes)
        ]

    async def _send(self, pack: PackRequest):
        """The pack to the replica the request router picks, as a plain actor call. `.remote()`
        answers through a streaming generator (Serve's rejection protocol), and Ray can lose the
        count of object references nested in a yield (ray-project/ray#58080): under load the
        replica freed a pack's outputs before this router had read them. A slot reserved with
        `choose_replica` is answered by an ordinary return, whose nested references Ray counts."""
        method = self.encoder.encode_pack
        self._unplaced_tokens += pack.tokens
        placed = False
        try:
            async with method.choose_replica(pack) as selection:
                self._unplaced_tokens -= pack.tokens
                placed = True
                # what this router has not placed on a replica yet: the autoscaler's share of it
                pack.router_waiting_tokens = self.scheduler.waiting_tokens + self._unplaced_tokens
                pack.router_report = next(self._reports)
                return await self._dispatched(method, selection, pack)
        finally:
            if not placed:
                self._unplaced_tokens -= pack.tokens

    @staticmethod
    async def _dispatched(method, selection, pack: PackRequest):
        """The pack to the reserved replica; withdrawn (cancelled), its response is cancelled too."""
        response = method.dispatch(selection, pack)
        try:
            return await response
        except asyncio.CancelledError:  # withdrawn: the replica drops the pack if it has not begun it
            with contextlib.suppress(Exception, asyncio.CancelledError):
                response.cancel()  # may raise what the dispatch raised meanwhile
                await response  # settled before the reservation is released
            raise

    def _observe_pack(self, items: list[QueuedItem], budget: int | None) -> None:
        tokens = sum(item.spec.output_tokens for item in items)
        self.metrics.pack_fill.observe(tokens / budget if budget else 1.0)
        self.metrics.pack_requests.observe(len({item.request_id for item in items}))
        self.metrics.queued_tokens.set(self.scheduler.queued_tokens)

    def _pack_error(self, error: Exception, retried: bool) -> Exception:
        """What a request whose pack failed gets: 503 if a replica died (after the retry), else 500.
        The details go to the log, not to the client."""
        logger.error("pack failed (retried: %s): %r", retried, error)
        if replica_failed(error) or isinstance(error, ConnectionAbortedError):
            again = " after a retry" if retried else ""
            return overloaded(f"an encoder replica failed while encoding this request{again}; retry", 1)
        return RequestError(500, "encoding failed; the error is in the service log", error_type="internal_error")

    async def fetch(self, encoded: list[Encoded]) -> list:
        """The items' tensors (`ItemOutput`s viewing the encoder replicas' object stores: read only).
        An object lost with its replica drops that replica's cache entries and fails with 503."""
        try:
            return [item_from_wire(value) for value in await asyncio.gather(*(e.ref for e in encoded))]
        except ray.exceptions.ObjectLostError as error:  # OwnerDiedError among them
            for item in encoded:
                self.cache.forget_replica(item.replica)
            logger.warning("embeddings lost with their encoder replica: %r", error)
            raise overloaded("an encoder replica failed after encoding this request; retry", 1, ResultsLost) from None

    def stats(self) -> dict:
        return {
            "packs": self.scheduler.stats.snapshot(),
            "queued_tokens": self.scheduler.queued_tokens,
            "max_packs_in_flight": self.max_packs_in_flight(),
            "cache": {
                "entries": len(self.cache),
                "bytes": self.cache.bytes,
                "max_bytes": self.cache.max_bytes,
                "hits": self.cache.hits,
                "misses": self.cache.misses,
                "inflight_dedup": self.inflight.joined,
            },
        }


def _retrieved(future: asyncio.Future) -> None:
    """Mark a future's exception as read (asyncio logs one nobody read as an error)."""
    if not future.cancelled():
        future.exception()
