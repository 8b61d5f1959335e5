"""What a first sighting on the compiled exact route pays outside the compiled call (GPU).

    python benchmarks/route_probe.py --out benchmarks/results

`launch_probe.py` times the compiled call alone, compiled afresh. Here the runner is built and
captured as `encoder_bench.py --compile` builds it (every budget graph, the exact-route warm-up,
the self-check), and each case is timed three ways, each sample started on an idle GPU, in turns:
- `run`: `runner.run(pixels, specs, recurring=False)`, what the benchmark's first-sighting
  column times (on whatever route the plan picks; its route is printed);
- `eager+compiled`: `encoder.forward_eager(pixels, specs, forward=runner._forward)` under the
  runner's compiled state: the route's own work (metadata, copies, the call) without the plan;
- `call`: the compiled call alone on prepared metadata (as `launch_probe.py`).
Also: dynamo's cache entries for the forward (each lookup checks entries in turn until one's
guards pass), the host timeline of one `run` (`launch_probe.host_timeline`), each path's GPU
kernels (count, summed ms) and each path timed on its own.

Two runs (`route_probe.json`, `route_probe_run2.json`): on 1792x1792 `run` took 105-109 ms and
`forward_eager` 91-98 against 78-80 for the call, with the same kernels summing to the same
time; `encoder_bench.py`'s first sighting of that pack, the same `run` in a captured runner,
took 83.7 ms, and `stall_probe.py` finds only 1-2.5 ms between the call and `forward_eager`
outside a runner. Cause of this probe's excess not established (see the results README).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.encoder_bench import CASES, build_case, route  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from benchmarks.launch_probe import host_timeline  # noqa: E402
from encoder_graphs.exact_route import compile_state  # noqa: E402
from encoder_graphs.runner import EncoderRunner, GraphConfig  # noqa: E402
from encoder_graphs.selfcheck import interleaved_ms, time_ms  # noqa: E402
from models import attention, from_preset  # noqa: E402
from models.layout import segment_lengths  # noqa: E402

CUDA = torch.device("cuda")


def cache_entries(encoder) -> int:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(type(encoder).forward_padded.__code__))


def kernel_sum(fn) -> dict:
    """One call's GPU kernels (torch.profiler): count, summed ms, and the five longest by name."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    top = sorted(events, key=lambda e: -e.device_time_total)[:5]
    return {
        "count": sum(e.count for e in events),
        "ms": sum(e.device_time_total for e in events) / 1e3,
        "top": [(e.key[:80], e.count, round(e.device_time_total / 1e3, 2)) for e in top],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--preset", default="qwen3-vl-8b")
    parser.add_argument("--cases", nargs="+", default=["8 x 448x448", "1 x 1792x1792", "mixed 896 + 4x448 + 8x224"])
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    encoder = from_preset(args.preset, dtype=torch.bfloat16, device=CUDA, seed=0)
    runner = EncoderRunner(encoder, GraphConfig(max_budget_tokens=8192, compile=True))
    runner.capture(progress=lambda message: None)
    entries_after_capture = cache_entries(encoder)
    rng = np.random.default_rng(0)
    rows = []
    for case in args.cases:
        _, pixels, specs = build_case(encoder, CASES[case], rng)
        layout = encoder.exact_layout(specs)
        metadata = {k: v.to(CUDA) for k, v in encoder.pack_metadata(specs, layout).items()}
        lengths = segment_lengths(specs)

        def call():
            with compile_state(), attention.exact_segments(lengths), torch.compiler.set_stance("fail_on_recompile"):
                return runner._forward(pixels, metadata, layout, True)

        def eager_compiled():
            with compile_state(), torch.compiler.set_stance("fail_on_recompile"):
                return encoder.forward_eager(pixels, specs, forward=runner._forward)

        routes = []

        def run():
            with torch.inference_mode():
                runner.run(pixels, specs, recurring=False)
            routes.append(route(runner.stats.last))

        for fn in (call, eager_compiled, run):
            fn()
        torch.cuda.synchronize()
        timings = interleaved_ms({"run": run, "eager+compiled": eager_compiled, "call": call}, CUDA, repeats=10)
        timeline = host_timeline(run)
        paths = {"run": run, "eager+compiled": eager_compiled, "call": call}
        kernels = {name: kernel_sum(fn) for name, fn in paths.items()}
        alone = {name: time_ms(fn, CUDA, repeats=5) for name, fn in paths.items()}  # each path on its own
        row = {
            "case": case,
            "route": routes[-1],
            "cache_entries": cache_entries(encoder),
            **{f"{k}_ms": v for k, v in timings.items()},
            "kernels": kernels,
            "alone_ms": alone,
            "run_timeline": timeline,
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "run_timeline"}), flush=True)
    record = {
        **environment(),
        "cache_entries_after_capture": entries_after_capture,
        "learned_route_scale": runner.describe()["learned_route_scale"],
        "cases": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"route_probe{args.tag}.json").write_text(json.dumps(record, indent=2))
    print(f"{record['device']}, torch {record['torch']}; dynamo cache entries after capture: {entries_after_capture}")
    print("| case | route | cache entries | run ms | eager+compiled ms | call ms |\n|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['route']} | {r['cache_entries']} | {r['run_ms']:.2f} "
            f"| {r['eager+compiled_ms']:.2f} | {r['call_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
