"""What the last MFU points on large packs cost, measured one by one (GPU).

    python benchmarks/fusion_probe.py --out benchmarks/results

1. mlp: the vision MLPs at 4096-16384 rows, compiled as the runner compiles them and captured
   in a CUDA graph: Qwen3-VL-8B's tanh-GELU MLP with the GELU as a separate (inductor) kernel
   vs in the matmul epilogue (`GeluEpilogueMLP`); Qwen2.5-VL-7B's gated MLP as two matmuls
   (gate, up) vs one matmul over the concatenated weights.
2. padding: FlashAttention-2 varlen at Qwen3-VL's 16 x 72 heads on 8 x 784 real rows in an
   8192-row graph and 1 x 784 in a 1024-row one (bucket 1024), padding cut into the fewest
   max_seqlen chunks, over every free slot, or into <= 128-row segments (`models/layout.py`).
3. graph: Qwen3-VL-8B 8 x 448x448 and a 16-frame 448x448 video replayed in the 2048-token graph
   and in a 1664-token one (a finer ladder), with a kernel-category profile of the 2048 replay.
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

from benchmarks.environment import environment  # noqa: E402
from encoder_graphs.runner import EncoderRunner, GraphConfig  # noqa: E402
from encoder_graphs.selfcheck import back_to_back_ms, graph_replay_ms, relative_error  # noqa: E402
from models import from_preset  # noqa: E402
from models.layout import padded_cu_seqlens  # noqa: E402

CUDA = torch.device("cuda")
BF16 = torch.bfloat16


def linear(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randn(out_features, in_features, device=CUDA, dtype=BF16) * in_features**-0.5,
        torch.randn(out_features, device=CUDA, dtype=BF16) * 0.02,
    )


def mlp_probe() -> list[dict]:
    rows_out = []
    hidden, inner = 1152, 4304  # Qwen3-VL-8B vision
    w1, b1 = linear(inner, hidden)
    w2, b2 = linear(hidden, inner)

    def gelu_separate(x):
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)

    def gelu_epilogue(x):
        return F.linear(torch._addmm_activation(b1, x, w1.t(), use_gelu=True), w2, b2)

    hidden2, inner2 = 1280, 3420  # Qwen2.5-VL-7B vision
    wg, bg = linear(inner2, hidden2)
    wu, bu = linear(inner2, hidden2)
    wd, bd = linear(hidden2, inner2)
    wgu, bgu = torch.cat([wg, wu]), torch.cat([bg, bu])

    def gated_two(x):
        return F.linear(F.silu(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)

    def gated_one(x):
        gate, up = F.linear(x, wgu, bgu).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, wd, bd)

    pairs = {
        "qwen3 tanh-GELU MLP": (gelu_separate, gelu_epilogue, 2 * 2 * hidden * inner),
        "qwen2.5 gated MLP": (gated_two, gated_one, 2 * 3 * hidden2 * inner2),
    }
    for name, (before, after, flops_per_row) in pairs.items():
        width = hidden if "qwen3" in name else hidden2
        for rows in (4096, 8192, 16384):
            x = torch.randn(rows, width, device=CUDA, dtype=BF16)
            compiled = [torch.compile(f, dynamic=True) for f in (before, after)]
            outs = [f(x) for f in compiled]
            ms = [graph_replay_ms(lambda f=f: f(x)) for f in compiled]
            rows_out.append(
                {
                    "mlp": name,
                    "rows": rows,
                    "before_ms": ms[0],
                    "after_ms": ms[1],
                    "speedup": ms[0] / ms[1],
                    "before_tflops": flops_per_row * rows / ms[0] / 1e9,
                    "after_tflops": flops_per_row * rows / ms[1] / 1e9,
                    "relative_error": relative_error(outs[1], outs[0].float()),
                }
            )
            print(rows_out[-1], flush=True)
    return rows_out


def padding_probe() -> list[dict]:
    """FA2 varlen at 16 x 72 heads with the padding rows cut three ways (`models/layout.py`)."""
    heads, dim, bucket = 16, 72, 1024
    cases = {"8 x 784 in 8192 rows, 72 slots": ([784] * 8, 8192, 72), "1 x 784 in 1024 rows, 9 slots": ([784], 1024, 9)}
    results = []
    for case, (lengths, rows, slots) in cases.items():
        q, k, v = (torch.randn(rows, heads, dim, device=CUDA, dtype=BF16) for _ in range(3))
        layouts = {
            "fewest max_seqlen chunks": padded_cu_seqlens(lengths, rows, bucket, slots, block=bucket),
            "every free slot": padded_cu_seqlens(lengths, rows, bucket, slots, block=1),
            "<= 128-row segments": padded_cu_seqlens(lengths, rows, bucket, slots),
        }
        for name, cu in layouts.items():
            cu = cu.to(CUDA)

            def attend(cu=cu):
                return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, bucket, bucket, 0.0, False, False)[0]

            segments = int((cu[1:] > cu[:-1]).sum())
            results.append({"case": case, "padding": name, "segments": segments, "ms": graph_replay_ms(attend)})
            print(results[-1], flush=True)
    return results


def categorize(name: str) -> str:
    lowered = name.lower()
    if "flash" in lowered or "fmha" in lowered or "sdpa" in lowered or "cudnn_generated" in lowered:
        return "attention"
    if "nvjet" in lowered or "gemm" in lowered or "cutlass" in lowered or "sm90_xmma" in lowered:
        return "matmul"
    if "triton" in lowered:
        return "triton (fused elementwise)"
    if "memcpy" in lowered or "memset" in lowered:
        return "copies"
    return "other"


def kernel_profile(replay, calls: int = 3) -> tuple[dict[str, float], str]:
    """GPU ms per call of `replay` by kernel category, and torch.profiler's kernel table."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            replay()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            key = categorize(event.key)
            totals[key] = totals.get(key, 0.0) + event.device_time_total / calls / 1e3
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])), table


def graph_probe() -> dict:
    torch._dynamo.reset()  # the MLP probe's compiled functions must not share caches with the tower
    encoder = from_preset("qwen3-vl-8b", dtype=BF16, device=CUDA, seed=0)
    runner = EncoderRunner(encoder, GraphConfig(budgets=(1664, 2048), compile=True, self_check=False))
    start = time.perf_counter()
    runner.capture(progress=lambda m: print(m, flush=True))
    startup = time.perf_counter() - start
    pre = encoder.preprocessor
    cases = {
        "8 x 448x448": [pre.spec("image", 1, 448, 448)] * 8,
        "video 16 x 448x448": [pre.spec("video", 16, 448, 448)],
    }
    result: dict = {"startup_s": startup, "cases": []}
    for name, specs in cases.items():
        patches = sum(s.input_patches for s in specs)
        pixels = torch.randn(patches, encoder.patch_dim, device=CUDA, dtype=BF16)
        for budget in (2048, 1664):
            entry, metadata = runner._place(specs, budget)
            runner._fill(entry, pixels, metadata)
            ms = back_to_back_ms(lambda entry=entry: runner._execute(entry), CUDA, 10)
            result["cases"].append(
                {"case": name, "graph": list(entry.key), "replay_ms": ms, "rows": entry.layout.token_budget * 4}
            )
            print(result["cases"][-1], flush=True)
        if name == "8 x 448x448":
            entry, metadata = runner._place(specs, 2048)
            runner._fill(entry, pixels, metadata)
            totals, table = kernel_profile(lambda entry=entry: runner._execute(entry))
            result["profile_ms_per_replay_2048"] = totals
            result["profile_table"] = table
            print(result["profile_ms_per_replay_2048"], flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    record = {
        **environment(),
    }
    record["graph"] = graph_probe()  # first: a fresh process, as the runner starts in a replica
    record["mlp"] = mlp_probe()
    record["padding"] = padding_probe()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fusion_probe.json").write_text(json.dumps(record, indent=2, default=str))
    print("\n| mlp | rows | before ms | after ms | speedup | TFLOP/s before -> after |")
    for r in record["mlp"]:
        print(
            f"| {r['mlp']} | {r['rows']} | {r['before_ms']:.3f} | {r['after_ms']:.3f} | {r['speedup']:.3f}x "
            f"| {r['before_tflops']:.0f} -> {r['after_tflops']:.0f} |"
        )
    for r in record["padding"]:
        print(f"| {r['case']} | padding: {r['padding']} | {r['segments']} segments | {r['ms']:.3f} ms |")
    for r in record["graph"]["cases"]:
        print(f"| {r['case']} | graph {r['graph']} ({r['rows']} rows) | {r['replay_ms']:.2f} ms |")
    print("profile (2048 graph, 8 x 448):", record["graph"].get("profile_ms_per_replay_2048"))


if __name__ == "__main__":
    main()
