"""cuDNN attention through NVIDIA's own Python frontend (`nvidia-cudnn-frontend`), on the GPU host.

    python benchmarks/cudnn_probe.py --out benchmarks/results

torch 2.11's own cuDNN varlen path (`aten._cudnn_attention_forward` with `cum_seq_q`) rebuilds
its cuDNN graph on every call (50-70 ms) and breaks CUDA graph capture
(`qwen3_probe.json`), so padded graphs run FlashAttention-2's varlen kernel, which is
1.3-1.6x slower than cuDNN at these head shapes. The frontend caches the built graph and
derives the ragged offsets with device ops, so its varlen form may be capturable. Two probes:

1. varlen: FlashAttention-2 against the frontend's varlen cuDNN (`cudnn.sdpa_torch`) on the
   benchmark's exact layouts and on padded layouts as the runner builds them
   (`models.layout.padded_cu_seqlens`: padding segments, zero-length trailing slots), each
   captured in a CUDA graph; error against FlashAttention-2 on the real rows;
2. plans: every cuDNN engine plan the frontend offers for one long segment (Qwen3-VL's
   12544-patch image at 16 x 72; Qwen2.5-VL's 16384 at 16 x 80), timed against torch's
   `scaled_dot_product_attention` on cuDNN (its heuristic's first plan).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.environment import environment  # noqa: E402
from encoder_graphs.selfcheck import back_to_back_ms, graph_replay_ms  # noqa: E402
from models.layout import padded_cu_seqlens  # noqa: E402

HEADS = {"qwen3-vl (16 x 72)": (16, 72, 16), "qwen2.5-vl (16 x 80)": (16, 80, 14)}
"""name: (heads, head dim, patch size)."""


def patches(side: int, patch: int) -> int:
    return (side // patch) ** 2


def layouts(patch: int) -> dict[str, tuple[list[int], int, int, int]]:
    """name: (segment lengths, rows, max_seqlen, slots). Exact layouts have no padding; padded
    ones are the runner's graph for that pack (budget rows, seqlen bucket, 8 slots per bucket)."""
    big, p896, p448 = (patches(s, patch) for s in (1792, 896, 448))
    p224 = 256  # both processors give a 224x224 image 16 x 16 patches (Qwen3-VL resizes it to 256)
    mixed = [p896] + [p448] * 4 + [p224] * 8

    def exact(lengths):
        return (lengths, sum(lengths), max(lengths), len(lengths))

    def padded(lengths, rows, max_seqlen):
        return (lengths, rows, max_seqlen, min(128, max(8, 8 * rows // max_seqlen)))

    bucket = lambda n: 1 << max(8, (n - 1).bit_length())  # noqa: E731
    return {
        "exact 1 x 1792": exact([big]),
        "exact 8 x 448": exact([p448] * 8),
        "exact 32 x 224": exact([p224] * 32),
        "exact mixed": exact(mixed),
        "padded 1 x 448": padded([p448], 1024 if p448 <= 1024 else 2048, bucket(p448)),
        "padded 8 x 448": padded([p448] * 8, 8192, bucket(p448)),
        "padded mixed": padded(mixed, 16384, bucket(p896)),
        "padded windows": padded([64] * (p896 // 64), 4096, 256),
    }


def varlen_probe() -> list[dict]:
    import cudnn

    rows_out = []
    for model, (heads, dim, patch) in HEADS.items():
        for name, (lengths, rows, max_seqlen, slots) in layouts(patch).items():
            torch.manual_seed(0)
            q, k, v = (torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            cu = padded_cu_seqlens(lengths, rows, max_seqlen, slots).cuda()
            used = sum(lengths)
            scale = dim**-0.5
            flops = 4 * sum(n * n for n in lengths) * heads * dim
            paths = {
                "fa2 varlen": lambda: torch.ops.aten._flash_attention_forward(
                    q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, False, False, scale=scale
                )[0],
                "cudnn-fe varlen": lambda: cudnn.sdpa_torch(
                    q,
                    k,
                    v,
                    scale=scale,
                    cu_seqlens_q=cu,
                    cu_seqlens_kv=cu,
                    max_seqlen_q=max_seqlen,
                    max_seqlen_kv=max_seqlen,
                ),
            }
            if len(set(lengths)) == 1 and used == rows:
                count, length = len(lengths), lengths[0]

                def dense(count=count, length=length):
                    from torch.nn.attention import SDPBackend, sdpa_kernel

                    batch = [t.unflatten(0, (count, length)).transpose(1, 2) for t in (q, k, v)]
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        out = torch.nn.functional.scaled_dot_product_attention(*batch, scale=scale)
                    return out.transpose(1, 2).flatten(0, 1)

                paths["sdpa cudnn dense"] = dense
            reference = None
            for label, fn in paths.items():
                row = {
                    "model": model,
                    "layout": name,
                    "kernel": label,
                    "rows": rows,
                    "used": used,
                    "max_seqlen": max_seqlen,
                    "slots": slots,
                }
                try:
                    out = fn()[:used].float()
                    if reference is None:
                        reference = out
                    row["nonfinite"] = int((~torch.isfinite(out)).sum())
                    row["err_vs_fa2"] = ((out - reference).abs().max() / reference.abs().max()).item()
                    try:
                        row["ms"] = graph_replay_ms(fn)
                        row["tflops"] = flops / row["ms"] / 1e9
                    except Exception as exc:  # noqa: BLE001 - a probe records what does not capture
                        torch.cuda.synchronize()
                        row["capture_error"] = f"{type(exc).__name__}: {exc}"[:400]
                        row["eager_ms"] = back_to_back_ms(fn, torch.device("cuda"))
                except Exception as exc:  # noqa: BLE001 - a probe records what does not run
                    torch.cuda.synchronize()
                    row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                rows_out.append(row)
                print(row, flush=True)
    return rows_out


def plan_probe() -> list[dict]:
    """Every engine plan for one long dense segment, laid out as the tower's q/k/v (views of one
    `[rows, 3, heads, dim]` projection)."""
    import cudnn

    out_rows = []
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    for model, (heads, dim, patch) in HEADS.items():
        rows = patches(1792, patch)
        torch.manual_seed(0)
        qkv = torch.randn(rows, 3, heads, dim, device="cuda", dtype=torch.bfloat16)
        q, k, v = (qkv[:, i].unsqueeze(0).transpose(1, 2) for i in range(3))  # [1, heads, rows, dim]
        scale = dim**-0.5
        flops = 4 * rows * rows * heads * dim

        def torch_cudnn():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

        reference = torch_cudnn().float()
        base = back_to_back_ms(torch_cudnn, torch.device("cuda"))
        out_rows.append({"model": model, "plan": "torch sdpa cudnn", "ms": base, "tflops": flops / base / 1e9})
        print(out_rows[-1], flush=True)
        out = torch.empty(1, rows, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        try:
            bf16 = cudnn.data_type.BFLOAT16
            g = cudnn.pygraph(
                handle=handle,
                io_data_type=bf16,
                intermediate_data_type=cudnn.data_type.FLOAT,
                compute_data_type=cudnn.data_type.FLOAT,
            )
            qt, kt, vt = (
                g.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), data_type=bf16)
                for n, t in (("q", q), ("k", k), ("v", v))
            )
            ot, _ = g.sdpa(name="sdpa", q=qt, k=kt, v=vt, generate_stats=False, attn_scale=scale)
            ot.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride())).set_data_type(bf16)
            g.validate()
            g.build_operation_graph()
            modes = [cudnn.heur_mode.A]
            for extra in ("B", "FALLBACK"):
                if hasattr(cudnn.heur_mode, extra):
                    modes.append(getattr(cudnn.heur_mode, extra))
            g.create_execution_plans(modes)
            g.check_support()
            g.build_plans(cudnn.build_plan_policy.ALL)
            count = g.get_execution_plan_count()
        except Exception as exc:  # noqa: BLE001
            out_rows.append({"model": model, "plan": "build", "error": f"{type(exc).__name__}: {exc}"[:400]})
            print(out_rows[-1], flush=True)
            continue
        for index in range(count):
            row = {"model": model, "plan": index}
            try:
                row["name"] = g.get_plan_name_at_index(index)
                ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(index)), dtype=torch.uint8, device="cuda")

                def run(index=index, ws=ws):
                    g.execute_plan_at_index({qt: q, kt: k, vt: v, ot: out}, ws, index=index, handle=handle)

                run()
                torch.cuda.synchronize()
                row["err_vs_torch"] = ((out.float() - reference).abs().max() / reference.abs().max()).item()
                row["ms"] = back_to_back_ms(run, torch.device("cuda"))
                row["tflops"] = flops / row["ms"] / 1e9
            except Exception as exc:  # noqa: BLE001
                torch.cuda.synchronize()
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            out_rows.append(row)
            print(row, flush=True)
    return out_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--probes", nargs="+", default=["varlen", "plans"])
    args = parser.parse_args()
    import cudnn

    record = {
        **environment(),
        "cudnn_frontend": getattr(cudnn, "__version__", "?"),
        "cudnn_frontend_backend": cudnn.backend_version_string(),
    }
    print(record, flush=True)
    if "varlen" in args.probes:
        record["varlen"] = varlen_probe()
    if "plans" in args.probes:
        record["plans"] = plan_probe()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cudnn_probe.json").write_text(json.dumps(record, indent=1))
    print("\n| model | layout | kernel | ms | TFLOP/s | err vs fa2 | note |\n|---|---|---|---|---|---|---|")
    for r in record.get("varlen", []):
        note = r.get("error") or r.get("capture_error") or ""
        ms = r.get("ms", r.get("eager_ms", math.nan))
        print(
            f"| {r['model']} | {r['layout']} | {r['kernel']} | {ms:.3f} | {r.get('tflops', 0):.0f} | "
            f"{r.get('err_vs_fa2', math.nan):.2e} | {note[:80]} |"
        )
    print("\n| model | plan | name | ms | TFLOP/s | err |\n|---|---|---|---|---|---|")
    for r in record.get("plans", []):
        print(
            f"| {r['model']} | {r['plan']} | {r.get('name', '')} | {r.get('ms', math.nan):.3f} | "
            f"{r.get('tflops', 0):.0f} | {r.get('err_vs_torch', r.get('error', ''))} |"
        )


if __name__ == "__main__":
    main()
