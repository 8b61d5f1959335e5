"""The vLLM encoder benchmark's grouping of a stream: what vLLM's scheduler and batching hand its encoder."""

from __future__ import annotations

import pytest

from benchmarks.common.vllm_encoder_table import format_table
from benchmarks.vllm_encoder_bench import latency_summary, modality_runs, scheduler_steps


def test_a_step_encodes_the_items_that_begin_in_its_tokens():
    # window 8192: items begin at 0, 5000 (step 1: their 10,000 tokens fit the encoder budget) and 10,000
    assert scheduler_steps([5000, 5000, 5000], 8192, 16384) == [[0, 1], [2]]
    assert scheduler_steps([100, 200, 300, 400, 50], 600, 600) == [[0, 1, 2], [3, 4]]


def test_an_item_past_the_encoder_budget_begins_the_next_step():
    # the third item begins inside the first window but would take the encoder past its budget
    assert scheduler_steps([3000, 3000, 3000, 100], 8192, 8192) == [[0, 1], [2, 3]]


def test_an_item_spanning_several_windows_leaves_the_steps_between_without_encoder_work():
    assert scheduler_steps([100, 20000, 100], 8192, 20480) == [[0, 1], [2]]


def test_every_item_is_in_exactly_one_step_and_a_step_holds_at_most_the_encoder_budget():
    tokens = [64, 784, 2040, 64, 196, 8192, 1, 4096, 4096, 16384, 300]
    steps = scheduler_steps(tokens, 8192, 16384)
    assert [i for step in steps for i in step] == list(range(len(tokens)))
    assert all(sum(tokens[i] for i in step) <= 16384 for step in steps)


def test_runs_split_a_step_where_the_modality_changes():
    modalities = ["image", "image", "video", "image", "video", "video"]
    assert modality_runs([0, 1, 2, 3, 4, 5], modalities) == [
        ("image", [0, 1]),
        ("video", [2]),
        ("image", [3]),
        ("video", [4, 5]),
    ]
    assert modality_runs([], modalities) == []


@pytest.mark.parametrize("count", [1, 2, 10, 11])
def test_latency_summary_quantiles(count):
    samples = [(float(ms), 100) for ms in range(1, count + 1)]
    summary = latency_summary(samples)
    assert summary["calls"] == count and summary["max_ms"] == count and summary["tokens_per_call"] == 100
    assert summary["p50_ms"] <= summary["p90_ms"] <= summary["max_ms"]
    assert summary["p50_ms"] == sorted(ms for ms, _ in samples)[count // 2]


def test_the_table_leaves_unmeasured_cells_empty_and_says_how_many_rounds():
    """`ours-vllm-calls` has no single-image time (it runs the stream only); the md says the rounds."""

    def system(tokens_per_s, single_ms=None):
        entry = {
            "stream_seconds": [2.0, 2.1],
            "stream_tokens_per_s": tokens_per_s,
            "stream_mfu": 0.5,
            "calls_per_stream": 20,
            "latency": latency_summary([(100.0, 8000)]),
        }
        if single_ms is not None:
            entry.update(single_448_ms=single_ms, single_448_mfu=0.25, agreement_with_ours=None)
        return entry

    record = {
        "device": "GPU", "torch": "2.11", "vllm": "0.26.0", "transformers": "5.17.0", "dtype": "bfloat16",
        "peak_bf16_tflops": 800.0, "date": "2026-11-29", "command": "bench", "flop_formula": "f",
        "stream": {"items": 3, "tokens": 100, "requests": 2}, "single": {"tokens": 196},
        "systems": {"ours": system(75000.0, 3.5), "ours-vllm-calls": system(70000.0)},
    }  # fmt: skip
    table = format_table(record).splitlines()
    assert "rounds: 2 (medians)" in table[2]
    rows = {line.split(" | ")[0].removeprefix("| "): line.split(" | ") for line in table if line.startswith("| ")}
    assert rows["ours-vllm-calls"][6:8] == ["", ""]  # 448x448 ms and MFU: not measured
    assert rows["ours"][6:8] == ["3.50", "25.0%"] and rows["ours"][1] == "75,000"


def test_the_table_adds_kernel_time_by_kind_where_it_was_measured():
    entry = {
        "stream_seconds": [2.0],
        "stream_tokens_per_s": 80000.0,
        "stream_mfu": 0.6,
        "calls_per_stream": 20,
        "latency": latency_summary([(100.0, 8000)]),
    }
    record = {
        "device": "GPU", "torch": "2.11", "vllm": "0.26.0", "transformers": "5.17.0", "dtype": "bfloat16",
        "peak_bf16_tflops": 800.0, "date": "2026-11-29", "command": "bench", "flop_formula": "f",
        "stream": {"items": 3, "tokens": 100, "requests": 2}, "single": {"tokens": 196},
        "systems": {"ours": entry},
    }  # fmt: skip
    assert "kernel time" not in format_table(record)
    by_kind = {"matmul": 876.0, "attention": 862.0, "norm": 113.0, "elementwise": 50.0, "copy": 19.0, "other": 0.0}
    entry["kernel_time"] = {"wall_ms": 1948.0, "kernel_ms": 1920.0, "kernels": 7656, "by_kind_ms": by_kind}
    table = format_table(record)
    assert "GPU kernel time over one stream pass" in table
    assert "| ours | 1948.0 | 1920.0 | 876.0 | 862.0 | 113.0 | 50.0 | 19.0 | 0.0 | 7656 |" in table


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kernel-time"], "--kernel-time profiles CUDA kernels: it needs a GPU"),
        (["--also-attention", "fa3"], "--also-attention compares attention kernels: without a GPU"),
    ],
)
def test_gpu_only_flags_are_refused_without_a_gpu_before_anything_loads(tmp_path, flags, message):
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the flags are accepted")
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_encoder_bench.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--checkpoint", str(tmp_path), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and message in done.stderr
