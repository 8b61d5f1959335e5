"""Test session setup: GPU tests skip without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
