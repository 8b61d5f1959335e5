"""The GPU clock sampler beside kernel time: nvidia-smi's lines parsed, samples averaged over windows,
and the sampler run against a stand-in `nvidia-smi` (a GPU's answers, an older driver's, none)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from benchmarks.common.utilisation import CLOCK_QUERIES, ClockSampler, clock_summary, nvidia_smi_ids, parse_clock_line


def test_clock_summary_averages_the_samples_inside_the_windows_only():
    samples = [(0.5, 1980.0, 300.0, 0.0), (1.0, 1700.0, 650.0, 1.0), (1.5, 1600.0, 700.0, 1.0)]
    samples += [(2.5, 1980.0, 200.0, 0.0), (3.0, 1500.0, 690.0, 0.0)]
    summary = clock_summary(samples, [(1.0, 1.5), (3.0, 4.0)])  # ends included; 0.5 and 2.5 outside
    assert summary == {"sm_mhz": 1600.0, "power_w": 680.0, "power_capped": 0.667, "samples": 3}
    unknown = [(1.0, 1700.0, 650.0, None)]  # a driver without the power cap's flag
    assert clock_summary(unknown, [(0.0, 2.0)])["power_capped"] is None
    assert clock_summary(samples, [(5.0, 6.0)]) is None  # nothing sampled there: no number
    assert clock_summary([], [(0.0, 9.0)]) is None


def test_clock_lines_parse_numbers_and_the_power_cap_flag():
    assert parse_clock_line("1755, 650.52, Active\n") == (1755.0, 650.52, 1.0)
    assert parse_clock_line("1980, 120.00, Not Active") == (1980.0, 120.0, 0.0)
    assert parse_clock_line("1980, 120.00") == (1980.0, 120.0, None)
    assert parse_clock_line("1980, [N/A], Active") is None
    assert parse_clock_line("19") is None


def test_nvidia_smi_ids_name_the_device_by_uuid_then_bus():
    uuid = "58ed5b8d-0c4a-4d1e-9a3b-1f2e3d4c5b6a"
    props = SimpleNamespace(uuid=uuid, pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    assert nvidia_smi_ids(props) == ["GPU-58ed5b8d-0c4a-4d1e-9a3b-1f2e3d4c5b6a", "00000000:1B:00.0"]


FAKE_SMI = """#!/usr/bin/env bash
echo "$@" >> "$FAKE_SMI_CALLS"
case "$*" in
  *--id=GPU-gone*) echo "No devices were found"; exit 6 ;;
  *enforced.power.limit*) echo "700.00" ;;
  *power.draw.instant*)
    [ -n "$FAKE_SMI_OLD" ] && { echo 'Field "power.draw.instant" is not a valid field to query.'; exit 2; }
    if [[ "$*" == *-lms* ]]; then
      while true; do
        echo "1650, 690.10, Active"; echo "[N/A], [N/A], [N/A]"; echo "1770, 600.30, Not Active"; sleep 0.05
      done
    fi
    echo "1650, 690.10, Active" ;;
  *power.draw*)
    if [[ "$*" == *-lms* ]]; then while true; do echo "1700, 650.00"; sleep 0.05; done; fi
    echo "1700, 650.00" ;;
esac
"""


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """An `nvidia-smi` on PATH that answers like a GPU's (or like an older driver's, with FAKE_SMI_OLD)."""
    script = tmp_path / "nvidia-smi"
    script.write_text(FAKE_SMI)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SMI_CALLS", str(tmp_path / "calls"))
    return tmp_path / "calls"


def sample_for_a_while(sampler: ClockSampler) -> dict | None:
    start = time.monotonic()
    time.sleep(0.6)
    end = time.monotonic()
    sampler.stop()
    assert sampler.process is None or sampler.process.poll() is not None  # stopped, not left running
    return sampler.summary([(start, end)])


def test_clock_sampler_samples_the_first_gpu_nvidia_smi_answers(fake_smi):
    sampler = ClockSampler(["GPU-gone", "GPU-here"])
    summary = sample_for_a_while(sampler)
    assert sampler.power_limit_w == 700.0 and sampler.query == CLOCK_QUERIES[0]
    assert summary["samples"] >= 4 and 1650.0 <= summary["sm_mhz"] <= 1770.0  # the [N/A] lines skipped
    assert 0.2 < summary["power_capped"] < 0.8
    assert "--id=GPU-here" in fake_smi.read_text().splitlines()[-1]


def test_clock_sampler_falls_back_to_the_older_fields(fake_smi, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_OLD", "1")
    sampler = ClockSampler(["GPU-here"])
    summary = sample_for_a_while(sampler)
    assert sampler.query == CLOCK_QUERIES[1]
    assert summary["sm_mhz"] == 1700.0 and summary["power_w"] == 650.0 and summary["power_capped"] is None


def test_clock_sampler_without_a_gpu_it_can_name_samples_nothing(fake_smi, capsys):
    assert sample_for_a_while(ClockSampler(["GPU-gone"])) is None
    assert "no samples" in capsys.readouterr().out
    assert sample_for_a_while(ClockSampler([])) is None  # a CPU run: nvidia-smi is not asked


@pytest.mark.gpu
def test_clock_sampler_finds_this_gpu_by_uuid_and_by_bus():
    """On a GPU host: nvidia-smi answers to each id the benchmark derives from torch's device properties."""
    import torch

    x = torch.randn(4096, 4096, device="cuda")
    for gpu in nvidia_smi_ids(torch.cuda.get_device_properties(0)):
        sampler = ClockSampler([gpu])
        start = time.monotonic()
        for _ in range(400):  # about a second of float32 matmuls: samples of a busy GPU
            x @ x
        torch.cuda.synchronize()
        end = time.monotonic()
        sampler.stop()
        summary = sampler.summary([(start, end)])
        assert sampler.query is not None and sampler.power_limit_w, gpu
        assert summary and summary["samples"] >= 5 and summary["sm_mhz"] > 0 and summary["power_w"] > 0, (gpu, summary)
