"""Where a first sighting loses to its recurring graph: the compiled exact route's host side (GPU).

    python benchmarks/launch_probe.py --out benchmarks/results

Qwen3-VL-8B, compiled as the runner compiles it (one image and two equal ones warmed), then per
bench case on its exact layout:
- host: `exact_layout` + `pack_metadata` + the copies to the GPU (what the route does first);
- enqueue: the compiled call until it returns, not synchronized (the host's launch work);
- forward: the compiled call, synchronized; graph: the same call captured and replayed;
- kernels: the sum of the GPU kernel times of one forward (torch.profiler);
- GPU only: the call's GPU time with the host's launches hidden behind a sleep kernel;
- the host timeline of one call (`host_timeline`, printed per case and saved).
If enqueue is close to forward, the route is launch-bound and only a graph hides it. `idle`: the
GPU's idle time between the first and last kernel of one forward (profiler timestamps), and
`lead`: forward minus the kernels' span (the host's head start plus the tail).
Each case runs twice: short equal segments through dense cuDNN (as in a graph) and through the
Triton kernel (`attention.TRITON_OUTSIDE_GRAPHS`, the default outside graphs under backend
"triton"); the graph column captures, so it is dense cuDNN both times.
Last, the host cost of one attention call at 8 x 784 rows, 16 x 72: dense cuDNN
(`attention._dense`) and the Triton kernel's op.

Saved (twelfth session): `launch_probe.json` (every case, both attention choices),
`launch_probe_host_ops.json` (8 x 448x448 with the host's self time by op), and
`launch_probe_freezing.json` (`--freezing`: inductor's weights-as-constants, no better). An
older run (commit 64beda8, with a direct cuDNN call A/B) is in the git history of
`launch_probe.json`. Fourteenth session: `launch_probe_cpp_wrapper.json` (`--cpp-wrapper
--attention triton`, two cases: no faster) and `launch_probe_cpp_wrapper_baseline.json` (the same
without it, same host; that run's script also had a `--skip-guards` flag, never used, since
removed).
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
from encoder_graphs.exact_route import compile_state  # noqa: E402
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


def gpu_only_ms(fn, repeats: int = 5) -> float:
    """GPU ms of `fn` with the host's launches hidden: a sleep kernel holds the GPU while the host
    enqueues the whole call, then events time the call's kernels alone."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~100 ms at H100 clocks: longer than any enqueue here
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")


def host_timeline(fn) -> dict:
    """Where the host spends one call (torch.profiler, CPU and CUDA; the profiler slows the host,
    so read the shape, not the ms): the host time before its first kernel launch and the longest
    CPU ops done before it, the synchronizing runtime calls, and the five longest gaps between
    consecutive launches with the innermost CPU op open at the gap's start."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("probe_call"):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    call = next(e for e in events if e.name == "probe_call")
    t0, t1 = call.time_range.start, call.time_range.end
    inside = [e for e in events if t0 <= e.time_range.start <= t1]
    launches = sorted(e.time_range.start for e in inside if e.name in LAUNCHES)
    blocking = ("cudaMemcpy", "cudaStreamWaitEvent")
    syncs = sorted({e.name for e in inside if "ynchronize" in e.name or e.name in blocking})
    gaps = sorted(((b - a, a) for a, b in zip(launches, launches[1:])), reverse=True)[:5]
    ops = [e for e in inside if e.name not in LAUNCHES and e.name != "probe_call"]

    def innermost(t: float) -> str:
        open_ops = [e for e in ops if e.time_range.start <= t <= e.time_range.end]
        return min(open_ops, key=lambda e: e.time_range.end - e.time_range.start).name if open_ops else "-"

    own_us: dict[str, float] = {}
    for e in inside:  # host self time by op (profiled: inflated, read the ranking)
        own_us[e.name] = own_us.get(e.name, 0.0) + e.self_cpu_time_total
    before = [e for e in ops if launches and e.time_range.end <= launches[0]]
    longest_before = sorted(before, key=lambda e: e.time_range.start - e.time_range.end)[:12]
    return {
        "before_first_launch": [
            {"op": e.name, "us": round(e.time_range.end - e.time_range.start, 1)} for e in longest_before
        ],
        "host_self_us_by_op": dict(sorted(own_us.items(), key=lambda kv: -kv[1])[:20]),
        "host_call_ms": (t1 - t0) / 1e3,
        "launches": len(launches),
        "first_launch_ms": (launches[0] - t0) / 1e3 if launches else None,
        "sync_calls": syncs,
        "longest_launch_gaps": [
            {"us": round(g, 1), "at_ms": round((a - t0) / 1e3, 3), "op": innermost(a)} for g, a in gaps
        ],
    }


def compiled_and_warmed(encoder, rng):
    """The forward compiled as the runner compiles it, warmed on exact layouts as `_warm_exact`
    warms it: one image, then two equal ones (the two variants every exact pack hits)."""
    compiled = torch.compile(encoder.forward_padded, dynamic=True)
    for items in ([("image", 1024, 1024)], [("image", 720, 720)] * 2):
        _, pixels, specs = build_case(encoder, items, rng)
        with compile_state():
            encoder.forward_eager(pixels, specs, forward=compiled)
    torch.cuda.synchronize()
    return compiled


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--preset", default="qwen3-vl-8b")
    parser.add_argument("--freezing", action="store_true", help="inductor's freezing (weights as constants)")
    parser.add_argument("--cpp-wrapper", action="store_true", help="inductor's C++ wrapper (no Python wrapper code)")
    parser.add_argument("--attention", choices=("both", "dense", "triton"), default="both")
    parser.add_argument("--cases", nargs="+", default=list(PROBED), choices=PROBED)
    args = parser.parse_args()
    encoder = from_preset(args.preset, dtype=torch.bfloat16, device=CUDA, seed=0)
    from torch._inductor import config as inductor_config

    inductor_config.freezing = args.freezing
    inductor_config.cpp_wrapper = args.cpp_wrapper
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    compiled = compiled_and_warmed(encoder, rng)
    warm_s = time.perf_counter() - start
    rows = []
    outside = {"both": (False, True), "dense": (False,), "triton": (True,)}[args.attention]
    for case, triton_outside in [(c, t) for c in args.cases for t in outside]:
        attention.TRITON_OUTSIDE_GRAPHS = triton_outside
        _, pixels, specs = build_case(encoder, CASES[case], rng)

        def host(specs=specs):
            layout = encoder.exact_layout(specs)
            meta = {k: v.to(CUDA, non_blocking=True) for k, v in encoder.pack_metadata(specs, layout).items()}
            return layout, meta

        layout, metadata = host()
        lengths = segment_lengths(specs)

        def call(pixels=pixels, metadata=metadata, layout=layout, lengths=lengths):
            with compile_state(), attention.exact_segments(lengths), torch.compiler.set_stance("fail_on_recompile"):
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
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
        gpu_ms = gpu_only_ms(call)
        timeline = host_timeline(call)
        print(json.dumps({"case": case, "triton_outside": triton_outside, **timeline}), flush=True)
        busy, reach = 0.0, spans[0][0]
        for start_us, end_us in spans:  # union of kernel intervals
            busy += max(0.0, end_us - max(start_us, reach))
            reach = max(reach, end_us)
        span_ms = (reach - spans[0][0]) / 1e3
        row = {
            "case": case,
            "attention_outside_graphs": "triton" if triton_outside else "dense cuDNN",
            "gpu_only_ms": gpu_ms,
            "host_timeline": timeline,
            "idle_ms": span_ms - busy / 1e3,
            "lead_ms": forward_ms - span_ms,
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
    cu = torch.arange(0, 9 * 784, 784, device=CUDA, dtype=torch.int32)
    attention.triton_varlen_attention(q, k, v, cu, 784, 72**-0.5)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        attention.triton_varlen_attention(q, k, v, cu, 784, 72**-0.5)
    triton_call_us = (time.perf_counter() - start) / 200 * 1e6
    torch.cuda.synchronize()
    print(json.dumps({"dense_call_us": dense_call_us, "triton_call_us": triton_call_us}), flush=True)
    record = {
        **environment(),
        "freezing": args.freezing,
        "cpp_wrapper": args.cpp_wrapper,
        "attention_backend": "triton" if attention._use_triton else ("cudnn" if attention._use_cudnn else "flash"),
        "dense_call_us_8x784": dense_call_us,
        "triton_call_us_8x784": triton_call_us,
        "warm_s": warm_s,
        "cases": rows,
    }
    flags = [name for name, on in (("freezing", args.freezing), ("cpp_wrapper", args.cpp_wrapper)) if on]
    path = Path(args.out) / f"launch_probe{''.join('_' + f for f in flags)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    print(f"{record['device']}, torch {record['torch']}, warm-up compiles {warm_s:.0f} s")
    print(f"host per attention call at 8 x 784: dense cuDNN {dense_call_us:.0f} us, Triton {triton_call_us:.0f} us")
    print(
        "| case | attention outside graphs | host prep ms | enqueue ms | forward ms | graph ms | kernel sum ms "
        "| GPU only ms | GPU idle ms | lead ms |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    keys = ("host_prep_ms", "enqueue_ms", "forward_ms", "graph_ms", "kernels_ms", "gpu_only_ms", "idle_ms", "lead_ms")
    for r in rows:
        cells = [r["case"], r["attention_outside_graphs"]] + [f"{r[k]:.2f}" for k in keys]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
