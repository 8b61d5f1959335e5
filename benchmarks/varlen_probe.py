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
import time
from pathlib import Path

import torch


def time_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / repeats


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
                ms = time_ms(lambda: varlen_attn(q, k, v, offsets, offsets, max_seqlen, max_seqlen))
                results.append({"segment": segment, "max_seqlen": max_seqlen, "cu_seqlens_slots": slots, "ms": ms})
                print(f"segment {segment:5d}  max_seqlen {max_seqlen:6d}  slots {slots:5d}  {ms:.3f} ms")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "rows": rows,
        "heads": heads,
        "head_dim": dim,
        "results": results,
    }
    (out / "varlen_probe.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
