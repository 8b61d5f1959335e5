"""How long a replica process took to reach its constructor, for startup logs and `/v1/models`."""

from __future__ import annotations

import time
from typing import NamedTuple

import psutil

from . import IMPORTED_AT


class BeforeConstructor(NamedTuple):
    process_s: float
    """Since the worker process started (Ray may start it idle, before it is given the replica)."""
    imports_s: float
    """Since this process first imported `deployments`: the deployment's imports."""


def before_constructor() -> BeforeConstructor:
    """Seconds a cold start paid in this process before the replica's own stages began."""
    now = time.time()
    return BeforeConstructor(max(0.0, now - psutil.Process().create_time()), max(0.0, now - IMPORTED_AT))
