"""Closed-loop load clients: callers that each send a request, wait for its answer and send the
next, through HTTP or the service's handle, in this process or in a pool of client processes."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
import time
from collections.abc import Callable

from benchmarks.common.cpu import Window, own_cpu_seconds
from benchmarks.common.schedule import Schedule, ScheduleShare, peak, shares
from benchmarks.common.workload import JSON, handle_items

USAGE = re.compile(rb'"vision_tokens":\s*(\d+)')
CLIENT_START_S = 120.0
"""Longest a client process may take to start and connect before the point is abandoned."""
IDLE_POLL_S = 0.05
"""How often a caller that the schedule holds back looks again (a load step's callers)."""
Active = Callable[[int, float], bool]
"""`active(caller, time.perf_counter())`: whether that caller sends now (None: always)."""


def tokens_in(body: bytes, encoding_format: str) -> int:
    """Vision tokens a `/v1/encode` answer reports (safetensors metadata, or the JSON's usage)."""
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


async def _http_clients(
    url: str, bodies: list[bytes], fmt: str, concurrency: int, seconds: float, offset: int, active: Active | None
):
    import aiohttp

    samples, stop = [], time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def client(worker: int) -> None:
            n = worker
            while (now := time.perf_counter()) < stop:
                if active is not None and not active(worker, now):
                    await asyncio.sleep(IDLE_POLL_S)
                    continue
                body = bodies[(offset + n) % len(bodies)]
                start = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers=JSON) as reply:
                        data = await reply.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as error:  # a failure is a sample, not the end
                    samples.append((start, time.perf_counter(), 0, type(error).__name__, {}))
                    n += concurrency
                    continue
                ok = reply.status == 200
                stages = server_timing(reply.headers.get("Server-Timing", ""))
                samples.append((start, time.perf_counter(), tokens_in(data, fmt) if ok else 0, reply.status, stages))
                n += concurrency

        await asyncio.gather(*(client(w) for w in range(concurrency)))
    return samples


def http_setup(url: str, bodies: list[bytes], fmt: str):
    """A client process's HTTP load: (run a share of it, clean up)."""
    import aiohttp  # noqa: F401 - imported here, before any load's clock starts

    loop = asyncio.new_event_loop()

    def run(concurrency: int, seconds: float, offset: int, active: Active | None = None) -> list:
        return loop.run_until_complete(_http_clients(url, bodies, fmt, concurrency, seconds, offset, active))

    return run, loop.close


async def handle_load(
    call, requests: list[list], concurrency: int, seconds: float, offset: int = 0, active: Active | None = None
) -> list:
    """`call(items) -> tokens` (or `(tokens, the service's stages in ms)`) awaited in a closed loop
    by `concurrency` callers (those `active` allows at the time); a call the service fails is a
    sample with the error's name."""
    from ray.exceptions import RayError

    from deployments.errors import RequestError

    samples, stop = [], time.perf_counter() + seconds

    async def client(worker: int) -> None:
        n = offset + worker
        while (now := time.perf_counter()) < stop:
            if active is not None and not active(worker, now):
                await asyncio.sleep(IDLE_POLL_S)
                continue
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


def handle_setup(address: str, app: str, requests: list):
    """A driver process's handle load (its own Ray driver): (run a share of it, clean up)."""
    import ray
    from ray import serve

    import deployments.errors  # noqa: F401 - imported here, before any load's clock starts

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    call, loop = handle_call(serve.get_app_handle(app)), asyncio.new_event_loop()

    def run(concurrency: int, seconds: float, offset: int, active: Active | None = None) -> list:
        return loop.run_until_complete(handle_load(call, requests, concurrency, seconds, offset, active))

    return run, ray.shutdown


def _pool_client(setup: Callable, static: tuple, index: int, inbox, out, niceness: int = 0) -> None:
    close = None
    try:
        if niceness:  # raising one's own nice value needs no permission
            os.nice(niceness)
        run, close = setup(*static)
        out.put(("ready", index))
        while (job := inbox.get()) is not None:
            concurrency, seconds, offset, start_at, active = job
            time.sleep(max(0.0, start_at - time.time()))  # every client starts the clock together
            began, zero = own_cpu_seconds(), time.perf_counter()
            if active is None:
                samples = run(concurrency, seconds, offset)
            else:  # a schedule: its clock and its samples' times in seconds since it began, in every process

                def on_clock(caller: int, now: float, share=active) -> bool:
                    return share(caller, now - zero)

                seconds -= time.perf_counter() - zero  # the schedule ends on time however late this starts
                samples = [(s[0] - zero, s[1] - zero, *s[2:]) for s in run(concurrency, seconds, offset, on_clock)]
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
            self.inboxes[p].put((share, seconds, p * 7919, start_at, None))
        time.sleep(max(0.0, start_at - time.time()))
        window.open()
        parts = [self._check(self.out.get(timeout=seconds + 300)) for _ in used]
        window.close()
        return [sample for part, _ in parts for sample in part], sum(cpu for _, cpu in parts)

    def run_schedule(self, schedule: Schedule, start_at: float) -> list:
        """The schedule's callers over as many of the processes as its peak needs, from wall-clock
        time `start_at` to its end: the samples, their times in seconds from `start_at`."""
        processes = min(len(self.inboxes), max(1, peak(schedule)))
        seconds = schedule[-1][0]
        for p in range(processes):
            active = ScheduleShare(schedule, p, processes)
            self.inboxes[p].put((max(1, active.most()), seconds, p * 7919, start_at, active))
        wait = max(0.0, start_at - time.time()) + seconds + 300
        parts = [self._check(self.out.get(timeout=wait)) for _ in range(processes)]
        return [sample for part, _ in parts for sample in part]

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for client in self.clients:
            client.join(30)
            if client.is_alive():
                client.terminate()
