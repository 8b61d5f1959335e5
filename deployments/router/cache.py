"""Embedding cache (LRU, bounded in bytes) and in-flight dedup of identical items.

The key is a content hash of the decoded, resized pixels (what the tower actually sees), their
shape and modality, and the model id (`deployments.decode.worker.content_key`, made where the
pixels are), under the request's scope (`cache_scope`: its tenant and salt): two files that decode
to the same pixels share an entry within a scope; the same image resized differently does not, nor
the same image sent by another tenant. Identical items that are in flight at the same time are
encoded once: later requests await the first one's future.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from typing import Any


def cache_scope(sharing: str, tenant: str | None, salt: str | None) -> str | None:
    """The key prefix of a request's cache entries and in-flight dedup: requests share results only
    within one scope. "tenant": one scope per tenant (the credential a request presented; for handle
    callers, the cluster) and salt, and none for a request with neither (no cache). "shared": one
    scope for all requests, split by salt only. Pure."""
    if sharing == "shared":
        tenant = ""
    elif tenant is None and salt is None:
        return None
    digest = hashlib.blake2b(repr((tenant, salt)).encode(), digest_size=16)
    return digest.hexdigest() + "|"


class EmbeddingCache:
    """LRU of encoded items (references into the encoder replicas' object stores) whose total size
    never exceeds `max_bytes`. An entry made by a replica that died is dropped (`forget_replica`):
    its objects went with it."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[bytes, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes):
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return value

    def peek(self, key: bytes):
        """The entry, without counting a hit or a miss or refreshing its place."""
        return self._entries.get(key)

    def put(self, key: bytes, value) -> None:
        """Store `value` (with `nbytes` and `replica` attributes), evicting least recently used ones."""
        if value.nbytes > self.max_bytes or key in self._entries:
            return
        while self.bytes + value.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = value
        self.bytes += value.nbytes

    def _drop(self, key: bytes) -> None:
        self.bytes -= self._entries.pop(key).nbytes

    def forget(self, key: bytes) -> None:
        if key in self._entries:
            self._drop(key)

    def replicas(self) -> set[str]:
        """The replicas whose results the entries hold."""
        return {value.replica for value in self._entries.values()}

    def forget_replica(self, replica: str) -> None:
        for key in [k for k, v in self._entries.items() if v.replica == replica]:
            self._drop(key)


class InflightTable:
    """Futures of items being encoded, shared by every request that asks for the same content."""

    def __init__(self):
        self._futures: dict[bytes, asyncio.Future] = {}
        self._waiters: dict[bytes, int] = {}
        self.joined = 0
        """Requests that found their item already in flight and waited for it instead."""

    def join(self, key: bytes) -> asyncio.Future | None:
        """The in-flight future for `key`, or None when there is none worth waiting for.

        A future that just succeeded is still returned: its done-callbacks (this table's `_forget`
        and the router's cache `put`) run one loop turn later, and a request served in that turn
        would otherwise find neither the table entry nor the cache entry and encode again."""
        future = self._futures.get(key)
        if future is None or (future.done() and (future.cancelled() or future.exception() is not None)):
            return None
        self._waiters[key] += 1
        self.joined += 1
        return future

    def start(self, key: bytes, future: asyncio.Future) -> None:
        self._futures[key] = future
        self._waiters[key] = 1
        future.add_done_callback(lambda _: self._forget(key, future))

    def leave(self, key: bytes, future: asyncio.Future) -> bool:
        """One waiter of `future` is gone; True when nobody waits for it any more (it may be dropped).
        A finished future's entry may already belong to a newer future of the same key: untouched."""
        if self._futures.get(key) is not future:
            return True
        self._waiters[key] -= 1
        return self._waiters[key] <= 0

    def _forget(self, key: bytes, future: asyncio.Future) -> None:
        if self._futures.get(key) is future:
            del self._futures[key]
            del self._waiters[key]
