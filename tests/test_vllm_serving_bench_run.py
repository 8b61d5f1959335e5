"""The deployment comparison's benchmark run as a user runs it, on CPU: it starts our E/PD system
(`configs/epd-vllm-cpu.yaml`, vLLM's CPU build, every engine argument as shipped, on the checkpoint
made as the README says) with `serve run`, measures one rate, reports, keeps the logs; a run whose
time limit allows no rate fails and starts no server. This run is also the test that the shipped CPU
config starts and answers chats. Skipped without vLLM (the main CI env); the vLLM CI step (.ci/vllm)
runs this file on its own, before its other tests, since the benchmark starts its own Ray and serves
on port 8000."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

if os.environ.get("REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (an ImportError here fails the vLLM CI step instead of skipping)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed; the vLLM CI step (.ci/vllm) installs it")

ROOT = Path(__file__).resolve().parents[1]
OUTPUT_TOKENS = 64
"""The benchmark's answer length (`vllm_serving_bench.OUTPUT_TOKENS`), greedy to the end."""


def bench(checkpoint: str, out: Path, *more: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "benchmarks/vllm_serving_bench.py", "--checkpoint", checkpoint, "--systems", "ours",
        "--config", "configs/epd-vllm-cpu.yaml", "--out", str(out), "--workloads", "image-light",
        "--rates", "image-light=1", "--seconds", "4", "--startup-timeout", "600", *more,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_the_benchmark_measures_our_system_at_a_rate_and_reports_it(tiny_vllm_checkpoint, tmp_path):
    run = bench(tiny_vllm_checkpoint, tmp_path)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    record = json.loads((tmp_path / "ours.json").read_text())
    (level,) = record["workloads"]["image-light"]
    assert level["rate"] == 1 and level["errors"] == 0 and level["answered"] == level["sent"] >= 1, level
    assert level["output_tokens_mean"] == OUTPUT_TOKENS and level["ttft_p50_s"] > 0
    budgets = record["max_num_batched_tokens"]  # read from the vLLM engine's own start-up line
    assert budgets and all(budget > 0 for budget in budgets), budgets
    assert "| ours | 1 | 4 |" in (tmp_path / "vllm_serving.md").read_text()
    shipped = yaml.safe_load((ROOT / "configs" / "epd-vllm-cpu.yaml").read_text())
    served = yaml.safe_load((tmp_path / "ours-config.yaml").read_text())
    args, shipped_args = served["applications"][0]["args"], shipped["applications"][0]["args"]
    assert args["llm"]["engine_kwargs"] == shipped_args["llm"]["engine_kwargs"]  # the engine as shipped
    assert served["applications"][0]["deployments"] == shipped["applications"][0]["deployments"]
    assert record["model"] == Path(shipped_args["llm"]["path"]).name  # the directory's name, as the config says
    assert (tmp_path / "serve-logs-ours.tgz").is_file() and (tmp_path / "server-ours.log").is_file()


def test_a_run_that_measured_no_rate_fails(tiny_vllm_checkpoint, tmp_path):
    """A time limit that leaves no rate time to run fails the run, without starting a server first."""
    run = bench(tiny_vllm_checkpoint, tmp_path, "--time-limit", "1")
    assert run.returncode == 1 and "measured no rate for ours" in run.stderr, run.stdout[-4000:] + run.stderr[-4000:]
    assert "ours: not started" in run.stdout and not (tmp_path / "server-ours.log").exists(), run.stdout[-4000:]
