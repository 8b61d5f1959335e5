"""What the service's own counters grew by over one benchmark point: two snapshots of
`/v1/models/{id}` (one router's packs, one replica's description, and every encoder replica's
work report) and of `serve run`'s log, differenced."""

from __future__ import annotations

MERGED = ("merged_requests", "merged_packs")


def counted_between(before: dict, after: dict) -> dict:
    """What the counters grew by over one point (its warm-up included): requests per router pack
    and per forward where the same router and replica answered both snapshots, every replica's
    rates from its own reports, and Serve's slow queue-length probes logged meanwhile."""
    window = {}
    router, router_after = before.get("router_packs") or {}, after.get("router_packs") or {}
    packs = router_after.get("packs", 0) - router.get("packs", 0)
    if before.get("router_pid") == after.get("router_pid") and "requests" in router and packs > 0:
        window["router_packs"] = packs
        window["requests_per_pack"] = round((router_after["requests"] - router["requests"]) / packs, 2)
    replica, replica_after = before.get("replica") or {}, after.get("replica") or {}
    forwards = (replica_after.get("forwards") or 0) - (replica.get("forwards") or 0)
    counted = all(side.get(k) is not None for side in (replica, replica_after) for k in MERGED)
    fresh = replica.get("stale_s") is None and replica_after.get("stale_s") is None  # not a cached description
    if replica.get("pid") == replica_after.get("pid") and counted and fresh and forwards > 0:
        window["forwards"] = forwards
        window["requests_per_forward"] = round(
            (replica_after["merged_requests"] - replica["merged_requests"]) / forwards, 2
        )
        window["packs_per_forward"] = round((replica_after["merged_packs"] - replica["merged_packs"]) / forwards, 2)
        steps, earlier = replica_after.get("step_seconds") or {}, replica.get("step_seconds") or {}
        window["step_seconds"] = {k: round(v - earlier.get(k, 0.0), 3) for k, v in steps.items()}
    rates = replica_rates(before.get("replicas") or {}, after.get("replicas") or {})
    if rates:
        window["replicas"] = rates
    if "slow_queue_probes" in before and "slow_queue_probes" in after:
        window["slow_queue_probes"] = after["slow_queue_probes"] - before["slow_queue_probes"]
    return window


def replica_rates(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Each encoder replica's work between two of its reports (same process, its own clock):
    tokens/s, forwards, requests per forward, each step's share of the time and ms per forward.
    `run` near 1: the device was kept busy; `store` runs beside later forwards (it may exceed 1)."""
    rates = {}
    for replica_id, last in after.items():
        first = before.get(replica_id)
        if not first or first.get("pid") != last.get("pid"):
            continue
        try:
            rate = _rate(first, last)
        except (KeyError, TypeError):  # a report without these fields (another version's replica)
            continue
        if rate is not None:
            rates[replica_id] = rate
    return rates


def _rate(first: dict, last: dict) -> dict | None:
    span = last["at"] - first["at"]
    forwards = last["forwards"] - first["forwards"]
    if span <= 0:
        return None
    steps = {k: v - first["step_seconds"].get(k, 0.0) for k, v in last["step_seconds"].items()}
    rate = {
        "seconds": round(span, 2),
        "tokens_per_s": round((last["tokens"] - first["tokens"]) / span),
        "forwards": forwards,
        "share": {k: round(v / span, 3) for k, v in steps.items()},
    }
    if forwards > 0:
        rate["requests_per_forward"] = round((last["merged_requests"] - first["merged_requests"]) / forwards, 2)
        rate["ms_per_forward"] = {k: round(1e3 * v / forwards, 1) for k, v in steps.items()}
    return rate


def run_shares(window: dict) -> str:
    """Each replica's share of a window in `run` and, within it, in graphs' checked first packs and
    recurring packs' captures (what a replica spends until it has seen its traffic), and between a
    forward's end and the next one's start while packs waited, as ranges over the replicas (each only
    where the reports carry it); "" without per-replica rates."""
    shares = [rate["share"] for rate in ((window or {}).get("replicas") or {}).values() if "share" in rate]
    if not shares:
        return ""

    def span(step: str) -> str:
        low, high = min(s.get(step, 0.0) for s in shares), max(s.get(step, 0.0) for s in shares)
        return f"{low:.2f}" if low == high else f"{low:.2f}-{high:.2f}"

    if not any("first_pack_checks" in s for s in shares):  # reports from before these were counted
        return f"run {span('run')}"
    within = f"first-pack checks {span('first_pack_checks')}, captures {span('recurring_captures')}"
    between = f"; between forwards while packs waited {span('between')}" if any("between" in s for s in shares) else ""
    return f"run {span('run')} ({within}){between}"
