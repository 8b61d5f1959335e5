"""How each linear layer's matmul time depends on its weight's layout and on the row count (GPU).

    python benchmarks/weight_layout_probe.py --presets qwen3-vl-8b qwen2.5-vl-7b --step 128 --out benchmarks/results

`F.linear(x, w)` multiplies by `w.t()`. With `w` row-major ([out, in], contiguous) cuBLAS gets a
transposed operand; with `w` column-major (the same [out, in] tensor with strides (1, out)) a
plain row-major [in, out] one, and it picks other kernels. For every group of linear layers of
one shape that a forward calls as `nn.Linear`, this times `F.linear` with the weight both ways
at a sweep of row counts, each in its own CUDA graph of 8 calls, in turns. Prints, per group,
the column-major / row-major time ratio at a few row counts, at how many points column-major is
>= 2% faster, and both layouts' summed time over the sweep; saves the whole sweep.

Findings (H100, `benchmarks/results/weight_layout_probe.json`, `tuning_probe_weights.json`,
`tuning_probe_qwen2.5_down.json`): which layout wins changes with the rows for most shapes
(cuBLAS's heuristics), so one layout per weight buys nothing on average; the exceptions did
not show end to end. See `benchmarks/results/README.md`, session 13.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.environment import environment  # noqa: E402
from encoder_graphs.exact_route import compile_state  # noqa: E402
from encoder_graphs.selfcheck import captured, interleaved_ms, synthetic_pixels, synthetic_specs  # noqa: E402
from models import from_preset  # noqa: E402

CALLS_PER_GRAPH = 8


def set_column_major(linear: torch.nn.Linear, column_major: bool) -> None:
    """Lay out `linear.weight` column-major (or row-major); same values, same shape."""
    weight = linear.weight.data.contiguous()
    linear.weight.data = weight.t().contiguous().t() if column_major else weight


def rows_per_patch(module: torch.nn.Module, run, patches: int) -> dict[str, float]:
    """Input rows each `nn.Linear` of `module` sees per input patch in one call of `run` (a
    forward over `patches` input patches): 1 for a block's layers, 1/4 for a 2x2 merger's.
    Layers not called as modules (Qwen3-VL's fc1, run through its GELU epilogue) are absent."""
    seen: dict[str, int] = {}
    handles = []
    for name, layer in module.named_modules():
        if isinstance(layer, torch.nn.Linear):

            def hook(layer, inputs, name=name):
                seen[name] = max(seen.get(name, 0), inputs[0].numel() // layer.in_features)

            handles.append(layer.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return {name: rows / patches for name, rows in seen.items()}


def graph_ms(candidates: dict, device: torch.device, repeats: int) -> dict[str, float]:
    """ms per call of each candidate, each captured in its own CUDA graph, timed in turns."""
    graphs = {name: captured(fn, warmup=1, calls=CALLS_PER_GRAPH) for name, fn in candidates.items()}
    ms = interleaved_ms({name: graph.replay for name, graph in graphs.items()}, device, repeats=repeats)
    return {name: value / CALLS_PER_GRAPH for name, value in ms.items()}


CUDA = torch.device("cuda")


def sweep(preset: str, rows: list[int], repeats: int) -> list[dict]:
    encoder = from_preset(preset, dtype=torch.bfloat16, device=CUDA, seed=0)
    unit = encoder.merge_unit
    specs = synthetic_specs(256, 256 * unit, unit, 16)
    pixels = synthetic_pixels(specs, encoder.patch_dim, CUDA).to(encoder.dtype)
    patches = sum(s.input_patches for s in specs)
    with compile_state():
        ratios = rows_per_patch(encoder.tower, lambda: encoder.forward_eager(pixels, specs), patches)
    layers = dict(encoder.tower.named_modules())
    groups: dict[tuple, list[str]] = {}
    for name, ratio in ratios.items():
        layer = layers[name]
        groups.setdefault((layer.out_features, layer.in_features, ratio), []).append(name)
    out = []
    for (out_features, in_features, ratio), names in groups.items():
        first = layers[names[0]]
        row_major = first.weight.detach().contiguous()
        column_major = row_major.t().contiguous().t()
        bias = None if first.bias is None else first.bias.detach()
        points = []
        for patch_rows in rows:
            count = max(1, round(patch_rows * ratio))
            x = torch.randn(count, in_features, dtype=encoder.dtype, device=CUDA)
            ms = graph_ms(
                {
                    "row": lambda x=x: torch.nn.functional.linear(x, row_major, bias),
                    "column": lambda x=x: torch.nn.functional.linear(x, column_major, bias),
                },
                CUDA,
                repeats,
            )
            flops = 2 * count * in_features * out_features
            points.append(
                {
                    "patches": patch_rows,
                    "rows": count,
                    "row_major_ms": ms["row"],
                    "column_major_ms": ms["column"],
                    "row_major_tflops": flops / ms["row"] / 1e9,
                    "column_major_tflops": flops / ms["column"] / 1e9,
                }
            )
        out.append(
            {
                "preset": preset,
                "layers": names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1})",
                "shape": [out_features, in_features],
                "rows_per_patch": ratio,
                "points": points,
            }
        )
        print(f"{preset} {out[-1]['layers']} {out_features}x{in_features}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", nargs="+", default=["qwen3-vl-8b", "qwen2.5-vl-7b"])
    parser.add_argument("--min-patches", type=int, default=1024)
    parser.add_argument("--max-patches", type=int, default=32768)
    parser.add_argument("--step", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    rows = list(range(args.min_patches, args.max_patches + 1, args.step))
    groups = [g for preset in args.presets for g in sweep(preset, rows, args.repeats)]
    record = {**environment(), "patch_rows": rows, "groups": groups}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"weight_layout_probe{args.tag}.json").write_text(json.dumps(record, indent=2))
    print(f"\n{record['device']}, torch {record['torch']}")
    print(
        "| model | layers | shape | column/row at 4096 / 6272 / 8192 / 12544 / 16384 / 32768 patches "
        "| column faster at | sum row ms | sum column ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for g in groups:
        by = {p["patches"]: p for p in g["points"]}
        marks = [
            f"{by[r]['column_major_ms'] / by[r]['row_major_ms']:.2f}" if r in by else "-"
            for r in (4096, 6272, 8192, 12544, 16384, 32768)
        ]
        faster = sum(p["column_major_ms"] < 0.98 * p["row_major_ms"] for p in g["points"])
        total_row = sum(p["row_major_ms"] for p in g["points"])
        total_column = sum(p["column_major_ms"] for p in g["points"])
        print(
            f"| {g['preset']} | {g['layers']} | {g['shape'][0]}x{g['shape'][1]} | {' / '.join(marks)} "
            f"| {faster}/{len(g['points'])} | {total_row:.1f} | {total_column:.1f} |"
        )


if __name__ == "__main__":
    main()
