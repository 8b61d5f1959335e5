"""An asyncio event loop on a virtual clock, for tests of code that waits on the loop's timers.

Its clock (`loop.time()`, which `call_later`, `asyncio.sleep` and `wait_for` read) moves only when
nothing is ready to run: it then jumps just past the next timer (`OVERSHOOT_S`) instead of waiting
for it. Timers fire in their order and a test takes no wall time for them, however loaded the
machine is. A test that would wait forever (nothing ready, no timer) fails at once instead.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

OVERSHOOT_S = 1e-6
"""How far past a timer a jump lands: code that sets a timer for a deadline and then compares its
clock with that deadline sees it passed, whatever the float rounding of `now + (deadline - now)`
(a real clock is always a little late too)."""


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without blocking; where the loop would block for `timeout`, moves the clock by it."""

    def __init__(self):
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None):
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("nothing is ready to run and no timer is set: the test would wait forever")
        self.now += timeout + OVERSHOOT_S
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        self._jumping = _JumpingSelector()
        super().__init__(self._jumping)

    def time(self) -> float:
        return self._jumping.now


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on a `VirtualClockLoop`: the tasks left over are cancelled at the end."""
    loop = VirtualClockLoop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
