"""A process's age (deployments/process.py), read in a fresh interpreter whose age is known."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from deployments.process import process_age_s


def test_a_fresh_process_knows_how_long_it_has_lived():
    code = "import time; time.sleep(1.5); from deployments.process import process_age_s; print(process_age_s())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1.5 <= age < 15  # the sleep, plus the interpreter's start and the import


def test_it_agrees_with_psutil_to_its_resolution():
    assert abs(process_age_s() - (time.time() - psutil.Process().create_time())) < 1.1  # whole-second boot time
