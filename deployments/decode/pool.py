"""A pool of decode worker processes: untrusted media is parsed there, each job under a time limit.

The workers are forked from one template process (`Template`) that imported the libraries and
built the preprocessor once: a worker starts, or is replaced, in milliseconds, and shares the
template's memory.

Jobs wait ordered by deadline (arrival + estimated cost), so a small image does not wait
long behind a queue of large videos, and nothing starves. A job that runs past its time
limit has its worker killed and replaced, and its item fails with 413; a worker that dies
(a crashing codec) is replaced, and its item fails with 400. A job that cannot be pickled to a
worker, or unpickled there, fails its item with 400 and leaves the worker running. More than
`max_queued` waiting jobs: `run` raises `Overloaded` at once, before anything is queued.

The workers run with a minimal environment (`worker_environment`): no credentials of the router's
reach a process that parses untrusted bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import reduction
from multiprocessing.connection import Connection

from ..config import Limits, ModelSettings
from ..errors import Overloaded, item_error

logger = logging.getLogger("ray.serve")

PIXELS_PER_SECOND = 100e6
"""Rough decode speed of one worker; only orders the queue (deadline = arrival + pixels / this)."""
SMALL_PIXELS = 4_000_000
"""Jobs up to this many decoded pixels (and every image inspection under `SMALL_BYTES`) may also
take the pool's reserved worker, so small items keep moving while large ones hold the rest."""
SMALL_BYTES = 2 << 20


FORK_TIMEOUT_S = 10.0
"""Longest the template may take to fork a worker."""


class WorkerTimeout(Exception):
    pass


class JobNotSent(Exception):
    """A job's arguments could not be pickled for a worker (an object only the caller's process
    can rebuild, such as a class defined in its `__main__`); nothing reached the worker."""


NOT_SENT = "cannot be sent to a decode worker (it does not pickle): send a plain PIL image or the file's bytes"
"""The error of an item whose job is `JobNotSent`."""


class JobUnreadable(Exception):
    """A worker's answer to a job it could not unpickle; the worker itself is fine."""


PASSED_ENVIRONMENT = (
    "PATH",
    "HOME",
    "TMPDIR",
    "TZ",
    "LANG",
    "LANGUAGE",
    "LD_LIBRARY_PATH",
    "PYTHONHOME",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "TRANSFORMERS_CACHE",
    "XDG_CACHE_HOME",
    "TORCH_HOME",
)
"""The router's environment variables a decode worker gets (with every `LC_*`): where programs,
libraries and cached checkpoints are, and the locale. Nothing else: no credentials reach a process
that parses untrusted bytes."""
WORKER_ENVIRONMENT = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "CUDA_VISIBLE_DEVICES": "",
}
"""Set for every decode worker: one core's worth of work each, no network (the router has fetched
the checkpoint's files before the workers start), no GPU."""


def worker_environment(parent: dict[str, str], python_path: list[str]) -> dict[str, str]:
    """A decode worker's environment: the passed variables of `parent`, `WORKER_ENVIRONMENT`, and
    `python_path` (the router's `sys.path`, so that the workers import the same code)."""
    passed = {k: v for k, v in parent.items() if k in PASSED_ENVIRONMENT or k.startswith("LC_")}
    return {**passed, **WORKER_ENVIRONMENT, "PYTHONPATH": os.pathsep.join(p for p in python_path if p)}


@dataclass(frozen=True)
class WorkerSetup:
    """What the template needs to build the workers' state (pickled into its process)."""

    model: ModelSettings
    limits: Limits


class Template:
    """The process the workers are forked from (`python -m deployments.decode.worker <fd>`), with
    its control socket: the setup goes in once, then pipe ends go in (SCM_RIGHTS) and pids come
    out. A plain subprocess, not multiprocessing, which would re-import the parent's main module
    (a Ray worker's) in the child."""

    def __init__(self, process: subprocess.Popen, sock: socket.socket):
        self.process = process
        self.sock = sock
        self.control = Connection(os.dup(sock.fileno()))
        self._lock = threading.Lock()

    @classmethod
    def spawn(cls) -> Template:
        """Start the process without waiting: it imports the libraries, then waits for its setup
        (`start`), so the caller can do its own imports meanwhile."""
        ours, theirs = socket.socketpair()
        process = subprocess.Popen(
            [sys.executable, "-m", "deployments.decode.worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=worker_environment(dict(os.environ), sys.path),
        )
        theirs.close()
        return cls(process, ours)

    def start(self, setup: WorkerSetup, timeout_s: float) -> None:
        """Send the setup and wait until the template has built its state; closed if it fails."""
        try:
            self.control.send(setup)
            answered = self.control.poll(timeout_s)
            ok, detail = self.control.recv() if answered else (False, f"no answer within {timeout_s} s")
        except (EOFError, OSError):  # it exited first; its error is in the log
            ok, detail = False, "it exited before answering"
        if not ok:
            self.close()
            raise RuntimeError(f"decode worker template failed to start: {detail}")

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, jobs_read: int, answers_write: int) -> int:
        """A new worker reading jobs from `jobs_read` and answering on `answers_write`; its pid."""
        with self._lock:
            reduction.sendfds(self.sock, [jobs_read, answers_write])
            if not self.control.poll(FORK_TIMEOUT_S):
                raise RuntimeError(f"decode worker template did not fork within {FORK_TIMEOUT_S} s")
            return self.control.recv()

    def close(self) -> None:
        self.process.kill()
        self.process.wait(timeout=5)
        self.control.close()
        self.sock.close()


class Worker:
    """One decode process forked from the template, and its two pipes; `call` blocks (run it in a
    thread)."""

    def __init__(self, template: Template, start_timeout_s: float, small_only: bool = False):
        self.small_only = small_only
        jobs_read, jobs_write = os.pipe()
        answers_read, answers_write = os.pipe()
        self.jobs = Connection(jobs_write, readable=False)
        self.answers = Connection(answers_read, writable=False)
        self.pid: int | None = None
        try:
            self.pid = template.fork(jobs_read, answers_write)
        except Exception:
            self.kill()
            raise
        finally:
            os.close(jobs_read)
            os.close(answers_write)
        if not self.answers.poll(start_timeout_s):
            self.kill()
            raise RuntimeError(f"decode worker did not start within {start_timeout_s} s")
        self.answers.recv()

    def call(self, name: str, args: tuple, timeout_s: float):
        """Send a job and wait for its answer. The job is pickled before anything is written, so one
        that cannot be (`JobNotSent`) leaves the pipe and the worker as they were."""
        try:
            job = reduction.ForkingPickler.dumps((name, args))
        except Exception as error:  # pickle raises many types for an object it cannot reduce
            raise JobNotSent(f"{type(error).__name__}: {error}") from None
        self.jobs.send_bytes(job)
        if not self.answers.poll(timeout_s):
            raise WorkerTimeout
        return self.answers.recv()

    def kill(self) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.jobs.close()
        self.answers.close()


@dataclass(order=True)
class _Job:
    deadline: float
    seq: int
    name: str = field(compare=False)
    args: tuple = field(compare=False)
    index: int = field(compare=False)
    small: bool = field(compare=False)
    future: asyncio.Future = field(compare=False)


@dataclass
class PoolStats:
    completed: int = 0
    timeouts: int = 0
    crashes: int = 0
    refused: int = 0
    template_restarts: int = 0


class DecodePool:
    """`workers` general processes plus one reserved for small jobs."""

    def __init__(
        self, setup: WorkerSetup, workers: int, timeout_s: float, max_queued: int, start_timeout_s: float = 120.0
    ):
        self.setup = setup
        self.size = workers + 1
        self.timeout_s = timeout_s
        self.max_queued = max_queued
        self.start_timeout_s = start_timeout_s
        self.stats = PoolStats()
        self._threads = ThreadPoolExecutor(2 * self.size, thread_name_prefix="vlm-decode")
        self._idle: list[Worker] = []
        self._alive = 0
        self._pending: list[_Job] = []
        self._seq = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._template: Template | None = None
        self._template_lock = threading.Lock()

    def start(self, template: Template | None = None) -> None:
        """Start the template (`template`: one spawned already), then fork every worker (blocking;
        the router's constructor calls it)."""
        self._template = template or Template.spawn()
        self._template.start(self.setup, self.start_timeout_s)
        lanes = [False] * (self.size - 1) + [True]
        self._idle.extend(self._new_worker(small_only) for small_only in lanes)
        self._alive = len(self._idle)

    def _new_worker(self, small_only: bool) -> Worker:
        with self._template_lock:
            if not self._template.alive:  # killed or crashed: the workers it forked run on
                logger.warning("the decode worker template exited; starting a new one")
                self._template.close()
                self._template = Template.spawn()
                self._template.start(self.setup, self.start_timeout_s)
                self.stats.template_restarts += 1
            template = self._template
        return Worker(template, self.start_timeout_s, small_only)

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def alive(self) -> int:
        return self._alive

    async def run(self, name: str, args: tuple, index: int, pixels: int = 0, small: bool = False):
        """Run one job for item `index` in a worker; its answer, or the item's error. `pixels`
        orders the queue; `small` jobs may also take the reserved worker."""
        if self._alive == 0:
            raise Overloaded("no decode worker is running (see the router's log)")
        if len(self._pending) >= self.max_queued:
            self.stats.refused += 1
            raise Overloaded(
                f"{len(self._pending)} items wait for a decode worker (max_decode_queue={self.max_queued})"
            )
        self._loop = asyncio.get_running_loop()
        deadline = time.monotonic() + pixels / PIXELS_PER_SECOND
        job = _Job(deadline, next(self._seq), name, args, index, small, self._loop.create_future())
        heapq.heappush(self._pending, job)
        self._dispatch()
        ok, value = await job.future
        if not ok:
            raise value
        return value

    def _take(self, worker: Worker) -> _Job | None:
        """The earliest-deadline job this worker may run (dropping those whose request is gone)."""
        self._pending = [job for job in self._pending if not job.future.done()]
        heapq.heapify(self._pending)
        if not worker.small_only:
            return heapq.heappop(self._pending) if self._pending else None
        small = [job for job in self._pending if job.small]
        if not small:
            return None
        job = min(small)
        self._pending.remove(job)
        heapq.heapify(self._pending)
        return job

    def _dispatch(self) -> None:
        for worker in sorted(self._idle, key=lambda w: not w.small_only):  # the reserved one first
            job = self._take(worker)
            if job is None:
                continue
            self._idle.remove(worker)
            self._loop.create_task(self._execute(worker, job))

    async def _execute(self, worker: Worker, job: _Job) -> None:
        try:
            answer = await self._loop.run_in_executor(self._threads, worker.call, job.name, job.args, self.timeout_s)
            self.stats.completed += 1
            if not answer[0] and isinstance(answer[1], JobUnreadable):
                answer = (False, item_error(job.index, 400, "cannot be read by a decode worker"))
        except JobNotSent as error:  # the worker never saw it, and stays
            logger.info("items[%d] cannot be sent to a decode worker: %s", job.index, error)
            answer = (False, item_error(job.index, 400, NOT_SENT))
        except WorkerTimeout:
            self.stats.timeouts += 1
            answer = (False, item_error(job.index, 413, f"took over decode_timeout_s={self.timeout_s} s to decode"))
            worker = await self._replace(worker)
        except (EOFError, OSError):
            self.stats.crashes += 1
            logger.warning("a decode worker died on items[%d]; replacing it", job.index)
            answer = (False, item_error(job.index, 400, "crashed the decoder and cannot be decoded"))
            worker = await self._replace(worker)
        except Exception as error:  # an answer we could not read: the worker's state is unknown
            self.stats.crashes += 1
            logger.exception("decode job for items[%d] failed in the pool", job.index)
            answer = (False, error)
            worker = await self._replace(worker)
        if not job.future.done():
            job.future.set_result(answer)
        if worker is not None:
            self._idle.append(worker)
        self._dispatch()

    async def _replace(self, worker: Worker) -> Worker | None:
        self._alive -= 1
        await self._loop.run_in_executor(self._threads, worker.kill)
        try:
            fresh = await self._loop.run_in_executor(self._threads, self._new_worker, worker.small_only)
        except Exception:
            logger.exception("could not replace a decode worker (%d of %d alive)", self._alive, self.size)
            if self._alive == 0:  # nobody will ever take the waiting jobs
                for job in self._pending:
                    if not job.future.done():
                        job.future.set_result((False, Overloaded("no decode worker is running")))
                self._pending.clear()
            return None
        self._alive += 1
        return fresh

    def describe(self) -> dict:
        return {
            "workers": self.size,
            "alive": self._alive,
            "idle": len(self._idle),
            "queued": len(self._pending),
            "completed": self.stats.completed,
            "timeouts": self.stats.timeouts,
            "crashes": self.stats.crashes,
            "refused": self.stats.refused,
            "template_restarts": self.stats.template_restarts,
            "template_pid": None if self._template is None else self._template.process.pid,
        }

    def close(self) -> None:
        for worker in self._idle:
            worker.kill()
        self._idle.clear()
        if self._template is not None:
            self._template.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
