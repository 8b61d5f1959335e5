"""The decode pool's processes: workers forked from one template, replaced when a job outlives its
time limit, and a new template when the old one is gone; a job that cannot be pickled to a worker
or unpickled there fails its item and leaves the worker be; no credentials reach the workers."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import time

import numpy as np
import psutil
import pytest
from PIL import Image

from deployments.config import AppConfig
from deployments.decode.media import RawItem
from deployments.decode.pool import DecodePool, Template, WorkerSetup, worker_environment
from deployments.errors import RequestError


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


def heavy_png() -> bytes:
    """4000x4000 of gradients: its decode takes well over `SHORT_LIMIT_S` on any CPU."""
    y = np.linspace(0, 255, 4000, dtype=np.float32)[:, None]
    x = np.linspace(0, 255, 4000, dtype=np.float32)[None, :]
    rgb = np.stack(np.broadcast_arrays(x, y, (x + y) / 2), axis=-1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, "PNG")
    return buffer.getvalue()


SHORT_LIMIT_S = 0.02


def decode_over_the_limit(pool: DecodePool) -> RequestError:
    """Inspect a heavy image, then decode it under a time limit it cannot meet: the error."""

    async def both():
        raw = RawItem(0, "image", heavy_png())
        found = await pool.run("inspect", (raw,), 0)
        pool.timeout_s = SHORT_LIMIT_S
        try:
            await pool.run("decode", (raw, found, None), 0, pixels=found.source_pixels)
        finally:
            pool.timeout_s = 5.0

    with pytest.raises(RequestError) as refused:
        asyncio.run(both())
    return refused.value


def running(process: psutil.Process | int) -> bool:
    """Whether `process` is alive and not a zombie; one reaped between listing and reading is not."""
    try:
        process = psutil.Process(process) if isinstance(process, int) else process
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def live_children(pid: int, count: int, timeout_s: float = 10.0) -> set[int]:
    """The pids of `pid`'s children once exactly `count` are running (a killed one takes a moment)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {child.pid for child in psutil.Process(pid).children() if running(child)}
        if len(found) == count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_workers_are_forked_from_the_template_and_answer(pool):
    template = pool.describe()["template_pid"]
    assert pool.alive == 3 and len(live_children(template, 3)) == 3
    assert inspect(pool, png(64, 48)).spec.grid_thw[0] == 1


def test_a_job_over_its_time_limit_kills_its_worker_and_a_new_one_is_forked(pool):
    template = pool.describe()["template_pid"]
    before = live_children(template, 3)
    assert decode_over_the_limit(pool).status == 413
    after = live_children(template, 3)
    assert len(after) == 3 and len(after - before) == 1 and pool.describe()["timeouts"] == 1
    assert inspect(pool, png(32, 32)).spec.grid_thw[0] == 1


def test_a_new_template_starts_when_the_old_one_is_gone(pool):
    old = pool.describe()["template_pid"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while running(old):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert decode_over_the_limit(pool).status == 413  # its worker is replaced: from a new template
    stats = pool.describe()
    assert stats["template_restarts"] == 1 and stats["template_pid"] != old and pool.alive == 3
    assert inspect(pool, png(32, 32)).spec.grid_thw[0] == 1


def test_a_pool_starts_from_a_template_spawned_before_it():
    """The router spawns the template first and hands it to its pool once its own imports are done."""
    config = AppConfig()
    template = Template.spawn()
    pool = DecodePool(WorkerSetup(config.model, config.limits), workers=1, timeout_s=5.0, max_queued=16)
    try:
        pool.start(template)
        assert pool.describe()["template_pid"] == template.process.pid and pool.alive == 2
        assert inspect(pool, png(32, 32)).spec.grid_thw[0] == 1
    finally:
        pool.close()


def test_a_template_gone_before_its_setup_fails_the_start():
    config = AppConfig()
    template = Template.spawn()
    template.process.kill()
    pool = DecodePool(WorkerSetup(config.model, config.limits), workers=1, timeout_s=5.0, max_queued=16)
    with pytest.raises(RuntimeError, match="decode worker template failed to start"):
        pool.start(template)
    assert template.process.poll() is not None


def test_a_router_whose_setup_fails_leaves_no_decode_template(monkeypatch):
    """The router's background setup spawns the decode template first; if the encode path then fails
    to start, the template is killed rather than left running without a router, the error is kept
    for Serve's health check (which then replaces the replica), and the destructor still runs."""
    import threading

    from deployments.app import deployment_ladder
    from deployments.router import ingress, service

    spawned: list[Template] = []
    spawn = Template.spawn

    def recorded() -> Template:
        spawned.append(spawn())
        return spawned[-1]

    def no_encode_path(*args, **kwargs):
        raise RuntimeError("no encode path here")

    monkeypatch.setattr(Template, "spawn", recorded)  # the class, not `ingress.Template`: Serve copies the globals
    monkeypatch.setattr(service, "EncodeService", no_encode_path)
    config = AppConfig()
    instance = object.__new__(ingress.EncoderRouter)
    instance.config, instance.encoder, instance.llm, instance.fleet, instance.metrics = config, None, None, None, None
    instance.service, instance.setup_error, instance._ready = None, None, threading.Event()
    instance._set_up(deployment_ladder(config))
    assert instance._ready.is_set() and "no encode path here" in instance.setup_error
    assert len(spawned) == 1 and spawned[0].process.poll() is not None
    with pytest.raises(RuntimeError, match="no encode path here"):
        instance.check_health()
    asyncio.run(instance.__del__())  # Serve's ingress makes it a coroutine; nothing the setup missed


def refuse_to_unpickle():
    raise ValueError("not rebuilt in a decode worker")


class UnpicklesNowhere:
    """Pickles, but unpickling it raises (in a decode worker: after the job was sent)."""

    def __reduce__(self):
        return (refuse_to_unpickle, ())


def test_a_job_that_does_not_pickle_is_its_items_400_and_no_worker_is_replaced(pool):
    class Local(Image.Image):  # a class defined in a function: plain pickle cannot name it
        pass

    image = Image.new("RGB", (64, 48))
    image.__class__ = Local
    template = pool.describe()["template_pid"]
    before = live_children(template, 3)
    with pytest.raises(RequestError) as refused:
        asyncio.run(pool.run("inspect", (RawItem(2, "image", image),), 2))
    assert refused.value.status == 400 and refused.value.param == "items[2]"
    assert "does not pickle" in refused.value.message
    assert live_children(template, 3) == before and pool.describe()["crashes"] == 0
    assert inspect(pool, png(32, 32)).spec.grid_thw[0] == 1


def test_a_job_that_does_not_unpickle_in_its_worker_is_its_items_400_and_the_worker_stays(pool):
    template = pool.describe()["template_pid"]
    before = live_children(template, 3)
    with pytest.raises(RequestError) as refused:
        asyncio.run(pool.run("inspect", (RawItem(1, "image", UnpicklesNowhere()),), 1, small=True))
    assert refused.value.status == 400 and refused.value.param == "items[1]"
    assert "cannot be read by a decode worker" in refused.value.message
    assert live_children(template, 3) == before and pool.describe()["crashes"] == 0
    assert inspect(pool, png(32, 32)).spec.grid_thw[0] == 1


def test_a_worker_environment_keeps_paths_and_locale_and_drops_the_rest():
    parent = {
        "PATH": "/usr/bin",
        "HOME": "/home/someone",
        "LC_ALL": "C.UTF-8",
        "HF_HOME": "/cache/hf",
        "HF_TOKEN": "hf_secret",
        "RAY_AUTH_TOKEN": "secret",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "OMP_NUM_THREADS": "16",
        "PYTHONPATH": "/elsewhere",
    }
    assert worker_environment(parent, ["", "/code", "/site"]) == {
        "PATH": "/usr/bin",
        "HOME": "/home/someone",
        "LC_ALL": "C.UTF-8",
        "HF_HOME": "/cache/hf",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(["/code", "/site"]),
    }


def test_the_template_and_its_workers_run_without_the_routers_credentials(monkeypatch):
    secrets = {"HF_TOKEN": "hf_pool_test", "RAY_AUTH_TOKEN": "pool-test", "AWS_SECRET_ACCESS_KEY": "pool-test"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    config = AppConfig()
    pool = DecodePool(WorkerSetup(config.model, config.limits), workers=1, timeout_s=5.0, max_queued=16)
    try:
        pool.start()
        template = pool.describe()["template_pid"]
        processes = [template, *live_children(template, 2)]
        assert len(processes) == 3 and inspect(pool, png(32, 32)).spec.grid_thw[0] == 1
        for pid in processes:
            assert not set(secrets) & set(psutil.Process(pid).environ()), pid
    finally:
        pool.close()
