"""Where a first sighting loses to its recurring graph: the compiled exact route's host side (GPU).

    python benchmarks/launch_probe.py --out benchmarks/results

Qwen3-VL-8B, compiled as the runner compiles it (one image and two equal ones warmed), then per
bench case on its exact layout:
- host: `exact_layout` + `pack_metadata` + the copies to the GPU (what the route does first);
- enqueue: the compiled call until it returns, not synchronized (the host's launch work);
- forward: the compiled call, synchronized; graph: the same call captured and replayed;
- kernels: the sum of the GPU kernel times of one forward (torch.profiler).
If enqueue is close to forward, the route is launch-bound and only a graph hides it.
Last, the host cost of one dense attention call (`attention._dense`, 8 x 784 rows at 16 x 72).

The saved `launch_probe.json` ran on commit 64beda8, where `_dense` could call cuDNN's op
directly; it also holds that A/B (`enqueue_sdpa_ms`, `forward_sdpa_ms`: through
`F.scaled_dot_product_attention`, as now). That direct call was reverted after it.
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
from encoder_graphs.runner import _exact_state  # noqa: E402
from encoder_graphs.selfcheck import graph_replay_ms, time_ms  # noqa: E402
from models import attention, from_preset  # noqa: E402
from models.layout import segment_lengths  # noqa: E402

CUDA = torch.device("cuda")
PROBED = ("1 x 896x896", "8 x 448x448", "1 x 1792x1792", "mixed 896 + 4x448 + 8x224")


def median_ms(fn, repeats: int = 7) -> float:
    """Median host ms of `fn`, each started on an idle GPU."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--preset", default="qwen3-vl-8b")
    args = parser.parse_args()
    encoder = from_preset(args.preset, dtype=torch.bfloat16, device=CUDA, seed=0)
    compiled = torch.compile(encoder.forward_padded, dynamic=True)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for items in ([("image", 1024, 1024)], [("image", 720, 720)] * 2):  # as `_warm_exact`: one, several
        _, pixels, specs = build_case(encoder, items, rng)
        with _exact_state():
            encoder.forward_eager(pixels, specs, forward=compiled)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - start
    rows = []
    for case in PROBED:
        _, pixels, specs = build_case(encoder, CASES[case], rng)

        def host(specs=specs):
            layout = encoder.exact_layout(specs)
            meta = {k: v.to(CUDA, non_blocking=True) for k, v in encoder.pack_metadata(specs, layout).items()}
            return layout, meta

        layout, metadata = host()
        lengths = segment_lengths(specs)

        def call(pixels=pixels, metadata=metadata, layout=layout, lengths=lengths):
            with _exact_state(), attention.exact_segments(lengths), torch.compiler.set_stance("fail_on_recompile"):
                return compiled(pixels, metadata, layout, True)

        call()
        torch.cuda.synchronize()

        host_ms = median_ms(lambda: (host(), torch.cuda.synchronize()))
        enqueue_ms = median_ms(call)  # returns once launched
        torch.cuda.synchronize()
        forward_ms = time_ms(call, CUDA, repeats=7)
        graph_ms = graph_replay_ms(call, repeats=10)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels_ms = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0) / 1e3
        row = {
            "case": case,
            "host_prep_ms": host_ms,
            "enqueue_ms": enqueue_ms,
            "forward_ms": forward_ms,
            "graph_ms": graph_ms,
            "kernels_ms": kernels_ms,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    q, k, v = (torch.randn(8 * 784, 16, 72, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    attention._dense(q, k, v, 784, 72**-0.5)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        attention._dense(q, k, v, 784, 72**-0.5)
    dense_call_us = (time.perf_counter() - start) / 200 * 1e6  # host-bound: 200 launches queue
    torch.cuda.synchronize()
    print(json.dumps({"dense_call_us": dense_call_us}), flush=True)
    record = {
        **environment(),
        "dense_call_us_8x784": dense_call_us,
        "warm_s": warm_s,
        "cases": rows,
    }
    path = Path(args.out) / "launch_probe.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    print(f"{record['device']}, torch {record['torch']}, warm-up compiles {warm_s:.0f} s")
    print("| case | host prep ms | enqueue ms | forward ms | graph ms | kernel sum ms |\n|---|---|---|---|---|---|")
    keys = ("host_prep_ms", "enqueue_ms", "forward_ms", "graph_ms", "kernels_ms")
    for r in rows:
        cells = [r["case"]] + [f"{r[k]:.2f}" for k in keys]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
