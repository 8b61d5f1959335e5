"""Load samples `(start, end, vision tokens, status, the service's stages in ms)` summarized: a
steady state's throughput and latency percentiles."""

from __future__ import annotations

import math
import statistics


def summarize(samples: list, warmup_s: float, seconds: float) -> dict:
    """Requests that completed within `seconds` after the first `warmup_s` (the callers keep
    sending until its end): a steady state's throughput. Counting those that *started* in it
    instead spends its first seconds on excluded requests, an undercount that grows with latency."""
    first = min(s[0] for s in samples) + warmup_s
    kept = [s for s in samples if first <= s[1] <= first + seconds]
    window = seconds
    if not kept:  # nothing completed in it (a stall): every sample, over their own span
        kept, window = samples, max(s[1] for s in samples) - min(s[0] for s in samples)
    latencies = sorted((s[1] - s[0]) * 1e3 for s in kept)
    timed = [s[4] for s in kept if len(s) > 4 and s[4]]
    names = timed[0] if timed else {}
    stages = {name: round(statistics.median(t.get(name, 0.0) for t in timed), 2) for name in names}
    return {
        "server_timing_p50_ms": stages,  # the service's own account of where a request's time went
        "requests": len(kept),
        "errors": sum(1 for s in kept if s[3] != 200),
        "tokens_per_s": round(sum(s[2] for s in kept) / window, 1),
        "p50_ms": round(statistics.median(latencies), 2),
        "p99_ms": round(percentile(latencies, 0.99), 2),
        "latencies_ms": [round(v, 2) for v in latencies],
    }


def percentile(ordered: list[float], fraction: float) -> float:
    """The value at `fraction` of sorted `ordered` (nearest rank below, as the reports always took it)."""
    return ordered[int(fraction * (len(ordered) - 1))]


def nearest_rank(ordered: list[float], fraction: float) -> float:
    """The smallest value of sorted `ordered` with at least `fraction` of them at or below it (never
    under the median, however few the values: a window may hold two requests)."""
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def windows(samples: list, schedule, window_s: float) -> list[dict]:
    """A load step's samples (times in seconds from the schedule's start) per window of `window_s`
    over the schedule: the scheduled callers (averaged over the window), requests completed in it,
    their vision tokens/s, p50/p99 latency and errors by kind (status or exception name)."""
    from benchmarks.common.schedule import mean_callers

    span, rows, start = schedule[-1][0], [], 0.0
    while start < span:
        end = min(start + window_s, span)
        done = [s for s in samples if start <= s[1] < end]
        latencies = sorted((s[1] - s[0]) * 1e3 for s in done)
        kinds = error_kinds(done)
        rows.append(
            {
                "t0_s": round(start, 3),
                "t1_s": round(end, 3),
                "callers": round(mean_callers(schedule, start, end), 1),
                "requests": len(done),
                "tokens_per_s": round(sum(s[2] for s in done) / (end - start), 1),
                "p50_ms": round(statistics.median(latencies), 2) if latencies else None,
                "p99_ms": round(nearest_rank(latencies, 0.99), 2) if latencies else None,
                "errors": sum(kinds.values()),
                "error_kinds": kinds,
            }
        )
        start = end
    return rows


def error_kinds(samples: list) -> dict[str, int]:
    """Failed samples counted by their status or exception name."""
    kinds: dict[str, int] = {}
    for sample in samples:
        if sample[3] != 200:
            kinds[str(sample[3])] = kinds.get(str(sample[3]), 0) + 1
    return kinds


def observed_at(observations: list[dict], t: float, key: str):
    """`key` of the last observation (dicts with `t_s`, seconds from the schedule's start) made at
    or before `t` that holds it; None where there is none."""
    found = None
    for observation in observations:
        if observation["t_s"] > t:
            break
        if key in observation:
            found = observation[key]
    return found
