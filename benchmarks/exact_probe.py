"""Would large packs reach 50% MFU without padding? Qwen3-VL-8B, one process (GPU).

    python benchmarks/exact_probe.py --out benchmarks/results

Each bench case runs on its exact layout (no padding rows, no padding segments; equal
segments as a dense batch, so cuDNN attention) three ways:
- eager: `forward_eager`, the runner's eager route (transformers modules, uncompiled);
- compiled: the same call through `torch.compile(forward_padded, dynamic=True)`, no graph;
  the first call's compile time and the dynamo graph count say whether a new shape recompiles;
- exact graph: that compiled call captured in a CUDA graph for this exact pack, the upper bound
  of any padded-graph scheme.
Then a kernel-category profile of the exact 8 x 448x448 graph.

Result (2026-11-22, H100): `benchmarks/results/exact_probe.json`, summarised in
`benchmarks/results/README.md`. It led to the runner's exact route (`compile_exact`). Its
first GPU run failed: `dense_hint_hits` was counted inside the compiled forward, so every
call recompiled (now not counted while compiling). The saved run came before one later
change: the dense hint then carried the segment count (the count now follows from the rows;
one image and several still compile apart, through the towers' position metadata). Rows also
record `exact_graph_error` when capture fails, and the recompile reasons go to stderr.
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

from benchmarks.encoder_bench import CASES, build_case, measure_peak_tflops, useful_flops  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from benchmarks.fusion_probe import kernel_profile  # noqa: E402
from encoder_graphs.selfcheck import captured, graph_replay_ms, interleaved_ms, relative_error  # noqa: E402
from models import from_preset  # noqa: E402

CUDA = torch.device("cuda")


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--preset", default="qwen3-vl-8b")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny preset, no compile/graphs: checks the script")
    args = parser.parse_args()
    device = torch.device("cpu") if args.smoke else CUDA
    torch._dynamo.config.recompile_limit = 64
    if not args.smoke:
        torch._logging.set_logs(recompiles=True, graph_breaks=True)  # why a case compiles again
    torch._dynamo.config.accumulated_recompile_limit = 256
    peak = float("nan") if args.smoke else measure_peak_tflops(CUDA)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    encoder = from_preset("qwen3-vl-tiny" if args.smoke else args.preset, dtype=dtype, device=device, seed=0)
    compiled = encoder.forward_padded if args.smoke else torch.compile(encoder.forward_padded, dynamic=True)
    rng = np.random.default_rng(0)
    out_dir = Path(args.out)
    rows = []
    # Two shapes no case above has, run last: once warm, does a fresh shape recompile?
    unseen = {
        "unseen 7 x 448x448": [("image", 448, 448)] * 7,
        "unseen mixed 672 + 3x448 + 5x336": [("image", 672, 672)]
        + [("image", 448, 448)] * 3
        + [("image", 336, 336)] * 5,
    }
    for case, items in {**CASES, **unseen}.items():
        if case == "1 x 224x224":  # launch-bound, not a padding question
            continue
        _, pixels, specs = build_case(encoder, items, rng)
        layout = encoder.exact_layout(specs)
        metadata = {k: v.to(device) for k, v in encoder.pack_metadata(specs, layout).items()}
        dense = len({s.frame_patches for s in specs}) == 1
        flops = useful_flops(encoder, specs)

        def run_compiled():
            return compiled(pixels, metadata, layout, dense)

        with torch.no_grad():
            graphs_before = graphs_compiled()
            start = time.perf_counter()
            out = run_compiled()
            torch.cuda.synchronize() if device.type == "cuda" else None
            first_s = time.perf_counter() - start
            new_graphs = graphs_compiled() - graphs_before
            eager_out = encoder.forward_eager(pixels, specs)
            err = relative_error(out.tokens, eager_out.tokens)
            graph_ms, graph_error = float("nan"), None
            if not args.smoke:
                try:  # a recompile inside capture fails the capture: record it, go on
                    with torch.compiler.set_stance("fail_on_recompile"):
                        graph_ms = graph_replay_ms(run_compiled, repeats=10)
                except Exception as exc:  # noqa: BLE001
                    graph_error = f"{type(exc).__name__}: {str(exc)[:300]}"
                    torch.cuda.synchronize()
            timings = interleaved_ms(
                {"eager": lambda: encoder.forward_eager(pixels, specs), "compiled": run_compiled},
                device,
                repeats=7,
                warmup=2,
            )
        row = {
            "case": case,
            "patches": layout.token_budget * encoder.merge_unit,
            "dense": dense,
            "first_call_s": round(first_s, 2),
            "new_dynamo_graphs": new_graphs,
            "err_vs_eager": err,
            "eager_ms": timings["eager"],
            "compiled_ms": timings["compiled"],
            "exact_graph_ms": graph_ms,
            "exact_graph_error": graph_error,
            "gflops": flops / 1e9,
        }
        for path in ("eager", "compiled", "exact_graph"):
            row[f"mfu_{path}"] = flops / (row[f"{path}_ms"] * 1e-3) / (peak * 1e12)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not args.smoke:  # partial results survive a time limit
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "exact_probe.json").write_text(json.dumps({"partial": True, "cases": rows}, indent=2))

    if args.smoke:
        return
    _, pixels, specs = build_case(encoder, CASES["8 x 448x448"], rng)
    layout = encoder.exact_layout(specs)
    metadata = {k: v.to(CUDA) for k, v in encoder.pack_metadata(specs, layout).items()}
    with torch.no_grad():
        graph = captured(lambda: compiled(pixels, metadata, layout, True))
    totals, table = kernel_profile(graph.replay)
    record = {
        **environment(),
        "peak_tflops": peak,
        "cases": rows,
        "profile_ms_exact_8x448": totals,
        "profile_table": table,
    }
    (out_dir / "exact_probe.json").write_text(json.dumps(record, indent=2, default=str))
    print(record["profile_table"])
    print(record["profile_ms_exact_8x448"])
    print(f"\npeak {peak:.0f} TFLOP/s")
    print("| case | dense | first call s | new graphs | err | eager ms | compiled ms | exact graph ms | MFU e/c/g |")
    for r in rows:
        print(
            f"| {r['case']} | {r['dense']} | {r['first_call_s']} | {r['new_dynamo_graphs']} | {r['err_vs_eager']:.1e} "
            f"| {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | {r['exact_graph_ms']:.2f} "
            f"| {r['mfu_eager']:.1%} / {r['mfu_compiled']:.1%} / {r['mfu_exact_graph']:.1%} |"
        )


if __name__ == "__main__":
    main()
