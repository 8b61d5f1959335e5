"""How long a replica process took to reach its constructor, for startup logs and `/v1/models`."""

from __future__ import annotations

import os
import time
from typing import NamedTuple

import psutil

from . import IMPORTING_SINCE


class BeforeConstructor(NamedTuple):
    imports_s: float
    """The deployment module's imports (torch, transformers, model code), from the package's first import."""
    setup_s: float
    """From the end of those imports to the constructor: Serve's replica setup."""
    process_s: float
    """Since the worker process started (Ray may start it idle, before it is given the replica)."""


def before_constructor(imported: float) -> BeforeConstructor:
    """Seconds this process spent before a replica's own stages; `imported` is the
    `time.monotonic()` at the end of the deployment module's imports."""
    now = time.monotonic()
    return BeforeConstructor(max(0.0, imported - IMPORTING_SINCE), max(0.0, now - imported), process_age_s())


def process_age_s() -> float:
    """Seconds since this process started: from the kernel's start time in clock ticks since boot
    where there is /proc (psutil's wall-clock form is off by up to a second), else psutil's."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return max(0.0, time.time() - psutil.Process().create_time())
