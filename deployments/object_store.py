"""Prefaulting this process's mapping of Ray's object store.

Ray maps the node's object store (a deleted file under /dev/shm) into every worker, and its
allocator spreads objects over the whole store before it reuses memory, so until a process has
touched every page, its `ray.put` takes a page fault per 4 KiB written. `prefault` maps the pages
in bulk (`madvise(MADV_POPULATE_WRITE)`, Linux 5.14+), which leaves their contents as they are.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass

MADV_POPULATE_WRITE = 23
CHUNK_BYTES = 256 << 20
"""Bytes per `madvise` call: a stop request waits for at most one."""
STORE_PREFIX = "/dev/shm/plasma"
"""Where Ray puts the store's file; one it had to put elsewhere (a small /dev/shm) is on disk, left alone."""


@dataclass(frozen=True)
class Prefaulted:
    bytes: int
    seconds: float
    complete: bool
    """False where `stop` ended it early."""


def store_mappings(maps: str) -> list[tuple[int, int]]:
    """The (start, end) addresses of the object store's mappings in a `/proc/<pid>/maps` text."""
    found = []
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith(STORE_PREFIX):
            start, end = (int(address, 16) for address in fields[0].split("-"))
            found.append((start, end))
    return found


def prefault(limit_bytes: int | None = None, stop: threading.Event | None = None) -> Prefaulted:
    """Map every page of this process's object-store mappings (at most `limit_bytes` of them),
    a chunk at a time until `stop` is set. OSError where the kernel cannot (before 5.14) or the
    store is not in /dev/shm (Ray not initialized here, or it put the store on disk)."""
    ranges = _mapped()
    if not ranges:  # Ray maps the store on a process's first object in it
        import numpy as np
        import ray

        ray.put(np.empty(1 << 20, np.uint8))  # too large to be kept inline
        ranges = _mapped()
    if not ranges:
        raise OSError("no object store in /dev/shm mapped in this process")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    left = sum(end - start for start, end in ranges) if limit_bytes is None else limit_bytes
    done, began = 0, time.perf_counter()
    for start, end in ranges:
        for chunk in range(start, end, CHUNK_BYTES):
            size = min(CHUNK_BYTES, end - chunk, left - done)
            if size <= 0 or (stop is not None and stop.is_set()):
                return Prefaulted(done, time.perf_counter() - began, size <= 0)
            if libc.madvise(chunk, size, MADV_POPULATE_WRITE) != 0:  # ctypes releases the GIL meanwhile
                errno = ctypes.get_errno()
                raise OSError(errno, f"madvise(MADV_POPULATE_WRITE) on the object store: {os.strerror(errno)}")
            done += size
    return Prefaulted(done, time.perf_counter() - began, True)


def _mapped() -> list[tuple[int, int]]:
    with open("/proc/self/maps") as maps:
        return store_mappings(maps.read())
