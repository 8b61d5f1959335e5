"""Is the residual add + layer norm at its memory floor? Qwen3-VL's shape (GPU).

    python benchmarks/norm_probe.py --out benchmarks/results

Qwen3-VL-8B's exact 8 x 448x448 graph spends ~1.9 ms of its 15.7 in four
`triton_red_fused_add_native_layer_norm_*` kernels at 27-44 us a call
(`tuning_probe_weights.json`). One call reads two [rows, 1152] bf16 tensors and writes two: 58 MB
at 6272 rows, ~19 us at 3 TB/s. This probe times, each in its own CUDA graph, in turns:
- eager: `r = x + d; F.layer_norm(r)` as transformers runs it;
- inductor: the same function through `torch.compile` (what the tower's graph fuses);
- triton: the tower's one-pass kernel (`models/triton_norm.py`: one row a program, held in
  registers, 4 warps).
Each graph holds 20 calls. It prints us and GB/s per (rows, variant), and each variant's error
against float32. The saved `norm_probe.json` is from this script's first version (commit
c1fa949), which held its own copy of the kernel with `ROWS` rows a program and timed six tile
shapes (1-16 rows, 4 or 8 warps); one row at 4 warps won, and is what the tower's kernel runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.environment import environment  # noqa: E402
from encoder_graphs.selfcheck import back_to_back_ms, captured, relative_error  # noqa: E402
from models.triton_norm import add_layer_norm  # noqa: E402

CUDA = torch.device("cuda")
CALLS = 20  # calls per graph: one replay is far longer than its launch


def reference(x, d, w, b, eps):
    r = x + d
    return r, F.layer_norm(r, (x.shape[1],), w, b, eps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--rows", type=int, nargs="+", default=[6272, 12544])
    parser.add_argument("--hidden", type=int, default=1152)
    args = parser.parse_args()
    eps = 1e-6
    compiled = torch.compile(reference, dynamic=False)
    results = []
    for rows in args.rows:
        g = torch.Generator(device=CUDA).manual_seed(0)
        x, d = (torch.randn(rows, args.hidden, device=CUDA, dtype=torch.bfloat16, generator=g) for _ in range(2))
        w = 1 + 0.1 * torch.randn(args.hidden, device=CUDA, dtype=torch.bfloat16, generator=g)
        b = 0.1 * torch.randn(args.hidden, device=CUDA, dtype=torch.bfloat16, generator=g)
        want_r, want_y = reference(x.float(), d.float(), w.float(), b.float(), eps)
        variants = {"eager": lambda: reference(x, d, w, b, eps), "inductor": lambda: compiled(x, d, w, b, eps)}
        variants["triton (models/triton_norm.py)"] = lambda: add_layer_norm(x, d, w, b, eps)
        graphs, errors = {}, {}
        for name, fn in variants.items():
            got_r, got_y = fn()
            errors[name] = max(relative_error(got_r.float(), want_r), relative_error(got_y.float(), want_y))
            graphs[name] = captured(fn, 2, calls=CALLS).replay
        ms = {name: [] for name in graphs}
        for _ in range(5):  # in turns
            for name, replay in graphs.items():
                ms[name].append(back_to_back_ms(replay, CUDA, 10) / CALLS)
        moved = 4 * rows * args.hidden * 2  # two reads, two writes, bf16
        for name in graphs:
            best = min(ms[name])
            row = {"rows": rows, "variant": name, "us": best * 1e3, "GB/s": moved / best / 1e6, "error": errors[name]}
            results.append(row)
            print(json.dumps(row), flush=True)
    record = {**environment(), "hidden": args.hidden, "rows": results}
    path = Path(args.out) / "norm_probe.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    print(f"{record['device']}, torch {record['torch']}")
    print("| rows | variant | us | GB/s | error |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']} | {r['variant']} | {r['us']:.1f} | {r['GB/s']:.0f} | {r['error']:.1e} |")


if __name__ == "__main__":
    main()
