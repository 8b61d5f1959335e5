"""Load samples `(start, end, vision tokens, status, the service's stages in ms)` summarized: a
steady state's throughput and latency percentiles."""

from __future__ import annotations

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
