"""What `max_seqlen` and unused `cu_seqlens` slots cost the varlen attention kernel.

    python benchmarks/varlen_probe.py --out benchmarks/results

A graph is keyed by (token budget, max_seqlen bucket) and its `cu_seqlens` buffer has
room for the most segments a pack could need, the unused slots repeating the last offset.
This probe times `varlen_attn` on one fixed set of real segments while varying (a) the
`max_seqlen` passed and (b) the number of trailing zero-length segments, to show what a
too-large bucket or a too-large segment capacity costs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.environment import environment  # noqa: E402
from encoder_graphs.selfcheck import back_to_back_ms  # noqa: E402
from models import attention  # noqa: E402

DEVICE = torch.device("cuda")


def main() -> None:
    from torch.nn.attention.varlen import varlen_attn

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    heads, dim, rows = 16, 72, 32768
    q, k, v = (torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    results = []
    for segment in (256, 1024, 4096):
        real = rows // segment
        for max_seqlen in sorted({segment, 4 * segment, rows}):
            for slots in sorted({real, 4 * real, rows // 16}):
                if slots < real:
                    continue
                offsets = torch.full((slots + 1,), rows, dtype=torch.int32, device="cuda")
                offsets[: real + 1] = torch.arange(0, rows + 1, segment, dtype=torch.int32, device="cuda")
                ms = back_to_back_ms(lambda: varlen_attn(q, k, v, offsets, offsets, max_seqlen, max_seqlen), DEVICE)
                results.append({"segment": segment, "max_seqlen": max_seqlen, "cu_seqlens_slots": slots, "ms": ms})
                print(f"segment {segment:5d}  max_seqlen {max_seqlen:6d}  slots {slots:5d}  {ms:.3f} ms")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        **environment(),
        "rows": rows,
        "heads": heads,
        "head_dim": dim,
        "results": results,
    }
    record["backends"] = compare_backends()
    (out / "varlen_probe.json").write_text(json.dumps(record, indent=2))


def compare_backends() -> list[dict]:
    """varlen_attn's own choice (cuDNN on Hopper with cuDNN >= 9.18) vs FlashAttention-2, exact slots."""
    from torch.nn.attention.varlen import varlen_attn

    rows = []
    for head_dim in (72, 80):
        for segment, count in ((64, 512), (256, 128), (1024, 32), (4096, 8), (12544, 1), (16384, 2)):
            total = segment * count
            q, k, v = (torch.randn(total, 16, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            offsets = torch.arange(0, total + 1, segment, dtype=torch.int32, device="cuda")
            timings = {
                "auto": back_to_back_ms(lambda: varlen_attn(q, k, v, offsets, offsets, segment, segment), DEVICE),
                "flash": back_to_back_ms(lambda: attention._flash_varlen(q, k, v, offsets, segment, None), DEVICE),
            }
            reference = torch.nn.functional.scaled_dot_product_attention(
                *(t[:segment].transpose(0, 1) for t in (q, k, v))
            ).transpose(0, 1)
            rows.append(
                {
                    "head_dim": head_dim,
                    "segment": segment,
                    "segments": count,
                    **{f"{b}_ms": t for b, t in timings.items()},
                }
            )
            print(
                f"head_dim {head_dim} segment {segment:6d} x {count:4d}: "
                f"auto {timings['auto']:.3f} ms, flash {timings['flash']:.3f} ms"
            )
            flash_out = attention._flash_varlen(q, k, v, offsets, segment, None)[:segment]
            assert (flash_out.float() - reference.float()).abs().max() < 2e-2
    return rows


if __name__ == "__main__":
    main()
