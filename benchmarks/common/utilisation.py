"""Samplers over a benchmark point: each GPU's utilisation and memory (nvidia-smi), one GPU's SM clock
and board power over chosen windows, and the host cores busy less the client processes' (the servers'
share, which GPU utilisation does not show)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence

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


CLOCK_QUERIES = (
    "clocks.sm,power.draw.instant,clocks_event_reasons.sw_power_cap",  # the power now; the power cap's clock flag
    "clocks.sm,power.draw",  # drivers without those fields: power averaged over about a second
)
"""nvidia-smi's fields for `ClockSampler`, the first the GPU's driver answers."""


def parse_clock_line(line: str) -> tuple[float, float, float | None] | None:
    """`(SM MHz, watts, 1.0 where the power cap holds the clock down, 0.0 where not, None unknown)` from
    one line of nvidia-smi's CSV; None for a line without numbers ("[N/A]", a partial line)."""
    parts = [part.strip() for part in line.split(",")]
    try:
        mhz, watts = float(parts[0]), float(parts[1])
    except (ValueError, IndexError):
        return None
    capped = {"Active": 1.0, "Not Active": 0.0}.get(parts[2]) if len(parts) > 2 else None
    return mhz, watts, capped


def clock_summary(
    samples: list[tuple[float, float, float, float | None]], windows: list[tuple[float, float]]
) -> dict | None:
    """Mean SM clock (MHz) and power (W) of the `(time, mhz, watts, capped)` samples inside any of the
    `(start, end)` windows, the share of them the power cap held down (where the driver says), and how
    many there were; None where none fell inside."""
    inside = [s for s in samples if any(start <= s[0] <= end for start, end in windows)]
    if not inside:
        return None
    capped = [s[3] for s in inside if s[3] is not None]
    return {
        "sm_mhz": round(float(np.mean([s[1] for s in inside])), 1),
        "power_w": round(float(np.mean([s[2] for s in inside])), 1),
        "power_capped": round(float(np.mean(capped)), 3) if capped else None,
        "samples": len(inside),
    }


def nvidia_smi_ids(props) -> list[str]:
    """nvidia-smi `--id`s of the CUDA device with these `torch.cuda.get_device_properties`: its UUID, then
    its PCI bus id (CUDA numbers devices in its own order, nvidia-smi by bus)."""
    bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    return [f"GPU-{props.uuid}", bus]


class ClockSampler:
    """One GPU's SM clock and power from nvidia-smi every 50 ms, stamped with `time.monotonic()`, and
    its enforced power limit: where the same kernels at the same launches run slower under one system
    than another, this says whether the GPU's clock differed. `gpus`: ids for nvidia-smi's `--id`, the
    first it answers is sampled (a UUID, a PCI bus id: CUDA's device order need not be nvidia-smi's);
    none, or no nvidia-smi, samples nothing."""

    def __init__(self, gpus: Sequence[str]):
        self.samples: list[tuple[float, float, float, float | None]] = []
        self.process = self.power_limit_w = self.query = None
        if not gpus or shutil.which("nvidia-smi") is None:
            return
        for gpu in gpus:
            command = ["nvidia-smi", f"--id={gpu}", "--format=csv,noheader,nounits"]
            self.query = next((query for query in CLOCK_QUERIES if self._once(command, query)), None)
            if self.query is not None:
                break
        else:
            print(f"clocks: nvidia-smi answered none of {CLOCK_QUERIES} for {list(gpus)}: no samples", flush=True)
            return
        limit = self._once(command, "enforced.power.limit")
        self.power_limit_w = limit[0] if limit else None
        self.process = subprocess.Popen(
            [*command, f"--query-gpu={self.query}", "-lms", "50"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    @staticmethod
    def _once(command: list[str], query: str) -> tuple[float, ...] | None:
        """One reading of `query`'s fields (their numbers), or None where nvidia-smi refuses it."""
        try:
            done = subprocess.run([*command, f"--query-gpu={query}"], capture_output=True, text=True, timeout=10)
        except subprocess.TimeoutExpired:
            return None
        if done.returncode != 0:
            return None
        try:
            return tuple(float(v) for v in done.stdout.split(",")[:2])
        except ValueError:
            return None

    def _read(self) -> None:
        for line in self.process.stdout:
            sample = parse_clock_line(line)
            if sample is not None:
                self.samples.append((time.monotonic(), *sample))

    def summary(self, windows: list[tuple[float, float]]) -> dict | None:
        return clock_summary(list(self.samples), windows)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class CpuSampler:
    """Host CPU cores busy over a rate, less what the client processes used: the servers' share (their
    HTTP front, image processing, schedulers), which GPU utilisation does not show; and the busiest
    server processes by title, since one Python process tops out near one core (its GIL) long before
    the host does."""

    BUSIEST = 6

    def __init__(self, clients: list[int]):
        import psutil

        self.processes = [psutil.Process(pid) for pid in clients]
        self.start = (time.monotonic(), self._busy(psutil.cpu_times()), self._clients(), process_seconds())

    @staticmethod
    def _busy(times) -> float:
        """Busy seconds of all cores (Linux's guest time is inside `user` already: not added again)."""
        return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))

    def _clients(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self.processes)

    def stop(self) -> dict:
        import psutil

        began, busy, clients, processes = self.start
        seconds = time.monotonic() - began
        host = (self._busy(psutil.cpu_times()) - busy) / seconds
        client = (self._clients() - clients) / seconds
        skip = {p.pid for p in self.processes} | {os.getpid()}
        busiest = busiest_processes(processes, process_seconds(), seconds, skip, self.BUSIEST)
        return {
            "host_cores": round(host, 1),
            "client_cores": round(client, 1),
            "server_cores": round(host - client, 1),
            "busiest_processes": busiest,
        }


def process_seconds() -> dict[int, tuple[str, float]]:
    """{pid: (title, CPU seconds so far)} of every process this user may read."""
    import psutil

    found = {}
    for process in psutil.process_iter(["cmdline", "name", "cpu_times"]):
        times = process.info["cpu_times"]
        if times is not None:
            title = " ".join(process.info["cmdline"] or []).strip() or process.info["name"] or "?"
            found[process.pid] = (title[:80], times.user + times.system)
    return found


def busiest_processes(before: dict, after: dict, seconds: float, skip: set[int], count: int) -> list[list]:
    """The `count` processes that used the most cores between two `process_seconds` readings, as
    [title, cores] (a process that started in between counts from zero)."""
    used = [
        (after[pid][1] - before.get(pid, (None, 0.0))[1], after[pid][0]) for pid in after if pid not in skip
    ]
    return [[title, round(cores / seconds, 2)] for cores, title in sorted(used, reverse=True)[:count]]
