"""Where Qwen3-VL-8B's time goes: attention kernels, the run() path, and the graph pool.

    python benchmarks/qwen3_probe.py --out benchmarks/results

Three probes, one process:
1. attention: every capturable attention kernel torch offers, at Qwen3-VL's head shape
   (16 heads x 72), on the segment layouts of the benchmark cases;
2. run(): host metadata, copies, replay and copy-out of `EncoderRunner.run` timed one by one
   for 1 x 448x448, plus the kernel count of one replay (torch.profiler);
3. pool: the graph pool's segments (allocator snapshot) after each capture, against the
   reserved-memory deltas the runner reports, and how many times dynamo compiled.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.environment import environment  # noqa: E402
from encoder_graphs.budgets import fitting_budget  # noqa: E402
from encoder_graphs.runner import EncoderRunner, GraphConfig  # noqa: E402
from encoder_graphs.selfcheck import back_to_back_ms, graph_replay_ms  # noqa: E402
from models import from_preset  # noqa: E402

HEADS, DIM = 16, 72


def attention_probe() -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.varlen import varlen_attn

    layouts = {"1 x 12544": [12544], "1 x 3136": [3136], "1 x 784": [784], "8 x 784": [784] * 8, "32 x 256": [256] * 32}
    rows_out = []
    for name, lengths in layouts.items():
        rows = sum(lengths)
        q, k, v = (torch.randn(rows, HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        m = max(lengths)
        flops = 4 * sum(n * n for n in lengths) * HEADS * DIM
        paths = {
            "varlen_attn (auto)": lambda: varlen_attn(q, k, v, cu, cu, m, m),
            "cudnn varlen lse": lambda: torch.ops.aten._cudnn_attention_forward(
                q, k, v, None, cu, cu, m, m, True, 0.0, False, False
            ),
            "cudnn varlen no-lse": lambda: torch.ops.aten._cudnn_attention_forward(
                q, k, v, None, cu, cu, m, m, False, 0.0, False, False
            ),
            "fa2 varlen": lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, m, m, 0.0, False, False),
            "efficient varlen": lambda: torch.ops.aten._efficient_attention_forward(
                q[None], k[None], v[None], None, cu, cu, m, m, 0.0, 0, False
            ),
        }
        if len(set(lengths)) == 1:
            b = len(lengths)
            qb, kb, vb = (t.view(b, lengths[0], HEADS, DIM).transpose(1, 2) for t in (q, k, v))
            for label, backend in (
                ("sdpa flash", SDPBackend.FLASH_ATTENTION),
                ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION),
            ):

                def run(backend=backend):
                    with sdpa_kernel([backend]):
                        return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb)

                paths[label] = run
        reference = None
        for label, fn in paths.items():
            try:
                out = fn()
                out = out[0] if isinstance(out, tuple) else out
                out = out.transpose(1, 2).reshape(rows, HEADS, DIM) if out.dim() == 4 and out.shape[0] > 1 else out
                out = out.reshape(rows, HEADS, DIM)
                if reference is None:
                    reference = out.float()
                err = ((out.float() - reference).abs().max() / reference.abs().max()).item()
                row = {"layout": name, "kernel": label, "err_vs_first": err}
                try:
                    row["ms"] = graph_replay_ms(fn)
                    row["tflops"] = flops / row["ms"] / 1e9
                except Exception as exc:  # noqa: BLE001 - a probe records what does not capture
                    torch.cuda.synchronize()
                    row["capture_error"] = f"{type(exc).__name__}: {exc}"[:300]
                    row["eager_ms"] = back_to_back_ms(fn, torch.device("cuda"))
                    row["eager_tflops"] = flops / row["eager_ms"] / 1e9
                rows_out.append(row)
            except Exception as exc:  # noqa: BLE001 - a probe records what does not run
                torch.cuda.synchronize()
                rows_out.append({"layout": name, "kernel": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(rows_out[-1], flush=True)
    return rows_out


def pool_segments_bytes(pool) -> tuple[int, int]:
    total = allocated = 0
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id", ())) == tuple(pool):
            total += seg["total_size"]
            allocated += seg["allocated_size"]
    return total, allocated


def run_probe(compile_: bool, budgets: tuple[int, ...]) -> dict:
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    encoder = from_preset("qwen3-vl-8b", dtype=torch.bfloat16, device=torch.device("cuda"), seed=0)
    runner = EncoderRunner(encoder, GraphConfig(budgets=budgets, compile=compile_))
    pools = []
    original = runner._capture_entry

    def capture_and_record(entry):
        original(entry)
        torch.cuda.synchronize()
        pools.append((entry.key, *pool_segments_bytes(runner._pool)))

    runner._capture_entry = capture_and_record
    start = time.perf_counter()
    runner.capture(progress=lambda m: print(m, flush=True))
    startup = time.perf_counter() - start
    pre = encoder.preprocessor
    img = torch.randint(0, 255, (3, 448, 448), dtype=torch.uint8)
    resized = [pre.resize_image(img)]
    specs = [pre.spec("image", 1, *resized[0].shape[-2:])]
    pixels = pre.pixel_values(resized, "image", device=encoder.device).to(encoder.dtype)
    tokens = specs[0].output_tokens

    steps: dict[str, list[float]] = {k: [] for k in ("select+metadata", "fill", "replay", "take+isfinite", "run()")}
    for _ in range(30):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        [(_, entry, metadata)] = runner._plan(specs, tokens, fitting_budget(runner.ladder, tokens))
        t1 = time.perf_counter()
        runner._fill(entry, pixels, metadata)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        runner._execute(entry)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        _, finite = runner._take(entry, tokens, encoder.device)
        bool(finite.all())
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        runner.run(pixels, specs)
        torch.cuda.synchronize()
        t5 = time.perf_counter()
        for k, seconds in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            steps[k].append(seconds * 1e3)
    median = {k: sorted(v)[len(v) // 2] for k, v in steps.items()}
    print("run() breakdown ms:", median, flush=True)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            runner.run(pixels, specs)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_us = sum(e.device_time for e in events) / 5
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(table, flush=True)
    return {
        "compile": compile_,
        "budgets": list(budgets),
        "startup_s": startup,
        "graphs": len(runner.entries),
        "runner_report": runner.memory.summary(),
        "pool_after_each_capture": [
            {"key": list(k), "pool_reserved_mib": t / 2**20, "pool_allocated_mib": a / 2**20} for k, t, a in pools
        ],
        "dynamo_counters": {k: dict(v) for k, v in dynamo_utils.counters.items() if k in ("stats", "frames")},
        "run_breakdown_ms": median,
        "cuda_events_per_run": len(events) / 5,
        "kernel_us_per_run": kernel_us,
        "profile_table": table,
        "graph_timings": [
            {"key": list(k), "replay_ms": e.replay_ms, "eager_ms": e.eager_ms}
            for k, e in sorted(runner.entries.items())
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--skip-attention", action="store_true")
    args = parser.parse_args()
    record = {
        **environment(),
        "attention": [] if args.skip_attention else attention_probe(),
        "runs": [],
    }
    record["runs"].append(run_probe(False, (256, 1024, 4096)))
    record["runs"].append(run_probe(True, (256, 1024)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "qwen3_probe.json").write_text(json.dumps(record, indent=2, default=str))
    print("\n| layout | kernel | ms | TFLOP/s |")
    for r in record["attention"]:
        print(
            f"| {r['layout']} | {r['kernel']} | {r.get('ms', float('nan')):.3f} | {r.get('tflops', 0):.0f} "
            f"| eager {r.get('eager_ms', float('nan')):.3f} ms {r.get('eager_tflops', 0):.0f} | "
            f"{r.get('capture_error', r.get('error', ''))[:80]}"
        )
    for run in record["runs"]:
        print(
            f"compile={run['compile']} startup {run['startup_s']:.1f}s report {run['runner_report']}\n"
            f"  pool {run['pool_after_each_capture'][-1]}  breakdown {run['run_breakdown_ms']} "
            f"events/run {run['cuda_events_per_run']} kernel us/run {run['kernel_us_per_run']:.0f}\n"
            f"  dynamo {run['dynamo_counters']}"
        )


if __name__ == "__main__":
    main()
