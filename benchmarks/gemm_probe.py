"""Do the towers' matmuls leave time on the table? Each block's linear layers, one by one (GPU).

    python benchmarks/gemm_probe.py --presets qwen3-vl-8b --rows 6272 12544 --out benchmarks/results

For every linear layer of one vision block (shapes read from the built tower, so the fused MLP
modules count as they run) and every row count, the same product three ways, each captured in a
CUDA graph of 10 calls and replayed, in turns (best of 3 rounds):
- aten: what the tower runs (`F.linear`, or fc1's cuBLASLt GELU epilogue), weight `[out, in]`;
- aten_wt: the same op on a pre-transposed `[in, out]` weight (cuBLAS picks its kernel by layout);
- max_autotune: inductor's `max-autotune-no-cudagraphs` compile of the same function at this
  exact shape (Triton matmul templates with the bias / GELU fused, benchmarked against cuBLAS; it
  keeps whichever is faster, so it is never slower than aten by its own measurement).
Plus the block's fused residual-add + layer norm as inductor compiles it, as memory bandwidth.
TFLOP/s count 2 * rows * in * out. Prints a table, saves `gemm_probe.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.encoder_bench import measure_peak_tflops  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from encoder_graphs.selfcheck import back_to_back_ms, captured, relative_error  # noqa: E402
from models import from_preset  # noqa: E402
from models.qwen import GeluEpilogueMLP  # noqa: E402

CUDA = torch.device("cuda")
CALLS = 10  # per graph: one replay's launch cost spread over ten products


def block_linears(encoder) -> list[tuple[str, torch.nn.Linear, bool]]:
    """(name, module, GELU epilogue?) for each linear layer of the tower's first block."""
    block = encoder.tower.blocks[0]
    gelu = {id(m.linear_fc1) for m in block.modules() if isinstance(m, GeluEpilogueMLP)}
    return [(n, m, id(m) in gelu) for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]


def timed_in_turns(fns: dict, rounds: int = 3) -> dict[str, float]:
    """Best ms per call of each fn, its graph replayed in turns with the others."""
    graphs = {name: captured(fn, calls=CALLS) for name, fn in fns.items()}
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, graph in graphs.items():
            best[name] = min(best[name], back_to_back_ms(graph.replay, CUDA, repeats=20) / CALLS)
    return best


def probe_linear(name: str, module: torch.nn.Linear, gelu: bool, rows: int) -> dict:
    weight, bias = module.weight.detach(), module.bias.detach()
    weight_t = weight.t().contiguous()
    x = torch.randn(rows, module.in_features, device=CUDA, dtype=weight.dtype)

    if gelu:

        def aten():
            return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)

        def aten_wt():
            return torch._addmm_activation(bias, x, weight_t, use_gelu=True)

        def reference(inp):
            return F.gelu(F.linear(inp, weight, bias), approximate="tanh")
    else:

        def aten():
            return F.linear(x, weight, bias)

        def aten_wt():
            return torch.addmm(bias, x, weight_t)

        def reference(inp):
            return F.linear(inp, weight, bias)

    torch._dynamo.reset()
    compiled = torch.compile(reference, mode="max-autotune-no-cudagraphs", dynamic=False)
    start = time.perf_counter()
    with torch.no_grad():
        compiled(x)
    compile_s = time.perf_counter() - start
    expected = reference(x)
    errors = {"aten_wt": relative_error(aten_wt(), expected), "max_autotune": relative_error(compiled(x), expected)}
    ms = timed_in_turns({"aten": aten, "aten_wt": aten_wt, "max_autotune": lambda: compiled(x)})
    flops = 2 * rows * module.in_features * module.out_features
    return {
        "layer": name + (" (+GELU epilogue)" if gelu else ""),
        "rows": rows,
        "in": module.in_features,
        "out": module.out_features,
        "ms": ms,
        "tflops": {k: flops / (v * 1e-3) / 1e12 for k, v in ms.items()},
        "error_vs_aten_reference": errors,
        "max_autotune_compile_s": round(compile_s, 1),
    }


def probe_layer_norm(hidden: int, rows: int, dtype: torch.dtype) -> dict:
    """`h = x + y; n = layer_norm(h)` as inductor fuses it: reads x, y; writes h, n."""
    x, y = (torch.randn(rows, hidden, device=CUDA, dtype=dtype) for _ in range(2))
    w, b = torch.ones(hidden, device=CUDA, dtype=dtype), torch.zeros(hidden, device=CUDA, dtype=dtype)

    def fn(x, y):
        h = x + y
        return h, F.layer_norm(h, (hidden,), w, b, 1e-6)

    torch._dynamo.reset()
    compiled = torch.compile(fn, dynamic=False)
    ms = timed_in_turns({"inductor": lambda: compiled(x, y)})["inductor"]
    moved = 4 * rows * hidden * x.element_size()
    return {"layer": "residual add + layer_norm", "rows": rows, "hidden": hidden, "ms": ms, "gb_s": moved / ms / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--presets", nargs="+", default=["qwen3-vl-8b"])
    parser.add_argument("--rows", nargs="+", type=int, default=[6272, 12544])
    args = parser.parse_args()
    torch._inductor.config.max_autotune_gemm_backends = "ATEN,TRITON"
    peak = measure_peak_tflops(CUDA)
    record = {**environment(), "peak_tflops": peak, "presets": {}}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for preset in args.presets:
        encoder = from_preset(preset, dtype=torch.bfloat16, device=CUDA, seed=0)
        rows_out = record["presets"].setdefault(preset, [])
        for rows in args.rows:
            for name, module, gelu in block_linears(encoder):
                row = probe_linear(name, module, gelu, rows)
                rows_out.append(row)
                print(json.dumps(row), flush=True)
                (out_dir / "gemm_probe.json").write_text(json.dumps(record, indent=2))
            hidden = encoder.tower.blocks[0].norm1.weight.shape[0]
            row = probe_layer_norm(hidden, rows, torch.bfloat16)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
        del encoder
        torch.cuda.empty_cache()
    (out_dir / "gemm_probe.json").write_text(json.dumps(record, indent=2))
    print(f"\n{record['device']}, torch {record['torch']}, peak {peak:.0f} TFLOP/s (8192^3)")
    print("| preset | layer | rows | in x out | aten | aten_wt | max_autotune | (TFLOP/s; GB/s for norms) |")
    print("|---|---|---|---|---|---|---|---|")
    for preset, rows_out in record["presets"].items():
        for r in rows_out:
            if "tflops" in r:
                t = r["tflops"]
                print(
                    f"| {preset} | {r['layer']} | {r['rows']} | {r['in']} x {r['out']} | {t['aten']:.0f} "
                    f"| {t['aten_wt']:.0f} | {t['max_autotune']:.0f} | |"
                )
            else:
                print(f"| {preset} | {r['layer']} | {r['rows']} | {r['hidden']} | {r['gb_s']:.0f} GB/s | | | |")


if __name__ == "__main__":
    main()
