"""Keeps the references the handle path hands out alive in the router for a few seconds.

Serve answers every handle call through a streaming generator (`handle_request_with_rejection`),
and Ray can lose the count of an ObjectRef nested in a generator's yield when a third worker owns
it (ray-project/ray#58080; the fix, #58082, is not merged in Ray 2.60): the encoder replica, which
owns the embeddings, is told nobody holds one while the caller has not yet read the router's
answer, frees it, and the caller's read fails with "already deleted by the reference counting
protocol". While the router still holds its own reference, the owner asks nobody; after `hold_s`
the caller has read the answer and borrows the reference itself, so the release is counted right.
"""

from __future__ import annotations

import asyncio
import collections


class ReferenceHold:
    """References kept for `hold_s` seconds after they were handed out (0: none kept)."""

    def __init__(self, hold_s: float):
        self.hold_s = hold_s
        self._held: collections.deque[list] = collections.deque()

    def hold(self, refs: list) -> None:
        if self.hold_s <= 0 or not refs:
            return
        self._held.append(refs)
        # One release per hold, all after the same delay: they run in the order the holds came,
        # so each drops the oldest batch (no clock comparison, which uvloop's millisecond timers
        # can fire just short of).
        asyncio.get_running_loop().call_later(self.hold_s, self._held.popleft)

    def __len__(self) -> int:
        return sum(len(refs) for refs in self._held)
