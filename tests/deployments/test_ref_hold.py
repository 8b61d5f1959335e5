"""The router's hold on the references it hands handle callers (a workaround for a Ray bug)."""

from __future__ import annotations

import asyncio

import pytest

from deployments.router.ref_hold import ReferenceHold
from tests.virtual_clock import run_virtual


async def scenario(hold_s: float) -> tuple[int, int, int]:
    hold = ReferenceHold(hold_s)
    hold.hold(["a", "b"])
    await asyncio.sleep(hold_s / 2)
    hold.hold(["c"])
    early = len(hold)
    await asyncio.sleep(hold_s * 0.75)  # the first batch is due, the second not yet
    between = len(hold)
    await asyncio.sleep(hold_s)
    return early, between, len(hold)


def test_references_are_held_for_hold_s_then_released():
    """On the virtual clock: each batch goes exactly `hold_s` after it came, however loaded the machine."""
    assert run_virtual(scenario(4.0)) == (3, 1, 0)


def test_every_batch_is_released_under_uvloop():
    """Ray's workers run uvloop, whose millisecond timers may fire a little early: every batch is
    still released (uvloop's clock is real, so this checks only that they all go, never when)."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario(hold_s: float) -> tuple[int, int]:
        hold = ReferenceHold(hold_s)
        hold.hold(["a", "b"])
        await asyncio.sleep(hold_s / 2)
        hold.hold(["c"])
        held = len(hold)
        while len(hold):  # each release is due `hold_s` after its hold; a late one only slows this
            await asyncio.sleep(hold_s / 4)
        return held, len(hold)

    assert uvloop.run(asyncio.wait_for(scenario(0.2), 120)) == (3, 0)


def test_zero_hold_keeps_nothing():
    async def scenario():
        hold = ReferenceHold(0)
        hold.hold(["a"])
        return len(hold)

    assert asyncio.run(scenario()) == 0
