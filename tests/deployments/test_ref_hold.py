"""The router's hold on the references it hands handle callers (a workaround for a Ray bug)."""

from __future__ import annotations

import asyncio

import pytest

from deployments.ref_hold import ReferenceHold


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
    assert asyncio.run(scenario(0.4)) == (3, 1, 0)


def test_every_batch_is_released_under_uvloop():
    """Ray's workers run uvloop, whose millisecond timers may fire a little early."""
    uvloop = pytest.importorskip("uvloop")
    assert uvloop.run(scenario(0.4)) == (3, 1, 0)


def test_zero_hold_keeps_nothing():
    async def scenario():
        hold = ReferenceHold(0)
        hold.hold(["a"])
        return len(hold)

    assert asyncio.run(scenario()) == 0
