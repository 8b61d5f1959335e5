"""Same host, same process: the runner with one varlen attention backend against another.

    python benchmarks/attention_ab.py --preset qwen2.5-vl-7b --backends cudnn triton --out benchmarks/results

Two encoder_bench runs on two hosts differ by 4-5% from the host alone, which is more than a
kernel swap moves end to end. Here one process holds one runner per backend (the same tower
and weights), each with its own graphs captured under its backend, and times every case on all
of them in turns (`interleaved_ms`). First sighting (`recurring=False`, the route the planner
picks) and recurring (the pack's own exact-layout graph, captured under that runner's backend).
Uncompiled by default: a compiled forward guards on the backend, and compiling each runner would
take minutes; the graphs still hold every kernel, so the attention difference is all there, in a
slower whole.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.encoder_bench import CASES, build_case, measure_peak_tflops, useful_flops  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from encoder_graphs.runner import EncoderRunner, GraphConfig  # noqa: E402
from encoder_graphs.selfcheck import interleaved_ms  # noqa: E402
from models import attention, from_preset  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen2.5-vl-7b")
    parser.add_argument("--backends", nargs="+", default=["cudnn", "triton"], choices=attention.BACKENDS)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default="attention_ab")
    args = parser.parse_args()
    device = torch.device("cuda")
    encoder = from_preset(args.preset, dtype=torch.bfloat16, device=device, seed=0)
    runners = {}
    for backend in args.backends:
        attention.set_backend(backend)
        runners[backend] = EncoderRunner(encoder, GraphConfig(compile=False))
        runners[backend].capture(progress=lambda message: None)
        print(f"{backend}: captured in {runners[backend].capture_seconds:.1f} s", flush=True)
    peak = measure_peak_tflops(device)

    def call(backend: str, pixels, specs, recurring: bool):
        def run() -> None:
            attention.set_backend(backend)  # what a recurring capture or a graphless route runs
            runners[backend].run(pixels, specs, recurring=recurring)

        return run

    rng = np.random.default_rng(0)
    rows = []
    with torch.inference_mode():
        for case, items in CASES.items():
            _, pixels, specs = build_case(encoder, items, rng)
            flops = useful_flops(encoder, specs)
            for backend in args.backends:
                for _ in range(3):  # the second sighting captures the pack's own graph, if it pays
                    call(backend, pixels, specs, True)()
            paths = {}
            for backend in args.backends:
                paths[f"{backend} first"] = call(backend, pixels, specs, False)
                paths[f"{backend} rec."] = call(backend, pixels, specs, True)
            timings = interleaved_ms(paths, device, repeats=args.repeats, warmup=2)
            row = {"case": case, "patches": sum(s.input_patches for s in specs), "gflops": flops / 1e9}
            for name, ms in timings.items():
                row[f"{name} ms"] = ms
                row[f"{name} mfu"] = flops / (ms * 1e-3) / (peak * 1e12)
            rows.append(row)
            print(row, flush=True)
    attention.set_backend(attention.DEFAULT_BACKEND)
    record = {
        **environment(),
        "preset": args.preset,
        "backends": args.backends,
        "compile": False,
        "peak_tflops": peak,
        "capture_s": {b: r.capture_seconds for b, r in runners.items()},
        "stats": {b: r.stats.snapshot() for b, r in runners.items()},
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.json").write_text(json.dumps(record, indent=1, default=str))
    a, b = args.backends[:2]
    print(f"\n{args.preset}, uncompiled graphs, peak {peak:.0f} TFLOP/s; ms (MFU), {b} / {a} time ratio")
    header = [a + " first", b + " first", "ratio", a + " rec.", b + " rec.", "ratio"]
    print(f"{'case':28} " + " ".join(f"{h:>16}" for h in header))
    for row in rows:
        cells = []
        for kind in ("first", "rec."):
            for backend in (a, b):
                cells.append(f"{row[f'{backend} {kind} ms']:7.2f} ({row[f'{backend} {kind} mfu']:.1%})")
            cells.append(f"{row[f'{b} {kind} ms'] / row[f'{a} {kind} ms']:.3f}")
        print(f"{row['case']:28} " + " ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
