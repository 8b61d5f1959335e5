"""Our Triton varlen kernel (`models/triton_attention.py`, a head-wide tile) against cuDNN
and FlashAttention-2 on the GPU host.

    python benchmarks/triton_probe.py --out benchmarks/results

cuDNN runs Qwen3-VL's 16 x 72 heads in its 128-wide kernel (`cudnn_probe.json`): on one
12544-patch segment 389 useful TFLOP/s. The Triton kernel computes 80 columns for a 72-wide
head. Two parts:

1. sweep: tile configurations of the Triton kernel on the three layouts that matter most
   (one 1792x1792 image, 8 x 448x448, the padded mixed pack), both head shapes, and a 16 x 64
   head (no narrow part: the kernel's ceiling on this host). Each tile runs in its own process:
   a tile that faults (Triton 3.6 gave an illegal address at 128 x 64 on the first try, correct
   under the interpreter) costs its row, not the run;
2. layouts: every layout of `cudnn_probe.py` (exact and padded, both head shapes), each kernel
   captured in a CUDA graph, the Triton kernel at the sweep's best tile; error of every kernel
   against a float32 reference on the real rows (per segment, the math kernel).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cudnn_probe import HEADS, layouts  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from encoder_graphs.selfcheck import graph_replay_ms  # noqa: E402
from models.layout import padded_cu_seqlens  # noqa: E402

SWEEP_LAYOUTS = ("exact 1 x 1792", "exact 8 x 448", "padded mixed")
TILES = [(128, 32, 4, 3), (128, 32, 4, 2), (128, 32, 8, 3), (64, 32, 4, 3), (128, 64, 4, 3), (64, 64, 4, 3)]
"""(block_m, block_n, num_warps, num_stages)."""


def reference(q, k, v, lengths, scale, limit=4096):
    """float32 attention per segment (the math kernel), on at most `limit` query rows of each."""
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].float().transpose(0, 1) for t in (q, k, v))
        rows = min(n, limit)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs[:, :rows], ks, vs, scale=scale).transpose(0, 1))
        start += n
    return outs


def error(out, ref, lengths, limit=4096):
    worst, start = 0.0, 0
    for n, r in zip(lengths, ref, strict=True):
        o = out[start : start + min(n, limit)].float()
        worst = max(worst, ((o - r).abs().max() / r.abs().max()).item())
        start += n
    return worst


def kernels(q, k, v, cu, max_seqlen, lengths, rows, scale, tile):
    import cudnn

    from models.triton_attention import TileConfig, varlen_attention

    out = torch.empty_like(q)
    paths = {
        "fa2 varlen": lambda: torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, False, False, scale=scale
        )[0],
        "cudnn-fe varlen": lambda: cudnn.sdpa_torch(
            q, k, v, scale=scale, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen
        ),
        "triton varlen": lambda: varlen_attention(q, k, v, cu, max_seqlen, scale, out, TileConfig(*tile)),
    }
    if len(set(lengths)) == 1 and sum(lengths) == rows:
        count, length = len(lengths), lengths[0]

        def dense():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            batch = [t.unflatten(0, (count, length)).transpose(1, 2) for t in (q, k, v)]
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                out = torch.nn.functional.scaled_dot_product_attention(*batch, scale=scale)
            return out.transpose(1, 2).flatten(0, 1)

        paths["sdpa cudnn dense"] = dense
    return paths


def inputs(heads, dim, lengths, rows, max_seqlen, slots):
    torch.manual_seed(0)
    qkv = torch.randn(rows, 3, heads, dim, device="cuda", dtype=torch.bfloat16)  # the tower's layout
    cu = padded_cu_seqlens(lengths, rows, max_seqlen, slots).cuda()
    return qkv[:, 0], qkv[:, 1], qkv[:, 2], cu


CEILING = {"ceiling (16 x 64)": (16, 64, 16)}
"""Swept first: the rate without a narrow part."""


def sweep_tile(tile) -> list[dict]:
    """One tile on every sweep layout (in a child process: see the module doc)."""
    from models.triton_attention import TileConfig, varlen_attention

    rows_out = []
    for model, (heads, dim, patch) in (CEILING | HEADS).items():
        for name in SWEEP_LAYOUTS if model in HEADS else SWEEP_LAYOUTS[:1]:
            lengths, rows, max_seqlen, slots = layouts(patch)[name]
            q, k, v, cu = inputs(heads, dim, lengths, rows, max_seqlen, slots)
            flops = 4 * sum(n * n for n in lengths) * heads * dim
            out = torch.empty_like(q)
            row = {"model": model, "layout": name, "tile": list(tile)}
            row["ms"] = graph_replay_ms(
                lambda: varlen_attention(q, k, v, cu, max_seqlen, dim**-0.5, out, TileConfig(*tile))
            )
            row["tflops"] = flops / row["ms"] / 1e9
            print(json.dumps(row), flush=True)  # before the next layout: a fault loses only its row
            rows_out.append(row)
    return rows_out


def sweep() -> tuple[list[dict], dict]:
    import subprocess

    rows_out, best = [], {}
    for tile in TILES:
        child = subprocess.run(
            [sys.executable, __file__, "--tile", ",".join(map(str, tile))], capture_output=True, text=True
        )
        lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
        rows_out.extend(json.loads(line) for line in lines)
        if child.returncode:
            errors = [line for line in child.stderr.splitlines() if "Error" in line] or ["no output"]
            rows_out.append({"tile": list(tile), "error": errors[-1][:300], "rows_before": len(lines)})
        print(rows_out[-1], flush=True)
    for model in HEADS | CEILING:
        for name in SWEEP_LAYOUTS:
            timed = [r for r in rows_out if r.get("model") == model and r.get("layout") == name]
            if timed:
                best[(model, name)] = tuple(min(timed, key=lambda r: r["ms"])["tile"])
    return rows_out, best


def layout_probe(best: dict) -> list[dict]:
    rows_out = []
    for model, (heads, dim, patch) in HEADS.items():
        tile = best.get((model, "exact 1 x 1792"), (128, 64, 4, 3))
        for name, (lengths, rows, max_seqlen, slots) in layouts(patch).items():
            q, k, v, cu = inputs(heads, dim, lengths, rows, max_seqlen, slots)
            used, scale = sum(lengths), dim**-0.5
            flops = 4 * sum(n * n for n in lengths) * heads * dim
            ref = reference(q, k, v, lengths, scale)
            for label, fn in kernels(q, k, v, cu, max_seqlen, lengths, rows, scale, tile).items():
                row = {"model": model, "layout": name, "kernel": label, "rows": rows, "used": used}
                if label == "triton varlen":
                    row["tile"] = tile
                try:
                    out = fn()[:used]
                    row["nonfinite"] = int((~torch.isfinite(out)).sum())
                    row["err_vs_fp32"] = error(out, ref, lengths)
                    row["ms"] = graph_replay_ms(fn)
                    row["tflops"] = flops / row["ms"] / 1e9
                except Exception as exc:  # noqa: BLE001 - a probe records what does not run
                    torch.cuda.synchronize()
                    row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                rows_out.append(row)
                print(row, flush=True)
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile sweep (default tile)")
    parser.add_argument("--tile", help="internal: time one tile (m,n,warps,stages), print JSON rows")
    args = parser.parse_args()
    if args.tile:
        sweep_tile(tuple(int(x) for x in args.tile.split(",")))
        return
    import triton

    sweep_rows, best = ([], {}) if args.no_sweep else sweep()
    rows = layout_probe(best)
    record = {
        "environment": environment() | {"triton": triton.__version__},
        "sweep": sweep_rows,
        "best_tile": {f"{m} | {n}": t for (m, n), t in best.items()},
        "layouts": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "triton_probe.json").write_text(json.dumps(record, indent=1))
    print("\nbest tiles (block_m, block_n, warps, stages):")
    for (model, name), tile in best.items():
        hit = [r for r in sweep_rows if (r.get("model"), r.get("layout"), tuple(r["tile"])) == (model, name, tile)]
        print(f"  {model} | {name}: {tile} {hit[0]['ms']:.3f} ms {hit[0]['tflops']:.0f} TFLOP/s")
    print(f"\n{'model':22} {'layout':18} " + " ".join(f"{k:>22}" for k in ("fa2", "cudnn-fe", "sdpa dense", "triton")))
    for model in HEADS:
        for name in layouts(HEADS[model][2]):
            cells = []
            for label in ("fa2 varlen", "cudnn-fe varlen", "sdpa cudnn dense", "triton varlen"):
                hit = [r for r in rows if r["model"] == model and r["layout"] == name and r["kernel"] == label]
                if not hit:
                    cells.append(f"{'-':>22}")
                elif "ms" in hit[0]:
                    r = hit[0]
                    cells.append(f"{r['ms']:7.3f}ms {r['tflops']:4.0f}T {r['err_vs_fp32']:.0e}")
                else:
                    cells.append(f"{'error':>22}")
            print(f"{model:22} {name:18} " + " ".join(cells))


if __name__ == "__main__":
    main()
