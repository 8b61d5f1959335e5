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
