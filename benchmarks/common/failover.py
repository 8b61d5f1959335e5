"""One encoder replica killed under a closed-loop handle load: what callers see and how soon
Serve's replacement serves."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable

from benchmarks.common.clients import handle_load
from benchmarks.common.serve_log import MARKERS
from benchmarks.common.service import ServeRun


def encoder_replica_pids(app: str) -> list[int]:
    """Process ids of this host's encoder replicas of application `app`."""
    import psutil

    title = f"ServeReplica:{app}:EncoderReplica"
    return [p.pid for p in psutil.process_iter(["cmdline"]) if title in " ".join(p.info["cmdline"] or [])]


def failover(
    args, call, requests: list[list], service: ServeRun, app: str, concurrency_at: Callable[[int], int]
) -> dict:
    """One encoder replica killed (SIGKILL) a quarter into a closed-loop handle load (`args.failover`
    seconds, `concurrency_at(replicas)` callers): failed calls, tokens/s per second around the kill,
    and the seconds from the kill until Serve's replacement logs its ready line (it serves from then on)."""
    victims = encoder_replica_pids(app)
    if len(victims) < 2:
        return {"skipped": f"{len(victims)} encoder replica(s): the survivor must carry the load"}
    concurrency, ready_mark = concurrency_at(len(victims)), MARKERS["encoder_ready_s"]
    readies = service.log.read_text(errors="replace").count(ready_mark)
    killed: dict[str, float] = {}

    def kill() -> None:
        killed["at"] = time.perf_counter()
        os.kill(victims[0], signal.SIGKILL)

    timer = threading.Timer(args.failover / 4, kill)
    timer.start()
    samples = asyncio.run(handle_load(call, requests, concurrency, args.failover))
    timer.join()
    replaced = None
    while time.perf_counter() - killed["at"] < args.startup_timeout:
        if service.log.read_text(errors="replace").count(ready_mark) > readies:
            replaced = round(time.perf_counter() - killed["at"], 1)
            break
        time.sleep(0.5)
    per_second: dict[int, int] = {}
    for _, end, tokens, _, _ in samples:
        second = int((end - killed["at"]) // 1)
        per_second[second] = per_second.get(second, 0) + tokens
    # every second of the window counts, one with no call completed as 0
    before = [per_second.get(k, 0) for k in range(-int(args.failover / 4) + 1, 0)]
    after = [per_second.get(k, 0) for k in range(2, int(args.failover * 3 / 4))]
    errors: dict[str, int] = {}
    for sample in samples:
        if sample[3] != 200:
            errors[sample[3]] = errors.get(sample[3], 0) + 1
    result = {
        "concurrency": concurrency,
        "replicas_before": len(victims),
        "killed_pid": victims[0],
        "requests": len(samples),
        "failed": sum(errors.values()),
        "errors": errors,
        "tokens_per_s_before": round(statistics.mean(before)) if before else None,
        "tokens_per_s_after": round(statistics.mean(after)) if after else None,
        "replacement_ready_s": replaced,
        "tokens_per_second_from_kill": dict(sorted(per_second.items())),
    }
    print(
        f"failover: {json.dumps({k: v for k, v in result.items() if k != 'tokens_per_second_from_kill'})}", flush=True
    )
    return result
