"""A load step: the service started as a user starts it, then a schedule of closed-loop callers
(e.g. 0 -> N -> 0) through one interface at a time, with Serve's replicas by state and each
encoder replica's warm-up observed throughout; per window: load, vision tokens/s, p50/p99, errors,
replicas. One `<out>/load_step_<interface>.json` and `.png` per interface."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from benchmarks.common.clients import ClientPool, handle_setup, http_setup
from benchmarks.common.plots import plot_load_step
from benchmarks.common.record import Record
from benchmarks.common.schedule import Schedule
from benchmarks.common.service import start_service
from benchmarks.common.stats import error_kinds, observed_at, windows
from benchmarks.common.workload import http_body

WARMUP_KEYS = ("stage", "graphs_live", "graphs_total", "full_speed", "from_record", "stage_seconds")
"""What each window keeps of a replica's warm-up report."""
START_DELAY_S = 2.0
"""Between handing the clients the schedule and its time 0 (the first observation comes before)."""


def replica_states(replica_states: dict) -> dict[str, int]:
    """Serve's replica counts keyed by state name (its keys are enum members)."""
    return {str(getattr(k, "value", k)).rsplit(".", 1)[-1]: v for k, v in replica_states.items() if v}


class ServiceWatch:
    """Observes the service every `every_s` on a thread: the encoder deployment's replicas by state
    and status from `serve.status()` (Serve's public API), and every encoder replica's warm-up
    from the router's operator `detail()` through the handle. Times: seconds from `zero` (wall clock)."""

    def __init__(self, handle, app: str, every_s: float, deployment: str = "EncoderReplica"):
        self.handle, self.app, self.every_s, self.deployment = handle, app, every_s, deployment
        self.observations: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, zero: float) -> None:
        self.zero = zero
        self._thread.start()

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(60)
        return self.observations

    def _run(self) -> None:
        while True:
            began = time.monotonic()
            self.observations.append(self.observe())
            if self._stop.wait(max(0.0, self.every_s - (time.monotonic() - began))):
                return

    def observe(self) -> dict:
        from ray import serve

        observation: dict = {"t_s": round(time.time() - self.zero, 2)}
        try:
            deployment = serve.status().applications[self.app].deployments[self.deployment]
            observation["replicas"] = replica_states(deployment.replica_states)
            observation["status"] = str(getattr(deployment.status, "value", deployment.status))
        except Exception as error:  # noqa: BLE001 - a missed observation, not the end of the run
            observation["serve_error"] = repr(error)
        try:
            detail = self.handle.detail.remote().result(timeout_s=max(5.0, self.every_s))["encoder"]
            observation["warmup"] = {
                rid: {k: w.get(k) for k in WARMUP_KEYS} for rid, w in sorted(detail.get("replica_warmup", {}).items())
            }
        except Exception as error:  # noqa: BLE001
            observation["detail_error"] = repr(error)
        observation["t_end_s"] = round(time.time() - self.zero, 2)
        return observation


def load_step_rows(samples: list, schedule: Schedule, window_s: float, observations: list[dict]) -> list[dict]:
    """Each window's load, throughput, latency and errors, with Serve's replicas by state and the
    replicas' warm-up as last observed by the window's end."""
    rows = windows(samples, schedule, window_s)
    for row in rows:
        row["replicas"] = observed_at(observations, row["t1_s"], "replicas")
        row["deployment_status"] = observed_at(observations, row["t1_s"], "status")
        warmup = observed_at(observations, row["t1_s"], "warmup") or {}
        row["full_speed_replicas"] = sum(1 for w in warmup.values() if w.get("full_speed"))
        shown = ("stage", "graphs_live", "graphs_total")
        row["warmup"] = {rid: {k: w.get(k) for k in shown} for rid, w in warmup.items()}
    return rows


def run_load_step(args, schedule: Schedule, requests: list[list]) -> list[Path]:
    """Start `args.config` with `serve run`, run the schedule through each of `args.interfaces` in
    turn (the same service: a schedule should end with enough time at its last load for Serve to
    scale back), save and plot each; returns the files written."""
    import ray
    from ray import serve

    service, startup = start_service(args, args.config, args.out, "cold", None)
    written = []
    try:
        ray.init(address=service.address, log_to_driver=False)
        handle = serve.get_app_handle(startup["app"])
        for interface in args.interfaces.split(","):
            pool = _pool(args, interface, service.address, startup, requests)
            try:
                written += _run_interface(args, schedule, interface, pool, handle, startup)
            finally:
                pool.close()
    finally:
        ray.shutdown()
        service.stop()
    return written


def _pool(args, interface: str, address: str, startup: dict, requests: list[list]) -> ClientPool:
    if interface == "handle":
        setup = (handle_setup, (address, startup["app"], requests), args.handle_processes)
    elif interface in ("safetensors", "json"):
        fmt = "safetensors" if interface == "safetensors" else "base64"
        bodies = [http_body(r, fmt, True) for r in requests]
        setup = (http_setup, (startup["url"] + "/v1/encode", bodies, fmt), args.http_processes)
    else:
        raise ValueError(f"interface {interface!r}: handle, safetensors or json")
    function, static, processes = setup
    return ClientPool(function, static, processes, requests, args.client_niceness)


def _run_interface(args, schedule: Schedule, interface: str, pool: ClientPool, handle, startup: dict) -> list[Path]:
    record = Record(args.out, interface, args.config, prefix="load_step")
    record.update(
        interface=interface,
        schedule=[list(point) for point in schedule],
        schedule_shape="linear between points; a time given twice is a step",
        window_s=args.window,
        startup={k: v for k, v in startup.items() if k != "replica_warmup"},
    )
    record.save()
    start_at = time.time() + START_DELAY_S
    watch = ServiceWatch(handle, startup["app"], args.poll)
    watch.start(start_at)
    try:
        samples = pool.run_schedule(schedule, start_at)
    finally:
        observations = watch.stop()
    late = [s for s in samples if s[1] >= schedule[-1][0]]  # in flight when the schedule ended
    kinds = error_kinds(samples)
    record["totals"] = {
        "requests": len(samples),
        "failed": sum(kinds.values()),
        "error_kinds": kinds,
        "completed_after_end": len(late),
        "vision_tokens": sum(s[2] for s in samples),
    }
    record["windows"] = load_step_rows(samples, schedule, args.window, observations)
    record["observations"] = observations
    record["complete"] = True
    record.save()
    print(load_step_table(record), flush=True)
    plot_load_step(record, record.path.with_suffix(".png"))
    return [record.path, record.path.with_suffix(".png")]


def load_step_table(record: dict) -> str:
    """A Markdown table of a load step's windows, and its totals."""
    lines = [
        f"load step, {record['interface']}: {json.dumps(record['totals'])}",
        "",
        "| t (s) | callers | tok/s | p50 ms | p99 ms | errors | replicas | at full speed | warm-up stages |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["windows"]:
        stages = ", ".join(f"{w['stage']} {w['graphs_live']}/{w['graphs_total']}" for w in row["warmup"].values())
        replicas = ", ".join(f"{n} {state.lower()}" for state, n in sorted((row["replicas"] or {}).items()))
        lines.append(
            f"| {row['t0_s']:g}-{row['t1_s']:g} | {row['callers']:g} | {row['tokens_per_s']:.0f} | "
            f"{row['p50_ms'] or '-'} | {row['p99_ms'] or '-'} | {row['errors']} | {replicas} | "
            f"{row['full_speed_replicas']} | {stages} |"
        )
    return "\n".join(lines)


def report_load_steps(out: Path) -> None:
    """Rebuild the tables and plots of the load steps saved in `out`."""
    for path in sorted(out.glob("load_step_*.json")):
        record = json.loads(path.read_text())
        print(load_step_table(record))
        plot_load_step(record, path.with_suffix(".png"))
