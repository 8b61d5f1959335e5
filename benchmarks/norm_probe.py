"""Is the residual add + layer norm at its memory floor? Qwen3-VL's shape (GPU).

    python benchmarks/norm_probe.py --out benchmarks/results

Qwen3-VL-8B's exact 8 x 448x448 graph spends ~1.9 ms of its 15.7 in four
`triton_red_fused_add_native_layer_norm_*` kernels at 27-44 us a call
(`tuning_probe_weights.json`). One call reads two [rows, 1152] bf16 tensors and writes two: 58 MB
at 6272 rows, ~19 us at 3 TB/s. This probe times, each in its own CUDA graph, in turns:
- eager: `r = x + d; F.layer_norm(r)` as transformers runs it;
- inductor: the same function through `torch.compile` (what the tower's graph fuses);
- triton: a hand-written one-pass kernel (`ROWS` rows a program, the row held in registers),
  at a few tile shapes.
Each graph holds 20 calls. It prints us and GB/s per (rows, variant), and each variant's error against float32.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.environment import environment  # noqa: E402
from encoder_graphs.selfcheck import back_to_back_ms, captured, relative_error  # noqa: E402

CUDA = torch.device("cuda")
CALLS = 20  # calls per graph: one replay is far longer than its launch


@triton.jit
def _add_layer_norm(
    x_ptr, d_ptr, w_ptr, b_ptr, r_ptr, y_ptr, rows, eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    row0 = tl.program_id(0) * ROWS
    r_idx = row0 + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (r_idx[:, None] < rows) & (cols[None, :] < N)
    offs = r_idx[:, None].to(tl.int64) * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    d = tl.load(d_ptr + offs, mask=mask, other=0.0)
    r = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # rounded as the bf16 add rounds it
    tl.store(r_ptr + offs, r, mask=mask)
    rf = r.to(tl.float32)
    mean = tl.sum(rf, axis=1) / N
    centred = tl.where(mask, rf - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / N + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = centred * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(y_ptr + offs, y.to(x.dtype), mask=mask)


def add_layer_norm(x, d, w, b, eps, rows_per_program=4, num_warps=4):
    rows, n = x.shape
    r, y = torch.empty_like(x), torch.empty_like(x)
    grid = (triton.cdiv(rows, rows_per_program),)
    _add_layer_norm[grid](
        x, d, w, b, r, y, rows, eps, N=n, BLOCK_N=triton.next_power_of_2(n), ROWS=rows_per_program, num_warps=num_warps
    )
    return r, y


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
    tiles = [(1, 4), (2, 4), (4, 4), (4, 8), (8, 8), (16, 8)]
    results = []
    for rows in args.rows:
        g = torch.Generator(device=CUDA).manual_seed(0)
        x, d = (torch.randn(rows, args.hidden, device=CUDA, dtype=torch.bfloat16, generator=g) for _ in range(2))
        w = 1 + 0.1 * torch.randn(args.hidden, device=CUDA, dtype=torch.bfloat16, generator=g)
        b = 0.1 * torch.randn(args.hidden, device=CUDA, dtype=torch.bfloat16, generator=g)
        want_r, want_y = reference(x.float(), d.float(), w.float(), b.float(), eps)
        variants = {"eager": lambda: reference(x, d, w, b, eps), "inductor": lambda: compiled(x, d, w, b, eps)}
        for rpp, warps in tiles:
            variants[f"triton {rpp} rows / {warps} warps"] = lambda rpp=rpp, warps=warps: add_layer_norm(
                x, d, w, b, eps, rpp, warps
            )
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
