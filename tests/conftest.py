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
