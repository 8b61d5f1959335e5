"""Prefaulting the object store's mapping (deployments/object_store.py) in a real Ray worker."""

import errno

import numpy as np
import pytest
import ray

from deployments.object_store import prefault, store_mappings

MAPS = (
    "55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]\n"
    "7f4cc10b9000-7f4e410b9000 rw-s 00000000 00:1b 288                        /dev/shm/plasmafZDSbw (deleted)\n"
    "7f4e50000000-7f4e50021000 rw-s 00000000 08:01 1234                       /tmp/plasma_on_disk (deleted)\n"
    "7ffd3b9f0000-7ffd3ba11000 rw-p 00000000 00:00 0                          [stack]\n"
)


def test_only_the_shared_memory_store_is_found():
    assert store_mappings(MAPS) == [(0x7F4CC10B9000, 0x7F4E410B9000)]


def resident_kib() -> int:
    """KiB of the object store's mapping resident in this process's page tables."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split()[0]:
                inside = "/dev/shm/plasma" in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@ray.remote(num_cpus=0)
class Fresh:
    """A new worker process: none of the store's pages mapped by earlier tests."""

    def prefault(self, limit: int) -> tuple[int, int, int] | int:
        """(bytes prefaulted, resident KiB before and after), or the errno of an OSError."""
        before = resident_kib()
        try:
            done = prefault(limit_bytes=limit)
        except OSError as error:
            return error.errno or -1
        return done.bytes, before, resident_kib()


def test_prefault_maps_the_pages_and_leaves_objects_as_they_were(serve_harness):
    data = np.arange(1 << 20, dtype=np.int64)  # 8 MiB: in the object store, not inline
    ref = ray.put(data)
    limit = 64 << 20
    worker = Fresh.remote()
    try:
        answer = ray.get(worker.prefault.remote(limit))
    finally:
        ray.kill(worker)
    if answer == errno.EINVAL:
        pytest.skip("the kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    if isinstance(answer, int):
        pytest.skip("Ray's object store is not in /dev/shm here")
    done, before, after = answer
    assert done == limit and after - before >= (limit >> 10) - 2048  # pages it had mapped count once
    assert np.array_equal(ray.get(ref), data)
