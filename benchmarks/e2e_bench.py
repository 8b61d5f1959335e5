"""End to end, as a caller sees it: the service against what a user would deploy instead.

    python benchmarks/e2e_bench.py --config configs/gpu.yaml --out benchmarks/results/e2e_h100

Systems (`--systems`; each saved as `<out>/e2e_<system>.json`, the report built from all there):
- `ours`: `serve run <config>` in a separate process, as a user starts it. Records the seconds to
  the first correct answer and to full speed (every graph live), then loads it closed-loop through
  the handle (from this separate driver process, or `--handle-processes` of them), HTTP
  safetensors and HTTP JSON at each
  concurrency, one 448x448 image at concurrency 1, and checks that handle and HTTP results agree.
  `--restart` starts it once more (the compile cache now filled) and records the same times.
  `--replicas 4 2 1`: one service measured at each count in turn, scaled down while warm.
  `--settle S`: S seconds of unrecorded load first (each graph's first pack is checked against eager).
- `batched`, `plain`: `benchmarks/baselines.py` on the same GPU (transformers' tower behind a
  Serve deployment, with and without `@serve.batch`), through HTTP JSON and the handle.
- `encoder`: the encoder alone in this process (the config's runner, fully warmed) on the same
  item stream, packed by the router's packing rule: the ceiling the service is measured against.
The workload: fixed-seed photos of common sizes 224x224 to 1920x1080 (JPEG), 1-3 per request,
and a share of 8-frame videos (given as frames); requests opt out of the service's embedding
cache. A point's throughput counts the requests that complete within its window, after its warm-up.
Prints a table, saves JSON and PNG plots (throughput against concurrency, latency CDF)
with device, versions and command.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import multiprocessing
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
# `serve run` starts its cluster with token authentication unless told otherwise; the driver must
# say so before Ray is imported, as the router's "Attach from Python" line does.
os.environ.setdefault("RAY_AUTH_MODE", "token")
sys.path.insert(0, str(ROOT))

from benchmarks.environment import environment  # noqa: E402
from benchmarks.serve_log import (  # noqa: E402
    MARKERS,
    SLOW_PROBE,
    occurrences,
    ray_address,
    startup_failure,
    startup_lines,
)
from benchmarks.service_counters import counted_between, run_shares  # noqa: E402

SIZES = [(224, 224), (448, 448), (640, 480), (800, 600), (1024, 768), (1280, 720), (1920, 1080)]
VIDEO_SHARE = 0.1
VIDEO_FRAMES, VIDEO_SIZE = 8, (448, 448)
JSON = {"Content-Type": "application/json"}
USAGE = re.compile(rb'"vision_tokens":\s*(\d+)')


# ---- the workload ----


def photo(rng: np.random.Generator, width: int, height: int) -> bytes:
    """A photo-like JPEG (smooth gradients, texture, quality 90)."""
    from PIL import Image

    y = np.linspace(0, 1, height)[:, None, None]
    x = np.linspace(0, 1, width)[None, :, None]
    tint = rng.uniform(0, 255, (1, 1, 3))
    base = (x * tint + y * (255 - tint)) * 0.8 + rng.normal(0, 12, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def workload(count: int, seed: int = 0) -> list[list]:
    """Requests: lists of items, each JPEG bytes or a list of frames (a video)."""
    rng = np.random.default_rng(seed)
    pool = {size: [photo(rng, *size) for _ in range(4)] for size in SIZES}
    clips = [[photo(rng, *VIDEO_SIZE) for _ in range(VIDEO_FRAMES)] for _ in range(4)]
    requests = []
    for _ in range(count):
        items = []
        for _ in range(int(rng.integers(1, 4))):
            if rng.random() < VIDEO_SHARE:
                items.append(clips[int(rng.integers(0, len(clips)))])
            else:
                items.append(pool[SIZES[int(rng.integers(0, len(SIZES)))]][int(rng.integers(0, 4))])
        requests.append(items)
    return requests


def single_images(count: int, seed: int = 1) -> list[list]:
    """One distinct 448x448 photo per request."""
    rng = np.random.default_rng(seed)
    return [[photo(rng, 448, 448)] for _ in range(count)]


def http_body(items: list, encoding_format: str, service: bool) -> bytes:
    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    entries = [
        {"type": "video", "frames": [b64(f) for f in item]}
        if isinstance(item, list)
        else {"type": "image", "image": b64(item)}
        for item in items
    ]
    body = {"items": entries, "encoding_format": encoding_format}
    return json.dumps({**body, "cache": False} if service else body).encode()


def handle_items(items: list) -> list:
    return [{"type": "video", "frames": item} if isinstance(item, list) else item for item in items]


# ---- load ----


def tokens_in(body: bytes, encoding_format: str) -> int:
    if encoding_format == "safetensors":
        header = json.loads(body[8 : 8 + int.from_bytes(body[:8], "little")])
        return json.loads(header["__metadata__"]["usage"])["vision_tokens"]
    return int(USAGE.findall(body[-200:])[-1])


def server_timing(header: str) -> dict[str, float]:
    """`name;dur=ms, ...` (the service's `Server-Timing` header) as {name: ms}."""
    stages = {}
    for part in filter(None, (p.strip() for p in header.split(","))):
        name, _, rest = part.partition(";")
        for field in rest.split(";"):
            if field.strip().startswith("dur="):
                stages[name.strip()] = float(field.strip()[4:])
    return stages


async def _http_clients(url: str, bodies: list[bytes], fmt: str, concurrency: int, seconds: float, offset: int):
    import aiohttp

    samples, stop = [], time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def client(worker: int) -> None:
            n = worker
            while time.perf_counter() < stop:
                body = bodies[(offset + n) % len(bodies)]
                start = time.perf_counter()
                async with session.post(url, data=body, headers=JSON) as reply:
                    data = await reply.read()
                ok = reply.status == 200
                stages = server_timing(reply.headers.get("Server-Timing", ""))
                samples.append((start, time.perf_counter(), tokens_in(data, fmt) if ok else 0, reply.status, stages))
                n += concurrency

        await asyncio.gather(*(client(w) for w in range(concurrency)))
    return samples


def _http_setup(url: str, bodies: list[bytes], fmt: str):
    """A client process's HTTP load: (run a share of it, clean up)."""
    loop = asyncio.new_event_loop()

    def run(concurrency: int, seconds: float, offset: int) -> list:
        return loop.run_until_complete(_http_clients(url, bodies, fmt, concurrency, seconds, offset))

    return run, loop.close


async def handle_load(call, requests: list[list], concurrency: int, seconds: float, offset: int = 0) -> list:
    """`call(items) -> tokens` (or `(tokens, the service's stages in ms)`) awaited in a closed loop
    by `concurrency` callers; a call the service fails is a sample with the error's name."""
    from ray.exceptions import RayError

    from deployments.errors import RequestError

    samples, stop = [], time.perf_counter() + seconds

    async def client(worker: int) -> None:
        n = offset + worker
        while time.perf_counter() < stop:
            start = time.perf_counter()
            try:
                out = await call(requests[n % len(requests)])
            except (RayError, RequestError) as error:  # the service's failure is a sample, not the end
                samples.append((start, time.perf_counter(), 0, type(error).__name__, {}))
                n += concurrency
                await asyncio.sleep(0)
                continue
            tokens, stages = out if isinstance(out, tuple) else (out, {})
            samples.append((start, time.perf_counter(), tokens, 200, stages))
            n += concurrency

    await asyncio.gather(*(client(w) for w in range(concurrency)))
    return samples


def handle_call(handle) -> Callable:
    """One caller's request through the service's handle, results read from the encoder replica."""

    async def call(items: list) -> tuple[int, dict]:
        results = await handle.encode.remote(handle_items(items), cache=False)
        await asyncio.gather(*(r.fetch() for r in results))
        return sum(int(r.embedding.shape[0]) for r in results), results[0].timing_ms

    return call


CLIENT_START_S = 120.0
"""Longest a client process may take to start and connect before the point is abandoned."""


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


def shares(concurrency: int, processes: int) -> list[int]:
    """`concurrency` callers split over `processes` as evenly as they go."""
    return [concurrency // processes + (p < concurrency % processes) for p in range(processes)]


def _handle_setup(address: str, app: str, requests: list):
    """A driver process's handle load (its own Ray driver): (run a share of it, clean up)."""
    import ray
    from ray import serve

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    call, loop = handle_call(serve.get_app_handle(app)), asyncio.new_event_loop()

    def run(concurrency: int, seconds: float, offset: int) -> list:
        return loop.run_until_complete(handle_load(call, requests, concurrency, seconds, offset))

    return run, ray.shutdown


def _pool_client(setup: Callable, static: tuple, index: int, inbox, out, niceness: int = 0) -> None:
    close = None
    try:
        if niceness:  # raising one's own nice value needs no permission
            os.nice(niceness)
        run, close = setup(*static)
        out.put(("ready", index))
        while (job := inbox.get()) is not None:
            concurrency, seconds, offset, start_at = job
            time.sleep(max(0.0, start_at - time.time()))  # every client starts the clock together
            began = own_cpu_seconds()
            samples = run(concurrency, seconds, offset)
            out.put((samples, own_cpu_seconds() - began))
    except BaseException as error:  # the parent must hear of it, not wait for it
        out.put(f"client process {index}: {type(error).__name__}: {error}")
        raise
    finally:
        if close is not None:
            close()


class ClientPool:
    """Client processes started once per interface and reused at every concurrency (one Python
    process cannot read the results of a fast service). Each gets the requests once: starting a
    Ray driver, or pickling the bodies over, for every point took longer than the point."""

    def __init__(self, setup: Callable, static: tuple, processes: int, workload: list, niceness: int = 0):
        self.workload = workload  # its id keys the pool: held, it cannot be reused by another list
        context = multiprocessing.get_context("spawn")
        self.out, self.inboxes = context.Queue(), [context.Queue() for _ in range(processes)]
        self.clients = [
            context.Process(target=_pool_client, args=(setup, static, p, inbox, self.out, niceness), daemon=True)
            for p, inbox in enumerate(self.inboxes)
        ]
        for client in self.clients:
            client.start()
        try:
            for _ in self.clients:
                self._check(self.out.get(timeout=CLIENT_START_S))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _check(part):
        if isinstance(part, str):
            raise RuntimeError(part)
        return part

    def load(self, concurrency: int, seconds: float, window: Window) -> tuple[list, float]:
        """`concurrency` callers over as many of the processes for `seconds`: the samples and the
        CPU seconds the clients used. `window` spans the load only."""
        used = shares(concurrency, min(len(self.inboxes), concurrency))
        start_at = time.time() + 0.2
        for p, share in enumerate(used):
            self.inboxes[p].put((share, seconds, p * 7919, start_at))
        time.sleep(max(0.0, start_at - time.time()))
        window.open()
        parts = [self._check(self.out.get(timeout=seconds + 300)) for _ in used]
        window.close()
        return [sample for part, _ in parts for sample in part], sum(cpu for _, cpu in parts)

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for client in self.clients:
            client.join(30)
            if client.is_alive():
                client.terminate()


def own_cpu_seconds() -> float:
    """CPU seconds so far of this process (all its threads, Ray's included)."""
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


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
        "p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))], 2),
        "latencies_ms": [round(v, 2) for v in latencies],
    }


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
workers (`python -m deployments.decode_worker`) and HAProxy where it is the ingress
(`RAY_SERVE_ENABLE_HA_PROXY=1`): their CPU use is recorded."""


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
            found = process.info["name"] == name if name == "haproxy" else name in title
            if found and process.info["cpu_times"] is not None:
                times = process.info["cpu_times"]
                used[name] = used.get(name, 0.0) + times.user + times.system
    return used


class Record(dict):
    """One system's results, written to `<out>/e2e_<system>.json` after every point: a run stopped
    early (a time limit, a crash) keeps what it measured, marked `"complete": false`."""

    def __init__(self, out: Path, system: str, config: Path):
        super().__init__(environment=environment(), config=str(config), complete=False)
        self.path = out / f"e2e_{system}.json"

    def save(self) -> None:
        partial = self.path.with_suffix(".json.partial")  # a kill mid-write leaves the last whole file
        partial.write_text(json.dumps(self, indent=1))
        os.replace(partial, self.path)


class Discard(dict):
    """A record that keeps nothing (a load that is not measured)."""

    def save(self) -> None:
        pass


def measure(
    args,
    name: str,
    interfaces: dict,
    requests: list[list],
    concurrencies: list[int],
    rows: dict,
    record: Record,
    snapshot: Callable[[], dict] | None = None,
    pools: dict | None = None,
) -> None:
    """Fill `rows` (part of `record`, saved after each point). `interfaces`: name -> ("http", url,
    format), ("handle", call) or ("handles", address, app, processes). Each point records the cores
    the Serve processes and the benchmark's own callers used during it (is the router or the
    caller the limit?) and, with `snapshot`, the service's own counters after it and what they
    grew by during it."""
    own = pools is None
    pools = {} if own else pools
    try:
        for interface, how in interfaces.items():
            _measure_interface(args, name, interface, how, requests, concurrencies, rows, record, snapshot, pools)
    finally:
        if own:
            for pool in pools.values():
                pool.close()


def _measure_interface(args, name, interface, how, requests, concurrencies, rows, record, snapshot, pools) -> None:
    key = (interface, how[:3], id(requests))  # client processes per interface and workload (kept alive by the pool)
    if how[0] in ("handles", "http") and key not in pools:
        if how[0] == "handles":
            pools[key] = ClientPool(_handle_setup, (how[1], how[2], requests), how[3], requests, args.client_niceness)
        else:
            bodies = [http_body(r, how[2], name == "ours") for r in requests]
            processes = min(args.http_processes, max(concurrencies))
            pools[key] = ClientPool(_http_setup, (how[1], bodies, how[2]), processes, requests, args.client_niceness)
    for concurrency in concurrencies:
        seconds = args.seconds + args.warmup
        window, clients_cpu = Window(), 0.0  # callers in other processes report their own CPU
        before = snapshot() if snapshot is not None else None
        if how[0] in ("handles", "http"):
            samples, clients_cpu = pools[key].load(concurrency, seconds, window)
        else:
            window.open()
            samples = asyncio.run(handle_load(how[1], requests, concurrency, seconds))
            window.close()
        row = rows.setdefault(interface, {})[str(concurrency)] = summarize(samples, args.warmup, args.seconds)
        row["cores_used"] = {k: round(v / window.elapsed, 2) for k, v in window.serve_used.items()}
        row["host_busy_cores"] = round(window.host_used / window.elapsed, 2)  # every process, of `cpus`
        callers = window.own_used + clients_cpu
        row["cores_used"]["benchmark_callers"] = round(callers / window.elapsed, 2)
        packing = ""
        if snapshot is not None:
            after = snapshot()
            for _ in range(8 if "router_pid" in before else 0):  # the proxy picks the router that answers
                if after.get("router_pid") == before.get("router_pid"):
                    break
                after = snapshot()
            row["service_after"], row["service_window"] = after, counted_between(before, after)
            packing = f"  window {row['service_window']}"
        print(
            f"{name:8s} {interface:12s} c={concurrency:3d} {row['tokens_per_s']:10.0f} tok/s  "
            f"p50 {row['p50_ms']:8.1f} ms  p99 {row['p99_ms']:8.1f} ms  errors {row['errors']}  "
            f"cores {row['cores_used']} host {row['host_busy_cores']}  "
            f"stages {row['server_timing_p50_ms'] or '-'}{packing}",
            flush=True,
        )
        record.save()


# ---- the service ----


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


def encoder_replica_pids(app: str) -> list[int]:
    import psutil

    title = f"ServeReplica:{app}:EncoderReplica"
    return [p.pid for p in psutil.process_iter(["cmdline"]) if title in " ".join(p.info["cmdline"] or [])]


def failover(args, call, requests: list[list], service: ServeRun, app: str) -> dict:
    """One encoder replica killed (SIGKILL) a quarter into a closed-loop handle load at the
    highest concurrency: failed calls, tokens/s per second around the kill, and the seconds from
    the kill until Serve's replacement logs its ready line (it serves from then on)."""
    victims = encoder_replica_pids(app)
    if len(victims) < 2:
        return {"skipped": f"{len(victims)} encoder replica(s): the survivor must carry the load"}
    concurrency, ready_mark = max(callers(args, len(victims))), MARKERS["encoder_ready_s"]
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


def run_ours(args, requests: list[list]) -> list[Path]:
    """Start the service once and measure it at each of `--replicas` in turn (largest first:
    scaling down keeps replicas that are warm), each count's results in `<out>/replicas_<n>/`
    where there are several; returns the folders written."""
    import ray
    from ray import serve

    counts = args.replicas or [None]
    folders = [args.out / f"replicas_{n}" if len(counts) > 1 else args.out for n in counts]
    configs = [fixed_replicas(args.config, n, out) if n else args.config for n, out in zip(counts, folders)]
    # a replica is killed at the last count that leaves a survivor (before scaling down drops the replacement)
    kill_at = max((i for i, n in enumerate(counts) if (n or 2) >= 2), default=None) if args.failover else None
    service, startup = start_service(args, configs[0], folders[0], "cold", counts[0])
    pools: dict = {}  # client processes, kept across points and replica counts
    try:
        ray.init(address=service.address, log_to_driver=False)
        handle = serve.get_app_handle(startup["app"])
        call = handle_call(handle)
        url = startup["url"]
        drivers = ("handles", service.address, startup["app"], args.handle_processes)
        interfaces = {
            "handle": ("handle", call) if args.handle_processes == 1 else drivers,
            "safetensors": ("http", url + "/v1/encode", "safetensors"),
            "json": ("http", url + "/v1/encode", "base64"),
        }
        if args.settle:  # every graph's first pack is checked against eager: not the steady state
            print(f"settle: {args.settle} s of load, not recorded", flush=True)
            first = args.interfaces.split(",")[0]
            unrecorded = argparse.Namespace(**{**vars(args), "seconds": args.settle, "warmup": 0.0})
            measure(
                unrecorded,
                "ours",
                {first: interfaces[first]},
                requests,
                [max(callers(args, counts[0]))],
                {},
                Discard(),
                None,
                pools,
            )
        for index, (replicas, out, config) in enumerate(zip(counts, folders, configs)):
            record = Record(out, "ours", config)
            if index == 0:
                record["startup"] = {"cold": startup}
            else:
                record["rescaled"] = rescale(config, service, startup, replicas, args.startup_timeout)
            record.save()
            if args.single:
                single = {"handle": ("handle", call), "safetensors": interfaces["safetensors"]}
                record["single_448"] = {}
                measure(
                    args, "ours", single, single_images(args.single), [1], record["single_448"], record, pools=pools
                )
            chosen = {k: interfaces[k] for k in args.interfaces.split(",")}
            record["mixed"] = {}

            def snapshot() -> dict:
                probes = occurrences(service.log.read_text(errors="replace"), SLOW_PROBE)
                return {**counters(handle), "slow_queue_probes": probes}

            levels = callers(args, replicas)
            measure(args, "ours", chosen, requests, levels, record["mixed"], record, snapshot, pools)
            record["handle_vs_http_max_rel_error"] = compare_handle_and_http(handle, url, requests[:16])
            if index == kill_at:
                record["failover"] = failover(args, call, requests, service, startup["app"])
                record.save()
            detail = handle.detail.remote().result(timeout_s=30)["encoder"]
            record["router"], record["replica"] = detail["router"], detail["replica"]
            record["complete"] = not args.restart
            record.save()
    finally:
        for pool in pools.values():
            pool.close()
        ray.shutdown()
        service.stop()
    if args.restart:
        service, record["startup"]["warm_cache"] = start_service(args, configs[0], args.out, "warm_cache", counts[0])
        service.stop()
        record["complete"] = True
        record.save()
    return folders


def callers(args, replicas: int | None) -> list[int]:
    """The concurrencies of the mixed load at `replicas` encoder replicas: `--callers-per-replica`
    times the count (the same load per replica at every count), else `--concurrency`."""
    if args.callers_per_replica and replicas:
        return [args.callers_per_replica * replicas]
    return args.concurrency


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


# ---- baselines and the encoder alone ----


def model_args(args) -> dict:
    return yaml.safe_load(args.config.read_text())["applications"][0]["args"]


def run_baseline(args, name: str, requests: list[list], record: Record) -> None:
    import ray
    from ray import serve

    from benchmarks.baselines import BatchedTower, PlainTower
    from deployments.config import AppConfig

    model = AppConfig.model_validate(model_args(args)).model
    deployment = {"batched": BatchedTower, "plain": PlainTower}[name]
    ray.init(log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.baseline_port})
    try:
        gpus = {"num_gpus": 1 if model.device == "cuda" else 0}
        dtype = (
            "bfloat16" if model.dtype == "auto" and model.device == "cuda" else model.dtype.replace("auto", "float32")
        )
        app = deployment.options(ray_actor_options=gpus).bind(model.model_id, dtype, model.device)
        handle = serve.run(app, name=name, route_prefix=f"/{name}")

        async def call(items: list) -> int:
            return sum(int(o["tokens"].shape[0]) for o in await handle.encode.remote(items))

        url = f"http://127.0.0.1:{args.baseline_port}/{name}"
        interfaces = {"handle": ("handle", call), "json": ("http", url, "base64")}
        interfaces = {k: v for k, v in interfaces.items() if k in args.interfaces.split(",")}
        record["mixed"] = {}
        measure(args, name, interfaces, requests, args.concurrency, record["mixed"], record)
    finally:
        serve.shutdown()
        ray.shutdown()


def decoded_items(pre, requests: list[list]) -> list[tuple]:
    """(resized uint8 pixels, spec) of every item of the requests in order: decoded and resized by
    the preprocessor `pre`, as the router's decode workers do."""
    import torch
    from PIL import Image

    items = []
    for request in requests:
        for item in request:
            frames = item if isinstance(item, list) else [item]
            arrays = [
                torch.from_numpy(np.asarray(Image.open(io.BytesIO(f)).convert("RGB"))).permute(2, 0, 1) for f in frames
            ]
            if isinstance(item, list):
                pixels = pre.resize_video(torch.stack(arrays))
                spec = pre.spec("video", len(frames), *pixels.shape[-2:])
            else:
                pixels = pre.resize_image(arrays[0].contiguous())
                spec = pre.spec("image", 1, *pixels.shape[-2:])
            items.append((pixels, spec))
    return items


def run_encoder(args, requests: list[list], record: Record) -> None:
    """The config's runner here, fully warmed, on the workload's items packed by the router's rule."""
    import torch

    from deployments.app import deployment_ladder
    from deployments.config import AppConfig
    from deployments.encoder import load_encoder
    from encoder_graphs.packing import PackItem, pack_items
    from encoder_graphs.runner import EncoderRunner

    config = AppConfig.model_validate(model_args(args))
    encoder = load_encoder(config)
    ladder = deployment_ladder(config)
    runner = EncoderRunner(encoder, config.graphs, ladder)
    start = time.perf_counter()
    runner.prepare(progress=lambda m: None)
    runner.warm_up(progress=lambda m: None)
    warm_s = time.perf_counter() - start
    pre, items = encoder.preprocessor, decoded_items(encoder.preprocessor, requests)
    queue = [PackItem(i, spec.modality, spec.output_tokens, spec.grid_thw[0]) for i, (_, spec) in enumerate(items)]
    packs = pack_items(queue, ladder.budgets, ladder.max_items, ladder.max_segments)

    def run_all() -> tuple[int, float]:
        torch.cuda.synchronize() if encoder.device.type == "cuda" else None
        begin, tokens = time.perf_counter(), 0
        for pack in packs:
            chosen = [items[p.key] for p in pack.items]
            values = pre.pixel_values([c[0] for c in chosen], pack.modality, device=encoder.device)
            runner.run(values.to(encoder.dtype), [c[1] for c in chosen], output_device="cpu")
            tokens += pack.tokens
        return tokens, time.perf_counter() - begin

    run_all()  # every pack seen once: what a recurring pack would be on the service after a while
    tokens, seconds = run_all()
    record.update(warm_up_s=round(warm_s, 1), packs=len(packs), tokens=tokens, tokens_per_s=round(tokens / seconds, 1))


# ---- report ----


def load_runs(out: Path) -> dict:
    return {p.stem.removeprefix("e2e_"): json.loads(p.read_text()) for p in sorted(out.glob("e2e_*.json"))}


def _pyplot():
    """matplotlib's pyplot on the file backend, or None (with a hint) where it is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("no plots: pip install matplotlib (the `bench` extra)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(runs: dict, out: Path) -> None:
    if (plt := _pyplot()) is None:
        return
    import matplotlib.ticker

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for name, run in runs.items():
        for interface, points in run.get("mixed", {}).items():
            levels = sorted(points, key=int)
            left.plot(
                [int(c) for c in levels],
                [points[c]["tokens_per_s"] for c in levels],
                marker="o",
                label=f"{name} {interface}",
            )
            top = points[levels[-1]]["latencies_ms"]
            right.plot(top, np.linspace(0, 1, len(top)), label=f"{name} {interface} c={levels[-1]}")
    if "tokens_per_s" in runs.get("encoder", {}):
        left.axhline(runs["encoder"]["tokens_per_s"], color="black", linestyle="--", label="encoder alone")
    left.set(xlabel="concurrent callers", ylabel="vision tokens / s", xscale="log", yscale="log", title="throughput")
    right.set(
        xlabel="latency (ms)", ylabel="fraction of requests", xscale="log", title="latency CDF, highest concurrency"
    )
    # latencies span a decade or two: label 1-2-5 steps in ms (the default minor labels overlap)
    right.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    right.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    right.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "e2e.png", dpi=110)


def table(runs: dict) -> str:
    levels = sorted({c for run in runs.values() for p in run.get("mixed", {}).values() for c in p}, key=int)
    lines = [
        f"{name}: {run['environment']}" + ("" if run.get("complete", True) else " (stopped early)")
        for name, run in runs.items()
        if "environment" in run
    ]
    lines += [
        "",
        "| system | interface | " + " | ".join(f"c={c}: tok/s (p50 ms)" for c in levels) + " |",
        "|---|---|" + "---|" * len(levels),
    ]
    for name, run in runs.items():
        for interface, points in run.get("mixed", {}).items():
            cells = [
                f"{points[c]['tokens_per_s']:.0f} ({points[c]['p50_ms']:.0f})" if c in points else "" for c in levels
            ]
            lines.append(f"| {name} | {interface} | " + " | ".join(cells) + " |")
    if "tokens_per_s" in runs.get("encoder", {}):
        lines.append(
            f"| encoder alone | same items, router's packing | {runs['encoder']['tokens_per_s']:.0f} |"
            + " |" * (len(levels) - 1)
        )
    ours = runs.get("ours", {})
    packing = [
        f"{interface} c={c}: {point['service_window']['requests_per_forward']}"
        for interface, points in ours.get("mixed", {}).items()
        for c, point in points.items()
        if "requests_per_forward" in point.get("service_window", {})
    ]
    if packing:
        lines.append("\nRequests per forward (an encoder run; over each point): " + ", ".join(packing))
    for interface, points in ours.get("single_448", {}).items():
        lines.append(
            f"\nOne 448x448 image, concurrency 1, {interface}: p50 {points['1']['p50_ms']:.1f} ms, "
            f"p99 {points['1']['p99_ms']:.1f} ms"
        )
    if "failover" in ours:
        shown = {k: v for k, v in ours["failover"].items() if k != "tokens_per_second_from_kill"}
        lines.append(f"\nOne encoder replica killed under handle load: {shown}")
    for tag, startup in ours.get("startup", {}).items():
        shown = {k: v for k, v in startup.items() if k.endswith("_s") or k == "encoder_before_constructor"}
        lines.append(f"\nStartup ({tag}): {shown}")
    return "\n".join(lines)


def _best_points(runs: dict[int, dict]) -> tuple[list[str], dict]:
    """The interfaces, and each one's best point (most tokens/s over concurrency) per replica count."""
    interfaces = sorted({i for run in runs.values() for i in run.get("mixed", {})})
    best = {
        (n, i): max(run.get("mixed", {}).get(i, {}).values(), key=lambda p: p["tokens_per_s"], default=None)
        for n, run in runs.items()
        for i in interfaces
    }
    return interfaces, best


def plot_scaling(runs: dict[int, dict], out: Path) -> None:
    """Best tokens/s against replica count per interface, beside linear scaling from the fewest."""
    if (plt := _pyplot()) is None:
        return
    interfaces, best = _best_points(runs)
    counts, fewest = sorted(runs), min(runs)
    figure, axis = plt.subplots(figsize=(6.5, 5))
    for interface in interfaces:
        shown = [n for n in counts if best[n, interface] is not None]
        (line,) = axis.plot(
            shown, [best[n, interface]["tokens_per_s"] for n in shown], marker="o", label=f"ours {interface}"
        )
        if best[fewest, interface] is not None:
            base = best[fewest, interface]["tokens_per_s"] / fewest
            axis.plot(
                counts,
                [base * n for n in counts],
                linestyle=":",
                color=line.get_color(),
                label=f"{interface}, linear from {fewest}",
            )
    axis.set(xlabel="encoder replicas (one GPU each)", ylabel="vision tokens / s", xticks=counts, title="scaling")
    axis.set_ylim(bottom=0)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "scaling.png", dpi=110)


def scaling_table(runs: dict[int, dict]) -> str:
    """Each interface's best point per replica count, and its ratio to the fewest replicas' best."""
    fewest = min(runs)
    interfaces, best = _best_points(runs)
    lines = [
        "| replicas | "
        + " | ".join(f"{i}: tok/s (c, p50 ms) | x{fewest}" for i in interfaces)
        + " | routers' cores (with decode workers; the host's busy cores where recorded)"
        + f" | each replica's share of the {interfaces[0]} window |",
        "|---|" + "---|---|" * len(interfaces) + "---|---|",
    ]
    for n in sorted(runs):
        cells, cores = [], []
        for i in interfaces:
            point, base = best[n, i], best[fewest, i]
            if point is None:
                cells += ["", ""]
                continue
            level = next(c for c, p in runs[n]["mixed"][i].items() if p is point)
            ratio = f"{point['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else ""
            cells += [f"{point['tokens_per_s']:.0f} ({level}, {point['p50_ms']:.0f})", ratio]
            used = point["cores_used"]
            host = f"; host {point['host_busy_cores']:.1f}" if "host_busy_cores" in point else ""
            cores.append(f"{i} {used.get('EncoderRouter', 0) + used.get('decode_worker', 0):.1f}{host}")
        first = best[n, interfaces[0]]
        shares = run_shares(first.get("service_window", {})) if first else ""
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {', '.join(cores)} | {shares} |")
    killed = [(n, run["failover"]) for n, run in runs.items() if "failover" in run]
    for n, result in killed:
        shown = {k: v for k, v in result.items() if k != "tokens_per_second_from_kill"}
        lines.append(f"\nOne of {n} encoder replicas killed under handle load: {shown}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs/gpu.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/e2e")
    parser.add_argument("--systems", default="ours,batched,plain,encoder")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window per point (after --warmup)")
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="ours: seconds of load (first interface, highest concurrency) after startup, not recorded: "
        "each graph's first pack on each replica is checked against eager",
    )
    parser.add_argument("--requests", type=int, default=256, help="distinct requests in the workload")
    parser.add_argument("--restart", action="store_true", help="ours: start again with the filled compile cache")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--baseline-port", type=int, default=8011)
    parser.add_argument("--report", action="store_true", help="only rebuild the table and plot from <out>")
    parser.add_argument(
        "--interfaces", default="handle,safetensors,json", help="interfaces of the mixed load (baselines: handle, json)"
    )
    parser.add_argument(
        "--single", type=int, default=256, help="ours: distinct 448x448 images at concurrency 1 (0: skip)"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        nargs="+",
        help="ours: this many encoder replicas, autoscaling off; several (largest first): one service "
        "scaled down to each in turn, results in <out>/replicas_<n>/ and a scaling table in <out>/scaling.md",
    )
    parser.add_argument(
        "--failover", type=float, default=0, help="ours: seconds of handle load with one encoder replica killed"
    )
    parser.add_argument(
        "--handle-processes",
        type=int,
        default=1,
        help="ours: driver processes sharing the mixed handle load (1: all callers in this process)",
    )
    parser.add_argument(
        "--client-niceness",
        type=int,
        default=0,
        choices=range(0, 20),
        metavar="0-19",
        help="raise the client processes' nice value by this much (15: as Ray's workers, e.g. a deployment "
        "calling the service; 0: plain processes, which the scheduler favours over the service's nice-15 workers)",
    )
    parser.add_argument(
        "--http-processes",
        type=int,
        default=8,
        help="client processes sharing each HTTP load (one Python process cannot read a fast service's responses)",
    )
    parser.add_argument(
        "--callers-per-replica",
        type=int,
        default=0,
        help="with --replicas: the mixed load at this many callers per encoder replica (a closed loop "
        "of fixed callers gives more replicas less each), instead of --concurrency",
    )
    args = parser.parse_args()
    if args.callers_per_replica and not args.replicas:
        parser.error("--callers-per-replica needs --replicas")
    if args.http_processes < 1 or args.handle_processes < 1:
        parser.error("--http-processes and --handle-processes take 1 or more")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replicas and len(args.replicas) > 1 and not args.report:
        if args.systems != "ours" or args.restart or args.replicas != sorted(args.replicas, reverse=True):
            parser.error("several --replicas: --systems ours only, no --restart, largest count first")
    folders = [args.out]
    if not args.report:
        requests = workload(args.requests)
        for system in args.systems.split(","):
            if system == "ours":
                folders = run_ours(args, requests)
                continue
            record = Record(args.out, system, args.config)
            if system == "encoder":
                run_encoder(args, requests, record)
            else:
                run_baseline(args, system, requests, record)
            record["complete"] = True
            record.save()
    elif args.replicas and len(args.replicas) > 1:
        folders = [args.out / f"replicas_{n}" for n in args.replicas]
    for folder in folders:
        runs = load_runs(folder)
        plot(runs, folder)
        report = table(runs)
        (folder / "e2e.md").write_text(report + "\n")
        print(report)
    if len(folders) > 1:
        scaling = {int(f.name.removeprefix("replicas_")): load_runs(f).get("ours", {}) for f in folders}
        report = scaling_table(scaling)
        (args.out / "scaling.md").write_text(report + "\n")
        plot_scaling(scaling, args.out)
        print(report)


if __name__ == "__main__":
    main()
