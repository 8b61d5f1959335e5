"""Sends each pack to the encoder replica with the fewest queued tokens.

Serve's default router balances request *counts*; an encoder's load is its queued tokens
(one 4K image costs as much as sixty thumbnails). Each replica reports its queued and
in-flight tokens through `record_routing_stats`; this router also counts the tokens it
sent itself and has not seen complete, which is exact and immediate for this caller. The
load of a replica is the larger of the two (reports are periodic and cover other callers).
The same reports carry each replica's warm-up, which `replica_reports` gives `/v1/models`.
Replicas that also generate (`llm.colocate`) get each generation where the fewest are in
flight, counted the same two ways (this router's count only until the reports hold it), ties broken
at random, and never more than the slots they keep for their LLM (the others stay the packs').
"""

from __future__ import annotations

import random
import time
import weakref
from collections import defaultdict
from typing import Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

COUNT_EXPIRY_S = 600.0
"""Longer than any pack takes (requests time out after `router.request_timeout_s`, 120 s by default)."""
GENERATION_COUNT_S = 10.0
"""How long this router counts a generation it sent: until the replica's own reports (every
`ROUTING_STATS_PERIOD_S`) hold it. Serve tells a router that a stream ended only once the stream is
read to its end or collected, so a count kept until then could fill a replica's LLM slots for good."""


GENERATE_METHODS = ("generate", "generate_stream")


def is_generation(pending_request: Optional[PendingRequest]) -> bool:
    """A request for the LLM of a colocated replica, not a pack."""
    return pending_request is not None and pending_request.metadata.call_method in GENERATE_METHODS


def pack_tokens(pending_request: Optional[PendingRequest]) -> int:
    if pending_request is None or not pending_request.args:
        return 0
    return int(getattr(pending_request.args[0], "tokens", 0))


_ROUTERS: weakref.WeakSet = weakref.WeakSet()
"""This process's routers of this class (one per handle that sends to encoder replicas)."""


def replica_reports() -> dict[str, dict]:
    """Each encoder replica's last routing stats as this process's routers hold them (Serve's
    controller collects them every `request_routing_stats_period_s`), by replica id."""
    reports = {}
    for router in list(_ROUTERS):
        for replica_id, replica in list(router.curr_replicas.items()):
            reports[replica_id.unique_id] = dict(replica.routing_stats or {})
    return reports


def replica_slots() -> int | None:
    """Packs the encoder replicas take at once, summed (each one's `max_ongoing_requests`, less the
    slots a colocated replica keeps for its LLM), as this process's routers know them; None before a
    router has seen a replica."""
    replicas = {}
    for router in list(_ROUTERS):
        for replica_id, replica in list(router.curr_replicas.items()):
            replicas[replica_id] = max(1, replica.max_ongoing_requests - llm_slots(replica))
    return sum(replicas.values()) if replicas else None


def llm_slots(replica: RunningReplica) -> int:
    """Slots a colocated replica keeps for generations (`ColocatedReplica.record_routing_stats`); 0 else."""
    return int((replica.routing_stats or {}).get("llm_slots", 0))


def routed_replicas() -> set[str] | None:
    """The actor ids of the encoder replicas this process's routers send to now (a stopping replica
    leaves this set before Serve stops it); None before a router exists."""
    routers = list(_ROUTERS)
    if not routers:
        return None
    return {replica.actor_id.hex() for router in routers for replica in list(router.curr_replicas.values())}


class FewestQueuedTokensRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._sent_tokens: dict[ReplicaID, int] = defaultdict(int)
        self._by_request: dict[str, tuple[ReplicaID, int, float]] = {}
        self._generating: dict[ReplicaID, int] = defaultdict(int)
        self._generations: dict[str, tuple[ReplicaID, float]] = {}
        # Serve pickles this class by value, module globals with it: the registry `replica_reports`
        # reads is the imported module's, not this copy's.
        from deployments.router import routing

        routing._ROUTERS.add(self)

    def load(self, replica: RunningReplica) -> int:
        reported = int((replica.routing_stats or {}).get("queued_tokens", 0))
        return max(reported, self._sent_tokens[replica.replica_id])

    def generating(self, replica: RunningReplica) -> int:
        reported = int((replica.routing_stats or {}).get("generating", 0))
        return max(reported, self._generating[replica.replica_id])

    def _expire_generations(self) -> None:
        now = time.monotonic()
        for stale in [r for r, (_, at) in self._generations.items() if now - at > GENERATION_COUNT_S]:
            self._end_generation(stale)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> list[list[RunningReplica]]:
        context = getattr(pending_request, "routing_context", None)
        if context is not None:  # every pick here weighs every replica: a retry waits (Serve's backoff),
            context.should_backoff = True  # as after its locality passes, never spins (no LLM slot free)
        if is_generation(pending_request):  # only where the LLM has a slot left: the rest are the packs'
            self._expire_generations()
            # (before a replica's first report its LLM slots are unknown: Serve's own limit then)
            room = [r for r in candidate_replicas if self.generating(r) < (llm_slots(r) or r.max_ongoing_requests)]
            shuffled = random.sample(room, len(room))
            return [[r] for r in sorted(shuffled, key=lambda r: (self.generating(r), self.load(r)))]
        ranked = sorted(candidate_replicas, key=self.load)
        if ranked and pending_request is not None:
            # A pack sent with `choose_replica` / `dispatch` (the encode queue's way) never reaches
            # `on_request_routed`: its tokens count against the replica asked first, which takes
            # it unless it is full (then another does, and the count is off until the pack
            # completes; the replicas' own reports, every second, bound the error).
            self._count(pending_request, ranked[0].replica_id)
        return [[replica] for replica in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        if is_generation(pending_request):
            self._expire_generations()
            self._generations[pending_request.metadata.internal_request_id] = (replica_id, time.monotonic())
            self._generating[replica_id] += 1
            return
        self._count(pending_request, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._end_generation(internal_request_id)
        self._release(internal_request_id)

    def _end_generation(self, request_id: str) -> None:
        routed = self._generations.pop(request_id, None)
        if routed is not None:
            self._generating[routed[0]] -= 1

    def _release(self, request_id: str) -> None:
        routed = self._by_request.pop(request_id, None)
        if routed is not None:
            self._sent_tokens[routed[0]] -= routed[1]

    def _count(self, pending_request: PendingRequest, replica_id: ReplicaID) -> None:
        """The request's tokens counted against `replica_id` (moved there if counted elsewhere).
        Counts older than `COUNT_EXPIRY_S` are dropped: a pack ranked but never dispatched (its
        slot reservation failed) is never completed, and its count would steer traffic away for good."""
        request_id = pending_request.metadata.internal_request_id
        self._release(request_id)
        now = time.monotonic()
        for stale in [r for r, (_, _, at) in self._by_request.items() if now - at > COUNT_EXPIRY_S]:
            self._release(stale)
        tokens = pack_tokens(pending_request)
        self._sent_tokens[replica_id] += tokens
        self._by_request[request_id] = (replica_id, tokens, now)
