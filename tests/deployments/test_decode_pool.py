"""The decode pool's processes: workers forked from one template, replaced when a job outlives its
time limit, and a new template when the old one is gone."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import time

import psutil
import pytest
from PIL import Image

from deployments.config import AppConfig
from deployments.decode_pool import DecodePool
from deployments.decode_worker import WorkerSetup
from deployments.errors import RequestError
from deployments.media import RawItem


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture
def pool():
    config = AppConfig()
    decode_pool = DecodePool(WorkerSetup(config.model, config.limits), workers=2, timeout_s=5.0, max_queued=16)
    decode_pool.start()
    yield decode_pool
    decode_pool.close()


def inspect(pool: DecodePool, data: bytes):
    return asyncio.run(pool.run("inspect", (RawItem(0, "image", data),), 0, small=True))


def children(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children()


def test_workers_are_forked_from_the_template_and_answer(pool):
    template = pool.describe()["template_pid"]
    assert pool.alive == 3 and len(children(template)) == 3
    assert inspect(pool, png(64, 48)).spec.grid_thw[0] == 1


def test_a_job_over_its_time_limit_kills_its_worker_and_a_new_one_is_forked(pool):
    template = pool.describe()["template_pid"]
    before = {p.pid for p in children(template)}
    pool.timeout_s = 1e-4  # every job is now over its limit
    with pytest.raises(RequestError) as refused:
        inspect(pool, png(64, 48))
    assert refused.value.status == 413
    pool.timeout_s = 5.0
    after = {p.pid for p in children(template)}
    assert len(after) == 3 and len(after - before) == 1 and pool.describe()["timeouts"] == 1
    assert inspect(pool, png(32, 32)).spec.grid_thw[0] == 1


def test_a_new_template_starts_when_the_old_one_is_gone(pool):
    old = pool.describe()["template_pid"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(old) and psutil.Process(old).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pool.timeout_s = 1e-4  # the worker that times out is replaced: from a new template
    with pytest.raises(RequestError):
        inspect(pool, png(64, 48))
    pool.timeout_s = 5.0
    stats = pool.describe()
    assert stats["template_restarts"] == 1 and stats["template_pid"] != old and pool.alive == 3
    assert inspect(pool, png(32, 32)).spec.grid_thw[0] == 1
