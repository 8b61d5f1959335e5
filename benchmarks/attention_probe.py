"""Exact-layout attention kernels, in CUDA graphs (GPU): what the grouped op buys, and whether
padding Qwen3-VL's head dim 72 helps cuDNN.

    python benchmarks/attention_probe.py --out benchmarks/results

1. Mixed packs (unequal segments, the bench's mixed case: 896 + 4 x 448 + 8 x 224), at both
   models' head shapes (Qwen3-VL 16 x 72, Qwen2.5-VL 16 x 80): the varlen kernel
   (FlashAttention-2, what padded graphs run) against `attention.exact_attention` (each run of
   equal segments as one dense cuDNN batch), and the same pack with its items interleaved.
2. One 12544-patch segment (1792x1792) at head dim 72: cuDNN as the op runs it, and cuDNN on
   q/k/v zero-padded to 80, 96 and 128 (the pad and the slice timed with it; the scale stays
   72 ** -0.5), to see whether a padded head dim is faster end to end.
TFLOP/s counts the useful FLOPs (true head dim, block-diagonal).
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
from encoder_graphs.selfcheck import graph_replay_ms, relative_error  # noqa: E402
from models import attention  # noqa: E402

HEADS = 16
MIXED = [3136] + [784] * 4 + [196] * 8
INTERLEAVED = [3136] + [784, 196, 196] * 4


def flops(lengths: list[int], dim: int) -> float:
    return 4.0 * sum(n * n for n in lengths) * HEADS * dim


def qkv(rows: int, dim: int) -> list[torch.Tensor]:
    # One [rows, 3, heads, dim] projection output, split as the towers do (strided views).
    return list(torch.randn(rows, 3, HEADS, dim, device="cuda", dtype=torch.bfloat16).unbind(1))


def grouped_rows(lengths: list[int], dim: int) -> list[dict]:
    rows = sum(lengths)
    q, k, v = qkv(rows, dim)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    scale, longest = dim**-0.5, max(lengths)

    def grouped():
        with attention.exact_segments(lengths):
            return attention.exact_attention(q, k, v, cu, longest, scale)

    out = []

    def varlen():
        return attention._varlen_cuda(q, k, v, cu, longest, scale)

    reference = varlen()
    for name, fn in {"fa2 varlen": varlen, "grouped": grouped}.items():
        ms = graph_replay_ms(fn)
        groups = len(attention.segment_groups(lengths)) if name == "grouped" else 1
        out.append(
            {
                "kernel": name,
                "calls": groups,
                "ms": ms,
                "tflops": flops(lengths, dim) / ms / 1e9,
                "err_vs_varlen": relative_error(fn(), reference),
            }
        )
    return out


def padded_dim_rows(length: int = 12544, dim: int = 72) -> list[dict]:
    q, k, v = qkv(length, dim)
    scale = dim**-0.5
    reference = attention._dense(q, k, v, length, scale)
    out = []
    for padded in (dim, 80, 96, 128):

        def run(padded=padded):
            if padded == dim:
                return attention._dense(q, k, v, length, scale)
            wide = [F.pad(t, (0, padded - dim)) for t in (q, k, v)]
            return attention._dense(*wide, length, scale)[..., :dim]

        ms = graph_replay_ms(run)
        out.append(
            {
                "head_dim": padded,
                "ms": ms,
                "useful_tflops": flops([length], dim) / ms / 1e9,
                "err_vs_72": relative_error(run(), reference),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    record = {
        **environment(),
        "mixed": {},
        "padded_head_dim_12544": padded_dim_rows(),
    }
    for model, dim in (("qwen3-vl (16 x 72)", 72), ("qwen2.5-vl (16 x 80)", 80)):
        for name, lengths in (("mixed", MIXED), ("interleaved", INTERLEAVED)):
            record["mixed"][f"{model} {name}"] = grouped_rows(lengths, dim)
    path = Path(args.out) / "attention_probe.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    print(f"{record['device']}, torch {record['torch']}, cuDNN {record['cudnn']}")
    print("| pack | kernel | calls | ms | TFLOP/s | err vs varlen |\n|---|---|---|---|---|---|")
    for pack, rows in record["mixed"].items():
        for r in rows:
            cells = [pack, r["kernel"], r["calls"], f"{r['ms']:.3f}", f"{r['tflops']:.0f}", f"{r['err_vs_varlen']:.1e}"]
            print("| " + " | ".join(map(str, cells)) + " |")
    print("\n| 1 x 12544, head dim | ms | useful TFLOP/s | err vs 72 |\n|---|---|---|---|")
    for r in record["padded_head_dim_12544"]:
        print(f"| {r['head_dim']} | {r['ms']:.3f} | {r['useful_tflops']:.0f} | {r['err_vs_72']:.1e} |")


if __name__ == "__main__":
    main()
