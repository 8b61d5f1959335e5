"""The tests' virtual-clock event loop: timers fire in order at their virtual times (hours of them in no wall time),
and a wait nothing can end fails instead of hanging."""

from __future__ import annotations

import asyncio

import pytest

from tests.virtual_clock import run_virtual


def test_timers_fire_in_order_at_their_virtual_times_without_waiting():
    async def main():
        loop = asyncio.get_running_loop()
        fired = []
        for delay in (3600.0, 0.5, 60.0):
            loop.call_later(delay, lambda delay=delay: fired.append((delay, loop.time())))
        await asyncio.sleep(7200)
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.Event().wait(), 10)
        except asyncio.TimeoutError:
            timed_out = True
        return fired, timed_out, loop.time()

    fired, timed_out, now = run_virtual(main())
    assert [delay for delay, _ in fired] == [0.5, 60.0, 3600.0]
    assert [at for _, at in fired] == pytest.approx([0.5, 60.0, 3600.0], abs=1e-5)
    assert timed_out and now == pytest.approx(7210.0, abs=1e-5)


def test_a_wait_nothing_can_end_fails_instead_of_hanging():
    async def main():
        await asyncio.get_running_loop().create_future()

    with pytest.raises(RuntimeError, match="wait forever"):
        run_virtual(main())
