"""The encoder request router's load accounting (no cluster: its methods on stand-in replicas)."""

import asyncio
from types import SimpleNamespace

from deployments.router import routing
from deployments.router.routing import FewestQueuedTokensRouter, replica_slots


def router() -> FewestQueuedTokensRouter:
    made = object.__new__(FewestQueuedTokensRouter)  # Serve builds it with its own arguments
    made.initialize_state()
    return made


def replica(name: str, reported: int = 0, slots: int = 8, **stats):
    return SimpleNamespace(
        replica_id=name, max_ongoing_requests=slots, routing_stats={"queued_tokens": reported, **stats}
    )


def pack(request_id: str, tokens: int):
    return SimpleNamespace(
        args=[SimpleNamespace(tokens=tokens)],
        metadata=SimpleNamespace(internal_request_id=request_id, call_method="encode_pack"),
    )


def generation(request_id: str, method: str = "generate"):
    return SimpleNamespace(
        args=[SimpleNamespace()], metadata=SimpleNamespace(internal_request_id=request_id, call_method=method)
    )


def test_packs_sent_with_choose_replica_count_against_the_replica_asked_first_until_done():
    """`choose_replica` / `dispatch` never calls `on_request_routed`: the ranking itself counts a
    pack's tokens, so the next pack goes to the other replica before any report arrives."""
    chooser, a, b = router(), replica("a"), replica("b")
    first = asyncio.run(chooser.choose_replicas([a, b], pack("p1", 4000)))[0][0]
    second = asyncio.run(chooser.choose_replicas([a, b], pack("p2", 1000)))[0][0]
    assert {first.replica_id, second.replica_id} == {"a", "b"}
    assert chooser.load(first) == 4000 and chooser.load(second) == 1000
    asyncio.run(chooser.choose_replicas([a, b], pack("p2", 1000)))  # ranked again (first choice was full)
    assert chooser.load(second) == 1000  # moved or kept, never counted twice
    chooser.on_request_completed(first.replica_id, "p1")
    chooser.on_request_completed(second.replica_id, "p2")
    assert chooser.load(a) == chooser.load(b) == 0


def test_a_replicas_own_report_wins_when_larger():
    chooser = router()
    busy, idle = replica("busy", reported=50_000), replica("idle")
    assert asyncio.run(chooser.choose_replicas([busy, idle], pack("p", 10)))[0][0] is idle


def test_a_count_never_completed_expires(monkeypatch):
    """A pack ranked whose slot reservation then failed is never completed: its count goes after
    `COUNT_EXPIRY_S` instead of steering traffic away from the replica for good."""
    import deployments.router.routing as routing

    chooser, a, b = router(), replica("a"), replica("b")
    asyncio.run(chooser.choose_replicas([a, b], pack("lost", 4000)))
    assert chooser.load(a) == 4000
    later = routing.time.monotonic() + routing.COUNT_EXPIRY_S + 1
    monkeypatch.setattr(routing.time, "monotonic", lambda: later)
    asyncio.run(chooser.choose_replicas([a, b], pack("next", 10)))
    assert chooser.load(a) + chooser.load(b) == 10


def test_an_unavailable_replica_or_deployment_is_retried_elsewhere_not_blamed_on_the_input():
    """`choose_replica` / `dispatch` raise Serve's own errors when a replica went away between
    the pick and the send, or the deployment has none: the pack is resent, then 503."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    from deployments.router.encode_queue import replica_failed

    assert replica_failed(ReplicaUnavailableError("r1"))
    assert replica_failed(DeploymentUnavailableError(DeploymentID(name="EncoderReplica", app_name="encoder")))
    assert not replica_failed(ValueError("the pack's pixels make 10 patches, its specs say 12"))


def test_replica_slots_sum_each_replica_once_over_this_processs_routers(monkeypatch):
    """The encoder replicas' `max_ongoing_requests`, summed over the replicas the process's
    request routers know (one replica known to two routers counts once); None before any."""
    monkeypatch.setattr(routing, "_ROUTERS", set())
    assert replica_slots() is None
    first, second = router(), router()
    first._replicas = {"a": replica("a", slots=8), "b": replica("b", slots=4)}  # Serve keeps `curr_replicas` there
    second._replicas = {"b": replica("b", slots=4)}
    routing._ROUTERS.update({first, second})
    assert replica_slots() == 12
    second._replicas["c"] = replica("c", slots=72, llm_slots=64)  # colocated: 64 of its slots are its LLM's
    assert replica_slots() == 20


def test_generations_of_colocated_replicas_go_where_fewest_are_in_flight():
    """`llm.colocate`: generations spread by those in flight (this router's and the replicas' reports),
    ties at random, and leave the pack token counts alone."""
    chooser, a, b = router(), replica("a", slots=72, llm_slots=64), replica("b", slots=72, llm_slots=64)
    firsts = set()
    for i in range(40):  # nothing in flight: a tie, broken at random
        firsts.add(asyncio.run(chooser.choose_replicas([a, b], generation(f"tie{i}")))[0][0].replica_id)
    assert firsts == {"a", "b"}
    chosen = []
    for i, method in enumerate(["generate", "generate_stream", "generate", "generate_stream"]):
        request = generation(f"g{i}", method)
        target = asyncio.run(chooser.choose_replicas([a, b], request))[0][0]
        chooser.on_request_routed(request, target.replica_id, None)
        chosen.append(target.replica_id)
    assert sorted(chosen) == ["a", "a", "b", "b"]  # each went where fewer were in flight
    assert chooser.load(a) == chooser.load(b) == 0  # generations hold no pack tokens
    busy = replica("busy", slots=72, llm_slots=64, generating=30)
    assert asyncio.run(chooser.choose_replicas([busy, a], generation("next")))[0][0] is a  # reports count too
    full = replica("full", slots=72, llm_slots=64, generating=64)  # its LLM's slots taken: the rest are packs'
    assert asyncio.run(chooser.choose_replicas([full], generation("later"))) == []
    for i, replica_id in enumerate(chosen):
        chooser.on_request_completed(replica_id, f"g{i}")
    assert chooser.generating(a) == chooser.generating(b) == 0


def test_a_generation_whose_end_serve_never_reports_stops_counting(monkeypatch):
    """Serve reports a stream's end only once it is read to the end or collected: this router's own
    count of a generation lasts `GENERATION_COUNT_S` (the replicas' reports hold it by then), and
    expires when the next generation is placed, so a replica whose LLM slots it filled gets one again."""
    chooser, a = router(), replica("a", slots=20, llm_slots=2)
    for i in range(2):
        request = generation(f"abandoned{i}", "generate_stream")
        chooser.on_request_routed(request, asyncio.run(chooser.choose_replicas([a], request))[0][0].replica_id, None)
    assert asyncio.run(chooser.choose_replicas([a], generation("next"))) == []  # counted full, none completed
    later = routing.time.monotonic() + routing.GENERATION_COUNT_S + 1
    monkeypatch.setattr(routing.time, "monotonic", lambda: later)
    assert asyncio.run(chooser.choose_replicas([a], generation("next")))[0][0] is a
    assert chooser.generating(a) == 0


def test_a_request_no_replica_can_take_now_waits_with_backoff_not_spinning():
    """Serve retries a pick at once, without its backoff, unless the router says it weighed every
    replica; this one always does, so a generation that finds every LLM slot taken waits between tries
    instead of spinning the router's event loop (which then could not read the streams that free them)."""
    full = replica("full", slots=72, llm_slots=64, generating=64)
    request = generation("waiting")
    request.routing_context = SimpleNamespace(should_backoff=False)
    assert asyncio.run(router().choose_replicas([full], request)) == []
    assert request.routing_context.should_backoff
