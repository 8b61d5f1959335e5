"""How much of a graph replay is its launch, and what the host's copies around it cost (GPU).

    python benchmarks/graph_launch_probe.py --out benchmarks/results

Qwen3-VL-8B, compiled and captured as the runner does (budgets 64 and the cases' own), then per
case on its budget graph with the inputs filled:
- `idle`: `graph.replay()` started on an idle GPU, synchronized (what a first sighting pays);
- `gpu`: the same replay queued behind a sleep kernel, timed by CUDA events around it: the
  graph's GPU time with its launch hidden (`idle - gpu` is the launch the GPU waits for);
- `launch`: the host time of `graph.replay()` until it returns (not synchronized);
- `fill pageable` / `fill pinned`: `_fill` with the metadata in pageable or pinned memory,
  synchronized;
- `kernels`: the replay's kernel count (torch.profiler).
Saved: `graph_launch_probe_default.json` and, with `CUBLASLT_WORKSPACE_SIZE=0` in the
environment (cuBLASLt without a workspace: no memset before its matmuls),
`graph_launch_probe_ws0.json`; both on the 8-step ladder of the time (8 x 448x448 in the
1664-token graph; the default ladder now puts it in 1600).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.encoder_bench import CASES, build_case  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from encoder_graphs.budgets import fitting_budget  # noqa: E402
from encoder_graphs.config import build_ladder  # noqa: E402
from encoder_graphs.runner import EncoderRunner, GraphConfig, canonical_order  # noqa: E402
from encoder_graphs.selfcheck import time_ms  # noqa: E402
from models import from_preset  # noqa: E402

CUDA = torch.device("cuda")
PROBED = ("1 x 448x448", "8 x 448x448", "mixed 896 + 4x448 + 8x224", "1 x 1792x1792")


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def idle_ms(fn) -> float:
    """Median wall ms of `fn`, each run started on an idle GPU and synchronized."""
    return time_ms(fn, CUDA, repeats=15, warmup=0)


def hidden_ms(fn, repeats: int = 15) -> tuple[float, float]:
    """(GPU ms of `fn` queued behind a sleep kernel, host ms until `fn` returns)."""
    gpu, host = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # ~10 ms: every launch lands before the GPU gets there
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        start = time.perf_counter()
        fn()
        host.append((time.perf_counter() - start) * 1e3)
        end.record()
        torch.cuda.synchronize()
        gpu.append(begin.elapsed_time(end))
    return median(gpu), median(host)


def kernel_count(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def probe(runner: EncoderRunner, encoder, name: str) -> dict:
    _, pixels, specs = build_case(encoder, CASES[name], np.random.default_rng(1))
    order = canonical_order(specs)
    offsets = np.cumsum([0] + [s.input_patches for s in specs])
    pixels = torch.cat([pixels[offsets[i] : offsets[i + 1]] for i in order])
    specs = [specs[i] for i in order]
    budget = fitting_budget(runner.ladder, sum(s.output_tokens for s in specs))
    entry, metadata = runner._place(specs, budget)
    pinned = {k: v.pin_memory() for k, v in metadata.items()}
    runner._fill(entry, pixels, metadata)
    replay = entry.graph.replay
    replay()
    gpu, launch = hidden_ms(replay)
    return {
        "case": name,
        "graph": list(entry.key),
        "idle_ms": idle_ms(replay),
        "gpu_ms": gpu,
        "launch_ms": launch,
        "fill_pageable_ms": idle_ms(lambda: runner._fill(entry, pixels, metadata)),
        "fill_pinned_ms": idle_ms(lambda: runner._fill(entry, pixels, pinned)),
        "run_ms": idle_ms(lambda: runner.run(pixels, specs, recurring=False)),
        "kernels": kernel_count(replay),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-vl-8b")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="graph_launch_probe")
    args = parser.parse_args()
    encoder = from_preset(args.preset, dtype=torch.bfloat16, device=CUDA, seed=0)
    ladder, _ = build_ladder(GraphConfig(), 64)
    needed = set()
    for name in PROBED:
        _, _, specs = build_case(encoder, CASES[name], np.random.default_rng(1))
        needed.add(fitting_budget(ladder, sum(s.output_tokens for s in specs)))
    runner = EncoderRunner(
        encoder, GraphConfig(budgets=tuple(sorted({64, *needed})), compile=True, compile_exact=False)
    )
    runner.capture(progress=lambda message: None)
    with torch.inference_mode():
        rows = [probe(runner, encoder, name) for name in PROBED]
    record = {**environment(), "cases": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(record, indent=2))
    print(f"{record['device']}, torch {record['torch']}")
    print("| case | graph | kernels | idle | gpu | idle - gpu | launch | fill pageable | fill pinned | run |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {tuple(r['graph'])} | {r['kernels']} | {r['idle_ms']:.2f} | {r['gpu_ms']:.2f} "
            f"| {r['idle_ms'] - r['gpu_ms']:.2f} | {r['launch_ms']:.3f} | {r['fill_pageable_ms']:.3f} "
            f"| {r['fill_pinned_ms']:.3f} | {r['run_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
