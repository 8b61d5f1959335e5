"""What `serve run`'s log says about a starting service: the startup lines timed as they appear,
and the lines after which it will never answer (so a benchmark fails at once, not at its timeout)."""

from __future__ import annotations

import re

MARKERS = {
    "ray_started_s": "Started a local Ray instance",
    "serve_started_s": "Started Serve",
    "encoder_added_s": "to Deployment(name='EncoderReplica'",  # the controller starts its first replica
    "encoder_ready_s": "encoder replica ready",
    "graphs_live_s": "warm-up: graphs done",  # the first replica's graphs all tried (live unless refused)
    "full_speed_logged_s": "into the warm-up:",
    "service_ready_s": "service ready",
    "router_ready_s": "router ready",
}
"""Startup lines of `serve run`'s log, by the key each one's time is recorded under."""
FAILED_MARKERS = (
    "failed with exception:",  # the controller: "Deploying app 'encoder' failed with exception: ..."
    "Received unexpected error",  # `serve run` itself, before `serve.shutdown()` (which may hang)
)
"""Log lines after which `serve run` keeps running but the application will never answer."""
REPLICA_FAILED = "Exception in Replica("
"""The controller's line for a replica whose constructor (or health check) raised; Serve retries."""
REPLICA_GIVES_UP = 3
"""Constructor failures, of any replica of any deployment, after which a benchmark stops waiting.
Serve itself retries up to 3 per replica of a deployment; replicas of one config fail alike, so
three anywhere before the first answer say the start will not succeed soon."""
SLOW_PROBE = ("Failed to get queue length from Replica", "deployment='EncoderReplica'")
"""A router's line for an encoder replica that did not answer Serve's queue-length probe within
its deadline (0.1 s by default): that replica's event loop was held up. Ray prints a folded
"[repeated Nx]" line up to ~5 s after the lines it stands for: a count between two readings
may include some from before the first."""
REPEATED = re.compile(r"\[repeated (\d+)x across cluster\]")


def occurrences(text: str, markers: tuple[str, ...]) -> int:
    """How many lines holding every one of `markers` were logged: Ray folds repeats into one line
    marked "[repeated Nx across cluster]", which counts N."""
    count = 0
    for line in text.splitlines():
        if all(marker in line for marker in markers):
            repeated = REPEATED.search(line)
            count += int(repeated.group(1)) if repeated else 1
    return count


def startup_lines(text: str) -> set[str]:
    """The keys of `MARKERS` whose lines `text` (the log so far) holds."""
    return {key for key, marker in MARKERS.items() if marker in text}


def startup_failure(text: str, answered: bool) -> str | None:
    """Why the service in `text` (the log so far) will not start, or None. Replica failures count
    only before the service first `answered`: after it, one is a failover (a killed replica)."""
    failed = next((marker for marker in FAILED_MARKERS if marker in text), None)
    if failed is None and not answered and text.count(REPLICA_FAILED) >= REPLICA_GIVES_UP:
        return f"{REPLICA_FAILED!r} {REPLICA_GIVES_UP} times"
    return failed


def ray_address(text: str) -> str | None:
    """The cluster address `serve run` prints for drivers that attach (`RAY_ADDRESS=... python`)."""
    found = re.search(r"RAY_ADDRESS=(\S+) python", text)
    return found.group(1) if found else None
