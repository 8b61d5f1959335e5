"""`benchmarks/common/clients.py`'s client processes: `--client-niceness` raises their nice value (as
Ray's workers are raised to 15), and 0 leaves it as this process's."""

from __future__ import annotations

import os

import pytest

from benchmarks.common.clients import ClientPool
from benchmarks.common.cpu import Window


def _report_niceness(_tag: str):
    def run(concurrency: int, seconds: float, offset: int) -> list:
        return [os.getpriority(os.PRIO_PROCESS, 0)] * concurrency

    return run, None


@pytest.mark.parametrize("niceness", [0, 5])
def test_client_processes_run_at_the_asked_niceness(niceness):
    pool = ClientPool(_report_niceness, ("x",), 2, [], niceness)
    try:
        samples, _ = pool.load(2, 0.1, Window())
    finally:
        pool.close()
    assert samples == [os.getpriority(os.PRIO_PROCESS, 0) + niceness] * 2


def _sleepy_setup(pause_s: float):
    """A client process whose calls each take `pause_s`, through the handle's closed loop."""
    import asyncio

    import deployments.errors  # noqa: F401 - as the real setups do: imported before the clock starts
    from benchmarks.common.clients import handle_load

    async def call(items: list) -> int:
        await asyncio.sleep(pause_s)
        return len(items)

    def run(concurrency: int, seconds: float, offset: int, active=None) -> list:
        return asyncio.run(handle_load(call, [[1], [1, 2]], concurrency, seconds, offset, active))

    return run, None


def test_a_schedule_holds_callers_back_until_its_step_and_never_runs_more_than_it_asks():
    import time

    from benchmarks.common.schedule import parse_schedule

    schedule = parse_schedule("0:0,1:0,1:3,2:3,2:1,3:1")
    pool = ClientPool(_sleepy_setup, (0.05,), 2, [])
    try:
        samples = pool.run_schedule(schedule, time.time() + 0.5)
    finally:
        pool.close()
    assert samples and all(start >= 1.0 for start, *_ in samples)  # none sent before the step
    assert {s[3] for s in samples} == {200}

    def running(at: float, after: float = 0.0) -> int:
        return sum(1 for start, end, *_ in samples if after <= start <= at < end)

    assert all(running(s[0]) <= 3 for s in samples)
    late = [s[0] for s in samples if s[0] >= 2.01]  # sent after the step down to one caller
    assert all(running(start, after=2.01) == 1 for start in late)
