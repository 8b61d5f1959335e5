"""Samplers over a benchmark point: each GPU's utilisation and memory (nvidia-smi), one GPU's SM clock
and board power over chosen windows, and the host cores busy less the client processes' (the servers'
share, which GPU utilisation does not show)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import numpy as np


class GpuSampler:
    """Each GPU's utilisation and memory, from nvidia-smi every 0.5 s, while running."""

    def __init__(self):
        self.samples: list[list[float]] = []
        if shutil.which("nvidia-smi") is None:  # no GPU here: no samples
            self.process = subprocess.Popen(["sleep", "0"], stdout=subprocess.PIPE, text=True)
            return
        self.process = subprocess.Popen(
            [
                "nvidia-smi",
                "--query-gpu=index,utilization.gpu,memory.used",
                "--format=csv,noheader,nounits",
                "-lms",
                "500",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                self.samples.append([float(v) for v in line.split(",")])
            except ValueError:
                pass

    def stop(self) -> dict:
        self.process.terminate()
        self.process.wait(timeout=10)
        samples = list(self.samples)  # the point's: lines read after this are not counted
        gpus = sorted({int(s[0]) for s in samples})
        return {
            f"gpu{g}": {
                "util_pct": round(float(np.mean([s[1] for s in samples if s[0] == g])), 1),
                "mem_gib": round(max(s[2] for s in samples if s[0] == g) / 1024, 1),
            }
            for g in gpus
        }


def clock_summary(samples: list[tuple[float, float, float]], windows: list[tuple[float, float]]) -> dict | None:
    """Mean SM clock (MHz) and board power (W) of the `(time, mhz, watts)` samples inside any of the
    `(start, end)` windows, and how many there were; None where none fell inside."""
    inside = [s for s in samples if any(start <= s[0] <= end for start, end in windows)]
    if not inside:
        return None
    return {
        "sm_mhz": round(float(np.mean([s[1] for s in inside])), 1),
        "power_w": round(float(np.mean([s[2] for s in inside])), 1),
        "samples": len(inside),
    }


class ClockSampler:
    """One GPU's SM clock and board power from nvidia-smi every 50 ms, stamped with `time.monotonic()`:
    a kernel that runs slower under one system than another at the same launch counts shows here
    whether the GPU ran at a lower clock (its power cap) or did more work."""

    def __init__(self, index: int | None = None):
        if index is None:  # the first visible GPU: nvidia-smi counts all of the host's
            first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
            index = int(first) if first.isdigit() else 0
        self.samples: list[tuple[float, float, float]] = []
        self.process = None
        if shutil.which("nvidia-smi") is None:  # no GPU here: no samples
            return
        self.process = subprocess.Popen(
            [
                "nvidia-smi",
                f"--id={index}",
                "--query-gpu=clocks.sm,power.draw",
                "--format=csv,noheader,nounits",
                "-lms",
                "50",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                mhz, watts = (float(v) for v in line.split(","))
            except ValueError:  # "[N/A]" or a partial line
                continue
            self.samples.append((time.monotonic(), mhz, watts))

    def summary(self, windows: list[tuple[float, float]]) -> dict | None:
        return clock_summary(list(self.samples), windows)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)


class CpuSampler:
    """Host CPU cores busy over a rate, less what the client processes used: the servers' share (their
    HTTP front, image processing, schedulers), which GPU utilisation does not show."""

    def __init__(self, clients: list[int]):
        import psutil

        self.processes = [psutil.Process(pid) for pid in clients]
        self.start = (time.monotonic(), self._busy(psutil.cpu_times()), self._clients())

    @staticmethod
    def _busy(times) -> float:
        """Busy seconds of all cores (Linux's guest time is inside `user` already: not added again)."""
        return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))

    def _clients(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self.processes)

    def stop(self) -> dict:
        import psutil

        began, busy, clients = self.start
        seconds = time.monotonic() - began
        host = (self._busy(psutil.cpu_times()) - busy) / seconds
        client = (self._clients() - clients) / seconds
        return {"host_cores": round(host, 1), "client_cores": round(client, 1), "server_cores": round(host - client, 1)}
