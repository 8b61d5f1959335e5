"""Samplers over a benchmark point: each GPU's utilisation and memory (nvidia-smi), and the host
cores busy less the client processes' (the servers' share, which GPU utilisation does not show)."""

from __future__ import annotations

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
