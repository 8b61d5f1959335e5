"""The router's hold on the references it hands handle callers (a workaround for a Ray bug)."""

from __future__ import annotations

import asyncio

from deployments.ref_hold import ReferenceHold


def test_references_are_held_for_hold_s_then_released():
    async def scenario():
        hold = ReferenceHold(0.05)
        hold.hold(["a", "b"])
        await asyncio.sleep(0.02)
        hold.hold(["c"])
        held_early = len(hold)
        await asyncio.sleep(0.045)  # the first batch expired, the second not yet
        held_between = len(hold)
        await asyncio.sleep(0.05)
        return held_early, held_between, len(hold)

    assert asyncio.run(scenario()) == (3, 1, 0)


def test_zero_hold_keeps_nothing():
    async def scenario():
        hold = ReferenceHold(0)
        hold.hold(["a"])
        return len(hold)

    assert asyncio.run(scenario()) == 0
