"""The Triton varlen kernel on the graph layouts the runner builds: old ladder and buckets against new.

    python benchmarks/grid_probe.py --out benchmarks/results

Before, the runner kept a graph per doubling `max_seqlen` bucket (256, 512, ..., the budget's
rows) so that packs of short segments do not pay for the kernel grid of the longest, and budgets
doubled. Under backend "triton" it now keeps buckets 1024, 4096 and the budget's rows only
(`attention.graph_seqlen_buckets`), and the ladder splits each doubling above 1024 tokens into 8
steps (`GraphConfig.fine_budget_steps`): three graphs a budget at most, so 29 budgets are 79
graphs. The kernel's grid is still (query blocks of `max_seqlen`, heads, segment slots); this
probe measures what the coarser buckets cost it, and what the finer budgets save.

Per pack and head shape, each in a CUDA graph (`graph_replay_ms`), same inputs:
- `old`: the old runner's layout (doubling budget and bucket, 8 slots per bucket);
- `new`: the new runner's layout (fine budget, new bucket);
- `exact`: the pack alone (no padding, max_seqlen its longest segment);
and Qwen2.5-VL's window layers (64-patch windows) with the window slots of the old and new
layouts: what empty slots cost there.

The saved `grid_probe.json` is this script's first version (commit c2d33d8), which
also timed a flat grid (one program per query block of the pack, each scanning `cu_seqlens` for
its segment) on the new layouts: slower on every layout (`new flat ms`, `flat/slot`), so it was
removed. Its `new slot` columns are this version's `new`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.environment import environment  # noqa: E402
from encoder_graphs.budgets import (  # noqa: E402
    auto_ladder,
    buckets_for_budget,
    fitting_budget,
    segment_capacity,
    seqlen_buckets,
)
from encoder_graphs.selfcheck import graph_replay_ms  # noqa: E402
from models.attention import TRITON_GRAPH_BUCKETS  # noqa: E402
from models.layout import padded_cu_seqlens  # noqa: E402
from models.triton_attention import varlen_attention  # noqa: E402

HEADS = {"qwen3-vl-8b": (16, 72, 16), "qwen2.5-vl-7b": (16, 80, 14)}
"""model: (heads, head dim, patch size)."""
MAX_SEGMENTS = 128
MERGE_UNIT = 4
WINDOW = 64


def packs(patch: int) -> dict[str, list[int]]:
    p224 = 256  # both processors give a 224x224 image 16 x 16 patches
    p448, p896, p1792 = ((s // patch) ** 2 for s in (448, 896, 1792))
    return {
        "1 x 448": [p448],
        "8 x 448": [p448] * 8,
        "32 x 224": [p224] * 32,
        "mixed 896 + 4x448 + 8x224": [p896] + [p448] * 4 + [p224] * 8,
        "1 x 896": [p896],
        "1 x 1792": [p1792],
    }


def layout(lengths: list[int], new: bool) -> tuple[int, int, int]:
    """(rows, max_seqlen bucket, segment slots) of the graph the old or new runner would use."""
    tokens = sum(lengths) // MERGE_UNIT
    ladder = auto_ladder(64, 8192, 2.0, 1024, 8 if new else 1)
    rows = fitting_budget(ladder, tokens) * MERGE_UNIT
    buckets = TRITON_GRAPH_BUCKETS if new else seqlen_buckets(256, 8192 * MERGE_UNIT)
    bucket = min(b for b in buckets_for_budget(buckets, rows) if b >= max(lengths))
    slots = segment_capacity(rows, bucket, 8, MAX_SEGMENTS) + -(-rows // bucket)  # + padding, as models/qwen.py
    return rows, bucket, slots


def window_slots(rows: int, frames: int) -> int:
    """Qwen2.5-VL's window capacity for a layout (`Qwen25VLEncoder._window_capacity`)."""
    units = rows // MERGE_UNIT
    return 2 * -(-units // 16) + 2 * frames + -(-rows // WINDOW)


def timed(q, k, v, cu, max_seqlen, scale) -> float:
    out = torch.empty_like(q)
    return graph_replay_ms(lambda: varlen_attention(q, k, v, cu, max_seqlen, scale, out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    rows_out = []
    for model, (heads, dim, patch) in HEADS.items():
        scale = dim**-0.5
        for name, lengths in packs(patch).items():
            torch.manual_seed(0)
            row = {"model": model, "pack": name, "patches": sum(lengths)}
            flops = 4 * sum(n * n for n in lengths) * heads * dim
            biggest = max(layout(lengths, new)[0] for new in (False, True))
            q, k, v = (torch.randn(biggest, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for label, new in (("old", False), ("new", True)):
                rows, bucket, slots = layout(lengths, new)
                cu = padded_cu_seqlens(lengths, rows, bucket, slots).cuda()
                row[f"{label} layout"] = f"{rows} rows, bucket {bucket}, {slots} slots"
                row[f"{label} ms"] = timed(q[:rows], k[:rows], v[:rows], cu, bucket, scale)
            used = sum(lengths)
            cu = padded_cu_seqlens(lengths, used, max(lengths), len(lengths)).cuda()
            row["exact ms"] = timed(q[:used], k[:used], v[:used], cu, max(lengths), scale)
            row["new/old"] = row["new ms"] / row["old ms"]
            row["new TFLOP/s"] = flops / row["new ms"] / 1e9
            rows_out.append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        if model.startswith("qwen2.5"):  # window layers: 64-patch windows, the slot grid either way
            for name, lengths in packs(patch).items():
                windows = [WINDOW] * (sum(lengths) // WINDOW)
                row = {"model": model, "pack": f"windows of {name}", "patches": sum(lengths)}
                for label, new in (("old", False), ("new", True)):
                    rows, bucket, slots = layout(lengths, new)
                    capacity = window_slots(rows, slots - -(-rows // bucket))
                    cu = padded_cu_seqlens(windows, rows, WINDOW, capacity).cuda()
                    q, k, v = (torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                    row[f"{label} layout"] = f"{rows} rows, {capacity} window slots"
                    row[f"{label} ms"] = timed(q, k, v, cu, WINDOW, scale)
                row["new/old"] = row["new ms"] / row["old ms"]
                rows_out.append(row)
                print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    record = {**environment(), "rows": rows_out}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grid_probe.json").write_text(json.dumps(record, indent=2))
    print("\n| model | pack | old ms | new ms | exact ms | new/old |")
    print("|---|---|---|---|---|---|")
    for r in rows_out:
        exact = r.get("exact ms", float("nan"))
        times = f"{r['old ms']:.4f} | {r['new ms']:.4f} | {exact:.4f}"
        print(f"| {r['model']} | {r['pack']} | {times} | {r['new/old']:.3f} |")


if __name__ == "__main__":
    main()
