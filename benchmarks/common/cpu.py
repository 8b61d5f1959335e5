"""CPU seconds over a benchmark point: the Serve processes', this process's and the host's (is the
router, the caller or the host's CPU the limit?)."""

from __future__ import annotations

import os
import time

SERVE_PROCESSES = (
    "EncoderRouter",
    "decode_worker",
    "EncoderReplica",
    "PlainTower",
    "BatchedTower",
    "ProxyActor",
    "haproxy",
)
"""Serve replicas (process titles `ray::ServeReplica:<app>:<deployment>`) and the routers' decode
workers (`python -m deployments.decode.worker`) and HAProxy where it is the ingress
(`RAY_SERVE_ENABLE_HA_PROXY=1`): their CPU use is recorded."""
IN_TITLE = {"decode_worker": "deployments.decode.worker"}
"""What a process title holds where it is not the name the CPU seconds are recorded under."""


class Window:
    """The span a point's load ran, and the CPU seconds the Serve processes, this process and the
    whole host (every process: is the host's CPU the limit?) used in it."""

    def open(self) -> None:
        self.began, self.serve, self.own = time.perf_counter(), serve_cpu_seconds(), own_cpu_seconds()
        self.host = host_busy_cpu_seconds()

    def close(self) -> None:
        self.elapsed = time.perf_counter() - self.began
        self.serve_used = {k: v - self.serve.get(k, 0.0) for k, v in serve_cpu_seconds().items()}
        self.host_used = host_busy_cpu_seconds() - self.host
        self.own_used = own_cpu_seconds() - self.own


def own_cpu_seconds() -> float:
    """CPU seconds so far of this process (all its threads, Ray's included)."""
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def host_busy_cpu_seconds() -> float:
    """CPU seconds so far that this host's logical CPUs spent busy (not idle or waiting on I/O)."""
    import psutil

    times = psutil.cpu_times()._asdict()  # Linux counts guest time inside user time already
    return sum(times.get(k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))


def serve_cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this host's Serve processes, summed per deployment."""
    import psutil

    used: dict[str, float] = {}
    for process in psutil.process_iter(["cmdline", "cpu_times", "name"]):
        title = " ".join(process.info["cmdline"] or [])
        if process.pid == os.getpid() or "multiprocessing" in title:  # this benchmark and its callers
            continue
        for name in SERVE_PROCESSES:
            found = process.info["name"] == name if name == "haproxy" else IN_TITLE.get(name, name) in title
            if found and process.info["cpu_times"] is not None:
                times = process.info["cpu_times"]
                used[name] = used.get(name, 0.0) + times.user + times.system
    return used
