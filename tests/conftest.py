"""Test session setup: tests that start Ray and Serve are marked `serve`; GPU tests skip without CUDA."""

from __future__ import annotations

import os
import sys

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


SERVE_FIXTURES = {"serve_harness"}
"""Fixtures that start Ray and Serve: a test that needs one, itself or through another fixture, is
marked `serve`, so `-m "not serve"` runs the unit tests alone."""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if SERVE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.serve)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@pytest.fixture(autouse=True)
def _serve_marker_is_honest(request):
    """A test that starts Ray without the `serve` marker fails, so that `-m "not serve"` stays free
    of Ray (one that starts it some other way than `SERVE_FIXTURES` marks itself)."""
    running = _ray_running()
    yield
    if not running and _ray_running() and request.node.get_closest_marker("serve") is None:
        pytest.fail("this test started Ray: mark it `serve` (or use the `serve_harness` fixture)")


@pytest.fixture(scope="session")
def serve_harness():
    """One Ray cluster and Serve instance for the whole session (started on first use)."""
    from tests.serve_harness import ServeHarness

    harness = ServeHarness()
    yield harness
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_vllm_checkpoint(tmp_path_factory) -> str:
    """The tiny vLLM-shaped Qwen3-VL checkpoint, written by the README's command
    (`python -m models.tiny_checkpoint qwen3-vl DIR --for-vllm`)."""
    import subprocess
    import sys

    directory = tmp_path_factory.mktemp("tiny-qwen3-vl-vllm") / "tiny-qwen3-vl-vllm"
    command = [sys.executable, "-m", "models.tiny_checkpoint", "qwen3-vl", str(directory), "--for-vllm"]
    subprocess.run(command, check=True, timeout=300)
    return str(directory)


SHARED_APPS = {"encoder"}
"""Applications many test modules use as is (`configs/local.yaml`): kept for the whole session."""


@pytest.fixture(autouse=True, scope="module")
def _remove_module_apps():
    """Delete the applications a test module deployed once it is done: a session that kept every
    one alive (each is a router, its decode workers and replicas) filled the 24 GB CI machine."""
    from tests.serve_harness import ServeHarness

    before = set(ServeHarness.current.apps) if ServeHarness.current else set()
    yield
    harness = ServeHarness.current
    if harness is not None:
        for name in set(harness.apps) - before - SHARED_APPS:
            harness.remove(name)
