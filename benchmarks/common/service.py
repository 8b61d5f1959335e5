"""The service under test, as a user runs it: `serve run <config>` in its own process, the times
to its first answer and to full speed, rescaling it, and reading its operator counters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from benchmarks.common.serve_log import ray_address, startup_failure, startup_lines
from benchmarks.common.workload import JSON, handle_items, http_body, single_images

ROOT = Path(__file__).resolve().parents[2]


class ServeRun:
    """`serve run <config>` in its own process group; startup lines timed as they appear."""

    def __init__(self, config: Path, log: Path):
        self.log, self.started = log, time.monotonic()
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ray.serve.scripts", "run", str(config)],  # `serve run`
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        self.seen: dict[str, float] = {}
        self.address: str | None = None
        self.failed: str | None = None
        self.answered = False
        """Set once the service answered: replica failures after that (a failover's) are expected."""
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            text = self.log.read_text(errors="replace")
            for key in startup_lines(text) - set(self.seen):
                self.seen[key] = round(time.monotonic() - self.started, 1)
            self.address = self.address or ray_address(text)
            self.failed = startup_failure(text, self.answered)

    def raise_if_failed(self) -> None:
        """RuntimeError, with the log's last lines, once `serve run` has exited or given up: a
        service that cannot start fails the benchmark at once, not after `--startup-timeout`."""
        code = self.process.poll()
        if code is None and self.failed is None:
            return
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
        reason = f"exited with {code}" if code is not None else f"logged {self.failed!r}"
        raise RuntimeError(f"`serve run` {reason} ({self.log}):\n{tail}")

    def stop(self) -> None:
        self._stop.set()
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(180)
            except subprocess.TimeoutExpired:  # `serve.shutdown()` hung: the error that brought us here matters more
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def first_answer(url: str, body: bytes, timeout_s: float, alive: Callable[[], None]) -> float:
    """When `url` first answers `body` with 200; `alive()` raises if the service gave up."""
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        alive()
        try:
            reply = httpx.post(url + "/v1/encode", content=body, headers=JSON, timeout=30)
        except httpx.HTTPError:
            reply = None
        if reply is not None and reply.status_code == 200:
            return time.monotonic()
        if reply is not None and 400 <= reply.status_code < 500 and reply.status_code != 404:
            raise RuntimeError(f"the probe request was refused: {reply.status_code} {reply.text[:300]}")
        time.sleep(0.25)
    raise TimeoutError(f"no 200 from {url} within {timeout_s} s")


def full_speed(
    url: str, model_id: str, timeout_s: float, alive: Callable[[], None], replicas: int | None = None
) -> tuple[float, dict]:
    """When an encoder replica reports every graph live (with `replicas`: when Serve runs exactly
    that many and each reports it), as the public `/v1/models/{id}` shows; returns that time and
    that replica's warm-up (its stages' seconds, imports and Serve's setup before its constructor)."""
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        alive()
        try:
            encoder = httpx.get(f"{url}/v1/models/{model_id}", timeout=10).json()["encoder"]
            fast = [w for w in encoder.get("replica_warmup", {}).values() if w["full_speed"]]
            if fast and (replicas is None or (encoder["replicas"] == {"RUNNING": replicas} and len(fast) == replicas)):
                return time.monotonic(), fast[0]
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(1)
    raise TimeoutError(f"not at full speed within {timeout_s} s")


def start_service(args, config_path: Path, out: Path, tag: str, replicas: int | None) -> tuple[ServeRun, dict]:
    """`serve run` the config and wait for its first answer and full speed (`args.startup_timeout`
    for each): the running service and its startup times (seconds since launch)."""
    from deployments.config import AppConfig

    config = yaml.safe_load(config_path.read_text())
    app = config["applications"][0]
    url = f"http://127.0.0.1:{config.get('http_options', {}).get('port', 8000)}"
    service = ServeRun(config_path, out / f"serve_run_{tag}.log")
    probe = http_body(single_images(1, seed=99)[0], "safetensors", True)
    try:
        answered = first_answer(url, probe, args.startup_timeout, service.raise_if_failed)
        service.answered = True
        model_id = AppConfig.model_validate(app.get("args", {})).model.model_id
        fast, replica = full_speed(url, model_id, args.startup_timeout, service.raise_if_failed, replicas)
    except BaseException:
        service.stop()
        raise
    startup = {
        "first_200_s": round(answered - service.started, 1),
        "full_speed_s": round(fast - service.started, 1),
        **service.seen,
        # durations, unlike the times since launch above: the answering replica's imports, Serve's
        # setup, and its worker process's age, before its constructor
        "encoder_before_constructor": replica.get("before_constructor"),
        "replica_warmup": replica,
    }
    print(f"startup ({tag}): {json.dumps({k: v for k, v in startup.items() if k != 'replica_warmup'})}", flush=True)
    return service, {"url": url, "app": app["name"], "model_id": model_id, **startup}


def rescale(config_path: Path, service: ServeRun, startup: dict, replicas: int, timeout_s: float) -> dict:
    """Deploy `config_path` (the same application, another replica count) over the running one,
    as `serve run` deployed it, and wait until exactly `replicas` encoder replicas run at full
    speed. Serve stops the newest replicas first, so scaling down keeps warm ones."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    start = time.monotonic()
    document = ServeDeploySchema.model_validate(yaml.safe_load(config_path.read_text()))
    _get_global_client().deploy_apps(document, _blocking=False)
    fast, _ = full_speed(startup["url"], startup["model_id"], timeout_s, service.raise_if_failed, replicas)
    rescaled = {"replicas": replicas, "at_full_speed_s": round(fast - start, 1)}
    print(f"rescaled: {json.dumps(rescaled)}", flush=True)
    return rescaled


def fixed_replicas(config: Path, replicas: int, out: Path) -> Path:
    """A copy of a Serve config with `replicas` encoder replicas and no autoscaling (saved beside
    the results, so the run can be repeated)."""
    document = yaml.safe_load(config.read_text())
    for app in document["applications"]:
        for deployment in app.get("deployments", []):
            if deployment["name"] == "EncoderReplica":
                deployment.pop("autoscaling_config", None)
                deployment["num_replicas"] = replicas
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{config.stem}_{replicas}_replicas.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def compare_handle_and_http(handle, url: str, requests: list[list]) -> float:
    """Largest relative error between an item's handle result and its HTTP safetensors result."""
    import math

    import httpx
    from safetensors.torch import load

    worst = 0.0
    for items in requests:
        results = handle.encode.remote(handle_items(items), cache=False).result()
        reply = httpx.post(url + "/v1/encode", content=http_body(items, "safetensors", True), headers=JSON, timeout=120)
        reply.raise_for_status()
        tensors = load(reply.content)
        for result in results:
            http = tensors[f"{result.index}.embedding"].float()
            error = ((result.embedding.float() - http).abs().max() / http.abs().max().clamp_min(1e-6)).item()
            if not math.isfinite(error):  # max() would drop a NaN
                return float("inf")
            worst = max(worst, error)
    return worst


def counters(handle) -> dict:
    """The service's cumulative pack and forward counters (one router's, one replica's description,
    every replica's work report), as the router's `detail()` reports them to operators."""
    try:
        detail = handle.detail.remote().result(timeout_s=30)["encoder"]
    except Exception as error:  # noqa: BLE001 - a benchmark keeps going without them
        return {"error": repr(error)}
    router, replica = detail["router"], detail["replica"]
    keep = ("pid", "forwards", "merged_packs", "merged_requests", "packs_per_forward", "requests_per_forward")
    keep += ("step_seconds", "queued_tokens", "stats")
    keep += ("status", "stale_s")
    # Which router and replica answered (the proxy picks a router; the router a replica): pair
    # snapshots by pid before taking differences.
    return {
        "router_pid": router.get("pid"),
        "router_packs": router.get("packs"),
        "replica": {k: replica.get(k) for k in keep},
        "replicas": detail.get("replica_work") or {},  # every replica's, from the reports routers route by
    }
