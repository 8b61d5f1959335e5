"""The decode worker processes: run `media.inspect` and `media.decode` jobs sent by the router.

One template process per pool imports the libraries and builds the preprocessor; each worker is
forked from it (`template`). A worker answers one job at a time over its pipe: `(True, result)`
or `(False, RequestError)`. Results carry pixels as numpy arrays, not tensors, so they cross the
pipe as plain bytes (torch would hand tensors over through shared-memory file descriptors). Any
failure on an item's bytes, or in pickling its job or answer, is that item's 400; the worker
itself stays up. A worker that a job crashed or that ran past its time limit is replaced by the
pool.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection

import numpy as np
import torch

from models import load_preprocessor
from models.processing import VisionPreprocessor

from ..config import Limits
from ..errors import RequestError, item_error
from . import media
from .pool import JobUnreadable, WorkerSetup

logger = logging.getLogger(__name__)


@dataclass
class WorkerState:
    limits: Limits
    preprocessor: VisionPreprocessor
    model_id: str


@dataclass
class DecodedArrays:
    """`media.DecodedItem` as it crosses the pipe."""

    pixels: np.ndarray
    spec: media.ItemSpec
    key: bytes | None


def build_state(setup: WorkerSetup) -> WorkerState:
    model = setup.model
    _, preprocessor = load_preprocessor(model.preset, model.family, model.path)
    return WorkerState(setup.limits, preprocessor, model.model_id)


def inspect_job(state: WorkerState, raw: media.RawItem) -> media.Inspection:
    return media.inspect(raw, state.limits, state.preprocessor)


def content_key(model_id: str, modality: str, pixels: torch.Tensor) -> bytes:
    """The embedding cache's key of an item (see `deployments.router.cache`): a hash of its
    decoded pixels, their shape and modality, and `model_id` (prefixed with the request's scope)."""
    digest = hashlib.blake2b(digest_size=32)
    digest.update(f"{model_id}|{modality}|{tuple(pixels.shape)}|".encode())
    digest.update(memoryview(pixels.contiguous().numpy()).cast("B"))
    return digest.digest()


def decode_job(state: WorkerState, raw: media.RawItem, found: media.Inspection, key_prefix: str | None):
    """Decode and resize; `key_prefix` (None: no key) namespaces the content hash."""
    item = media.decode(raw, found, state.limits, state.preprocessor)
    key = None if key_prefix is None else content_key(key_prefix + state.model_id, item.spec.modality, item.pixels)
    return DecodedArrays(item.pixels.numpy(), item.spec, key)


JOBS = {"inspect": inspect_job, "decode": decode_job}


def _answer(state: WorkerState, name: str, args: tuple) -> tuple[bool, object]:
    try:
        return True, JOBS[name](state, *args)
    except RequestError as error:
        return False, error
    except Exception:  # a bug or a codec failure we did not foresee: the item's 400, logged here
        logger.exception("decode job %s failed", name)
        index = getattr(args[0], "index", 0)
        return False, item_error(index, 400, "cannot be decoded")


def _read(job: bytes) -> tuple[str, tuple] | None:
    """A job as the pool pickled it; None if it does not unpickle here."""
    try:
        return reduction.ForkingPickler.loads(job)
    except Exception:  # an object whose unpickling fails in this process: the item's fault
        logger.warning("a decode job could not be unpickled", exc_info=True)
        return None


def _pickled(answer: tuple[bool, object], args: tuple) -> bytes:
    """The answer as bytes for the pipe; an answer that does not pickle is the item's 400."""
    try:
        return reduction.ForkingPickler.dumps(answer)
    except Exception:  # what the job returned holds the item's own unpicklable object
        logger.warning("a decode job's answer could not be pickled", exc_info=True)
        refused = item_error(getattr(args[0], "index", 0), 400, "cannot be sent back from a decode worker")
        return reduction.ForkingPickler.dumps((False, refused))


def serve(state: WorkerState, jobs: Connection, answers: Connection) -> None:
    """Say ready, then answer jobs until the router closes the pipe. A job or an answer that does not
    pickle is answered as an error; the worker goes on."""
    answers.send((True, "ready"))
    while True:
        try:
            job = jobs.recv_bytes()
        except (EOFError, OSError):  # the router went away
            return
        read = _read(job)
        if read is None:
            answers.send((False, JobUnreadable()))
            continue
        name, args = read
        answers.send_bytes(_pickled(_answer(state, name, args), args))


def template(control_fd: int) -> None:
    """Import everything and build the state once, then fork a worker for each pair of pipe ends
    the pool sends over the control socket: a worker starts in milliseconds and shares the
    template's memory instead of importing torch and transformers again."""
    sock = socket.socket(fileno=control_fd)
    control = Connection(os.dup(control_fd))
    try:
        setup = control.recv()
    except (EOFError, OSError):  # the router went away before sending it
        return
    try:
        state = build_state(setup)
    except Exception as error:  # the router logs it and fails its start
        control.send((False, repr(error)))
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    control.send((True, "ready"))
    while True:
        try:
            jobs_fd, answers_fd = reduction.recvfds(sock, 2)
        except (EOFError, OSError, RuntimeError):  # the router went away
            return
        pid = os.fork()
        if pid == 0:  # the worker: nothing of the template but its state
            sock.close()
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                serve(state, Connection(jobs_fd, writable=False), Connection(answers_fd, readable=False))
            finally:
                os._exit(0)
        os.close(jobs_fd)
        os.close(answers_fd)
        control.send(pid)


def main(argv: list[str]) -> None:
    import torch

    torch.set_num_threads(1)  # one job at a time per worker, one core's worth
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    template(int(argv[1]))


if __name__ == "__main__":  # python -m deployments.decode.worker <control socket fd>
    # Run the imported module's copy, so that what it pickles names `deployments.decode.worker`.
    from deployments.decode.worker import main as module_main

    module_main(sys.argv)
