"""Which step of the exact route leaves the GPU idle (GPU): Qwen3-VL-8B compiled as the runner
compiles it (one image and two equal ones warmed, as `launch_probe.py`), then one case timed
through steps that add the route's work one at a time. Each: wall ms (synchronized, started on an
idle GPU) and the GPU span between events recorded just before and after the compiled call.

    python benchmarks/stall_probe.py --out benchmarks/results

Result (`stall_probe.json`, H100): the route's own steps (metadata built and copied, pageable,
pinned or blocking; `forward_eager`; the recompile stance) add 1-2.5 ms to the prepared call on
1792x1792 (77.4 -> 79.3-80.1 ms) and the mixed pack (22.6 -> 23.2-23.8), none of it GPU idle
inside the call. So the 14-28 ms `route_probe.py` saw is not in these steps.
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
from benchmarks.launch_probe import compiled_and_warmed  # noqa: E402
from encoder_graphs.exact_route import compile_state  # noqa: E402
from models import attention, from_preset  # noqa: E402
from models.layout import segment_lengths  # noqa: E402

CUDA = torch.device("cuda")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--cases", nargs="+", default=["1 x 1792x1792", "mixed 896 + 4x448 + 8x224"])
    args = parser.parse_args()
    encoder = from_preset("qwen3-vl-8b", dtype=torch.bfloat16, device=CUDA, seed=0)
    rng = np.random.default_rng(0)
    compiled = compiled_and_warmed(encoder, rng)
    rows = []
    for case in args.cases:
        _, pixels, specs = build_case(encoder, CASES[case], rng)
        layout = encoder.exact_layout(specs)
        lengths = segment_lengths(specs)
        prepared = {k: v.to(CUDA) for k, v in encoder.pack_metadata(specs, layout).items()}
        spans = []

        def timed_call(metadata):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = compiled(pixels, metadata, layout, True)
            end.record()
            spans.append((start, end))
            return out

        def prepared_call():
            with compile_state(), attention.exact_segments(lengths), torch.compiler.set_stance("fail_on_recompile"):
                timed_call(prepared)

        def fresh_async():
            metadata = {k: v.to(CUDA, non_blocking=True) for k, v in encoder.pack_metadata(specs, layout).items()}
            with compile_state(), attention.exact_segments(lengths), torch.compiler.set_stance("fail_on_recompile"):
                timed_call(metadata)

        def fresh_blocking():
            metadata = {k: v.to(CUDA) for k, v in encoder.pack_metadata(specs, layout).items()}
            with compile_state(), attention.exact_segments(lengths), torch.compiler.set_stance("fail_on_recompile"):
                timed_call(metadata)

        def fresh_pinned():
            host = {k: v.pin_memory() for k, v in encoder.pack_metadata(specs, layout).items()}
            metadata = {k: v.to(CUDA, non_blocking=True) for k, v in host.items()}
            with compile_state(), attention.exact_segments(lengths), torch.compiler.set_stance("fail_on_recompile"):
                timed_call(metadata)

        def forward_eager():
            with compile_state(), torch.compiler.set_stance("fail_on_recompile"):
                encoder.forward_eager(pixels, specs, forward=lambda *a: timed_call(a[1]))

        def eager_no_stance():
            with compile_state():
                encoder.forward_eager(pixels, specs, forward=lambda *a: timed_call(a[1]))

        paths = {
            "prepared": prepared_call,
            "fresh non_blocking": fresh_async,
            "fresh blocking": fresh_blocking,
            "fresh pinned": fresh_pinned,
            "forward_eager": forward_eager,
            "forward_eager, no stance": eager_no_stance,
        }
        for fn in paths.values():
            fn()
        torch.cuda.synchronize()
        samples = {name: ([], []) for name in paths}
        for round_ in range(7):
            for name, fn in paths.items() if round_ % 2 == 0 else list(paths.items())[::-1]:
                spans.clear()
                torch.cuda.synchronize()
                start = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                samples[name][0].append((time.perf_counter() - start) * 1e3)
                samples[name][1].append(spans[-1][0].elapsed_time(spans[-1][1]))
        for name, (wall, gpu) in samples.items():
            row = {"case": case, "path": name, "wall_ms": float(np.median(wall)), "call_span_ms": float(np.median(gpu))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    record = {**environment(), "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "stall_probe.json").write_text(json.dumps(record, indent=2))
    print("| case | path | wall ms | compiled call's GPU span ms |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['path']} | {r['wall_ms']:.2f} | {r['call_span_ms']:.2f} |")


if __name__ == "__main__":
    main()
