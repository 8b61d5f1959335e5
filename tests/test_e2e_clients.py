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
