"""Prefaulting the object store's mapping (deployments/object_store.py) in a real Ray worker."""

import numpy as np
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


@ray.remote
def prefault_and_read(before: ray.ObjectRef, limit: int) -> tuple[int, int, int]:
    """(bytes prefaulted, KiB of the store's mapping resident in this process before and after)."""

    def resident_kib() -> int:
        total, inside = 0, False
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                if "-" in line.split()[0]:
                    inside = "/dev/shm/plasma" in line
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1])
        return total

    first = resident_kib()
    done = prefault(limit_bytes=limit)
    return done.bytes, first, resident_kib()


def test_prefault_maps_the_pages_and_leaves_objects_as_they_were(serve_harness):
    data = np.arange(1 << 20, dtype=np.int64)  # 8 MiB: in the object store, not inline
    ref = ray.put(data)
    limit = 64 << 20
    done, before, after = ray.get(prefault_and_read.remote(ref, limit))
    assert done == limit and after - before >= (limit >> 10) - 8 * 1024  # pages already mapped count once
    assert np.array_equal(ray.get(ref), data)
