"""Encoder benchmark: transformers eager vs our eager path vs our graph path, one table per model.

    python benchmarks/encoder_bench.py --presets qwen3-vl-8b qwen2.5-vl-7b --out benchmarks/results

For each case (images / video / mixed pack, pixels already preprocessed on the device) it
times, in one process and one run:
- `hf`: the transformers tower as users call it (`tower(pixel_values, grid_thw)`, sdpa);
- `eager`: our eager path (precomputed metadata, varlen attention, no padding);
- `graph`: `EncoderRunner.run` for a pack without a graph of its own (`recurring=False`: host
  metadata, copies into static buffers, replay, copy out), or whatever route its measured costs
  pick for the pack (the `route` column): "exact" is the compiled forward on the pack's exact
  layout (`--compile`, no padding, no graph). The costs of routes without a graph are learned
  from the packs they serve, so the route may change after the first run: "exact->graph" is
  the first run's route, then the timed runs';
- `recurring`: `EncoderRunner.run` once the same pack has been seen twice: its own graph of its
  exact layout (no padding rows, metadata baked in), if the runner kept it (it must replay
  faster than the first route; the `kept` column), else the first route again.
Latency is the median of timed repeats after warm-up, synchronized, the three paths timed in
turns so that drift hits them alike. Throughput counts
output tokens. MFU is useful FLOPs (linear layers + block-diagonal attention, no padding)
over the measured bf16 matmul peak. The table also gives the arithmetic floor (useful
FLOPs at that peak), so a missed target can be explained.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common.environment import environment  # noqa: E402
from benchmarks.common.flops import add_mfu, measure_peak_tflops, useful_flops  # noqa: E402
from encoder_graphs.config import GraphConfig  # noqa: E402
from encoder_graphs.runner import EncoderRunner, canonical_order  # noqa: E402
from encoder_graphs.selfcheck import interleaved_ms  # noqa: E402
from models import from_preset, transformers_tower  # noqa: E402
from models.attention import BACKENDS, DEFAULT_BACKEND  # noqa: E402
from models.protocol import ItemSpec  # noqa: E402

CASES = {
    "1 x 224x224": [("image", 224, 224)],
    "1 x 448x448": [("image", 448, 448)],
    "1 x 896x896": [("image", 896, 896)],
    "8 x 448x448": [("image", 448, 448)] * 8,
    "32 x 224x224": [("image", 224, 224)] * 32,
    "1 x 1792x1792": [("image", 1792, 1792)],
    "video 16 x 448x448": [("video", 448, 448)],
    "mixed 896 + 4x448 + 8x224": [("image", 896, 896)] + [("image", 448, 448)] * 4 + [("image", 224, 224)] * 8,
}
INTERNVL_CASES = {
    "1 tile": [("image", 448, 448)],
    "7 tiles + thumbnail": [("image", 300, 2100)],
    "8 images of 1 tile": [("image", 448, 448)] * 8,
}
"""InternVL packs are runs of 448x448 tiles: an image's crop grid plus its thumbnail."""
VIDEO_FRAMES = 16


def cases_of(encoder) -> dict[str, list[tuple[str, int, int]]]:
    return INTERNVL_CASES if encoder.family == "internvl" else CASES


def route(report) -> str:
    """ "graph" (one or several graph replays), "exact" (the compiled forward on the pack's exact
    layout, no padding, no graph) or "eager" (uncompiled)."""
    return "graph" if report.graph else ("exact" if report.compiled else "eager")


def build_case(encoder, items, rng) -> tuple[str, list[torch.Tensor], torch.Tensor, list[ItemSpec]]:
    """(modality, resized uint8 items, the encoder's pixel rows, specs) of random images or videos."""
    pre = encoder.preprocessor
    modality = items[0][0]
    resized, specs = [], []
    for _, height, width in items:
        if modality == "video":
            frames = torch.from_numpy(rng.integers(0, 255, (VIDEO_FRAMES, 3, height, width), dtype=np.uint8))
            resized.append(pre.resize_video(frames))
            specs.append(pre.video_spec(VIDEO_FRAMES, height, width))
        else:
            resized.append(pre.resize_image(torch.from_numpy(rng.integers(0, 255, (3, height, width), dtype=np.uint8))))
            specs.append(pre.image_spec(height, width))
    pixels = pre.pixel_values(resized, modality, device=encoder.device).to(encoder.dtype)
    return modality, resized, pixels, specs


def hf_call(encoder, hf, resized: list[torch.Tensor], pixels: torch.Tensor, specs: list[ItemSpec]):
    """One forward of transformers' own model as users call it: Qwen's tower on the processor's
    patch rows and grids; InternVL's `get_image_features` on the processor's normalized tiles."""
    if encoder.family == "internvl":
        processor = encoder.preprocessor.image_processor
        tiles = processor(
            images=[tile for item in resized for tile in item],
            do_resize=False,
            crop_to_patches=False,
            device=encoder.device,
            input_data_format="channels_first",
            return_tensors="pt",
        )["pixel_values"].to(encoder.dtype)
        return lambda: hf.get_image_features(tiles)
    grid = torch.tensor([list(s.grid_thw) for s in specs], device=encoder.device)
    return lambda: hf(pixels, grid_thw=grid)


def bench_preset(preset: str, device: torch.device, dtype: torch.dtype, config: GraphConfig, attention: str) -> dict:
    encoder = from_preset(preset, dtype=dtype, device=device, seed=0, attention=attention)
    hf = transformers_tower(encoder, dtype=dtype)  # the same weights, run transformers' way (sdpa)
    runner = EncoderRunner(encoder, config)
    start = time.perf_counter()
    startup_log: list[str] = []  # where startup time goes: prepare, each warm-up stage and graph

    def progress(message: str) -> None:
        startup_log.append(f"{time.perf_counter() - start:7.1f} s {message}")

    runner.prepare(progress=progress)
    ready_s = time.perf_counter() - start  # serving (eagerly) from here on
    runner.warm_up(progress=progress)  # in the foreground here; a replica runs it in a thread
    startup_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    rows = []
    for case, items in cases_of(encoder).items():
        modality, resized, pixels, specs = build_case(encoder, items, rng)
        hf_forward = hf_call(encoder, hf, resized, pixels, specs)
        tokens = sum(s.output_tokens for s in specs)
        patches = sum(s.input_patches for s in specs)
        flops = useful_flops(encoder, specs)
        routes: list[str] = []

        def first_sighting() -> None:
            runner.run(pixels, specs, recurring=False)
            routes.append(route(runner.stats.last))

        with torch.inference_mode():
            first_sighting()
            for _ in range(2):  # the second sighting captures the pack's own graph, if it pays
                runner.run(pixels, specs)
            kept = tuple(specs[i].grid_thw for i in canonical_order(specs)) in runner.recurring.entries
            timings = interleaved_ms(
                {
                    "hf": hf_forward,
                    "eager": lambda: encoder.forward_eager(pixels, specs),
                    "graph": first_sighting,
                    "recurring": lambda: runner.run(pixels, specs),
                },
                device,
                repeats=10,
                warmup=3,
            )
        hf_ms, eager_ms, graph_ms, recurring_ms = (timings[k] for k in ("hf", "eager", "graph", "recurring"))
        # The route of the very first run, and the one the timed runs took (the runner learns
        # what a route without a graph really costs from the packs it serves, and may switch)
        counts = {r: routes[-10:].count(r) for r in sorted(set(routes[-10:]))}
        timed = next(iter(counts)) if len(counts) == 1 else "/".join(f"{r} x{n}" for r, n in counts.items())
        path = timed if routes[0] == timed else f"{routes[0]}->{timed}"
        rows.append(
            {
                "case": case,
                "patches": patches,
                "tokens": tokens,
                "hf_ms": hf_ms,
                "eager_ms": eager_ms,
                "graph_ms": graph_ms,
                "graph_route": path,
                "graph_vs_hf": hf_ms / graph_ms,
                "graph_vs_eager": eager_ms / graph_ms,
                "graph_tokens_per_s": tokens / graph_ms * 1e3,
                "recurring_ms": recurring_ms,
                "recurring_kept": kept,
                "recurring_vs_hf": hf_ms / recurring_ms,
                "recurring_vs_eager": eager_ms / recurring_ms,
                "gflops": flops / 1e9,
            }
        )
    described = runner.describe()
    return {
        "preset": preset,
        "attention": encoder.compile_identity()["attention"],
        "ladder": list(runner.ladder.budgets),
        "graph_budgets": list(runner.table.budgets),
        "graphs": len(runner.entries),
        "ready_s": ready_s,
        "startup_s": startup_s,
        "startup_log": startup_log,
        "warmup": described["warmup"],
        "memory": runner.memory.summary() if runner.use_graphs else None,
        "stats": runner.stats.snapshot(),
        "learned_route_scale": described["learned_route_scale"],
        "learned_cold_ms": described["learned_cold_ms"],
        "startup_costs_ms": described["startup_costs_ms"],
        "graph_timings": [
            {
                "token_budget": key[0],
                "max_seqlen": key[1],
                "replay_ms": round(e.replay_ms, 3),
                "self_check_error": e.self_check_error,
                "state": e.state,
            }
            for key, e in sorted(runner.entries.items())
        ],
        "recurring_graphs": [
            {"grids": [list(g) for g in key], "replay_ms": round(e.replay_ms, 3), "dense": e.dense}
            for key, e in runner.recurring.entries.items()
        ],
        "cases": rows,
    }


def format_table(result: dict) -> str:
    lines = [
        f"### {result['preset']} (attention {result['attention']}, ladder {result['ladder']}, {result['graphs']} "
        f"graphs, serving after {result['ready_s']:.1f} s, full speed after {result['startup_s']:.1f} s, "
        f"graph memory {result['memory']})",
        "",
        "No graph of its own (`graph`, by the route its costs pick; `a->b`: the first run's route, then "
        "the timed runs', the runner having learned a route's cost from the first) and recurring "
        f"(`rec.`: the pack's own exact-layout graph where kept; `a x3/b x7`: timed runs by route). "
        f"Learned route scales: {result.get('learned_route_scale')}, cold cost: {result.get('learned_cold_ms')} ms",
        "",
        "| case | patches | HF ms | eager ms | graph ms | route | graph/HF | graph/eager | graph tok/s "
        "| floor ms | MFU HF | MFU eager | MFU graph | rec. ms | kept | rec./HF | rec./eager | MFU rec. |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["cases"]:
        lines.append(
            f"| {r['case']} | {r['patches']} | {r['hf_ms']:.2f} | {r['eager_ms']:.2f} | {r['graph_ms']:.2f} "
            f"| {r['graph_route']} | {r['graph_vs_hf']:.2f}x | {r['graph_vs_eager']:.2f}x "
            f"| {r['graph_tokens_per_s']:.0f} | {r['floor_ms']:.2f} | {r['mfu_hf']:.1%} | {r['mfu_eager']:.1%} "
            f"| {r['mfu_graph']:.1%} | {r['recurring_ms']:.2f} | {'yes' if r['recurring_kept'] else 'no'} "
            f"| {r['recurring_vs_hf']:.2f}x | {r['recurring_vs_eager']:.2f}x | {r['mfu_recurring']:.1%} |"
        )
    return "\n".join(lines)


def _frontend_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("nvidia-cudnn-frontend")
    except Exception:  # noqa: BLE001 - not installed (or not as a distribution)
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["qwen3-vl-8b", "qwen2.5-vl-7b"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-budget-tokens", type=int, default=8192)
    parser.add_argument("--budget-growth", type=float, default=GraphConfig.budget_growth)
    parser.add_argument(
        "--fine-budget-tokens",
        type=int,
        default=GraphConfig.fine_budget_tokens,
        help="the budget from which doublings are split finer",
    )
    parser.add_argument(
        "--fine-budget-steps",
        type=int,
        default=GraphConfig.fine_budget_steps,
        help="budgets per doubling above fine_budget_tokens (1: the old doubling ladder)",
    )
    parser.add_argument(
        "--finer-budget-range",
        type=int,
        nargs=2,
        default=GraphConfig.finer_budget_range,
        help="budgets in [FROM, UNTIL) take --finer-budget-steps per doubling",
    )
    parser.add_argument(
        "--finer-budget-steps",
        type=int,
        default=GraphConfig.finer_budget_steps,
        help="budgets per doubling inside --finer-budget-range (--fine-budget-steps's value: no finer range)",
    )
    parser.add_argument("--segment-density", type=int, default=GraphConfig.segment_density)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="encoder_bench")
    parser.add_argument("--attention", default=DEFAULT_BACKEND, choices=BACKENDS)
    parser.add_argument("--compile-cache", default=None, help="compile cache directory (GraphConfig.compile_cache)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument(
        "--compile-exact",
        action=argparse.BooleanOptionalAction,
        default=GraphConfig.compile_exact,
        help="with --compile: packs without a graph run compiled on their exact layout",
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    peak_before = measure_peak_tflops(device)
    config = GraphConfig(
        max_budget_tokens=args.max_budget_tokens,
        budget_growth=args.budget_growth,
        fine_budget_tokens=args.fine_budget_tokens,
        fine_budget_steps=args.fine_budget_steps,
        finer_budget_range=tuple(args.finer_budget_range),
        finer_budget_steps=args.finer_budget_steps,
        segment_density=args.segment_density,
        compile=args.compile,
        compile_exact=args.compile_exact,
        compile_cache=args.compile_cache,
    )
    results = [bench_preset(p, device, dtype, config, args.attention) for p in args.presets]

    record = {
        **environment(),
        "dtype": args.dtype,
        "attention": sorted({result["attention"] for result in results}),
        "cudnn_frontend": _frontend_version(),
        "compile": args.compile,
        "compile_exact": args.compile_exact,
        "results": results,
    }
    # The peak is measured before and after the cases (clocks drift with heat); MFU uses the
    # higher one, so it is never flattered by a slow peak measurement.
    peak_after = measure_peak_tflops(device)
    peak = max(peak_before, peak_after)
    record["peak_bf16_tflops"] = {"before": peak_before, "after": peak_after, "used": peak}
    for result in record["results"]:
        add_mfu(result["cases"], peak)
    header = (
        f"Device {record['device']}, torch {record['torch']}, transformers {record['transformers']}, "
        f"{args.dtype}, attention {record['attention']} (cudnn-frontend {record['cudnn_frontend']}), "
        f"compile {args.compile} (exact route {args.compile_exact}), "
        f"measured matmul peak {peak:.0f} TFLOP/s (best of before {peak_before:.0f} / after "
        f"{peak_after:.0f}), {record['date']}\n"
        f"Command: {record['command']}\n"
    )
    tables = "\n\n".join(format_table(r) for r in record["results"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(record, indent=2))
    (out / f"{args.tag}.md").write_text(header + "\n" + tables + "\n")
    print(header)
    print(tables)


if __name__ == "__main__":
    main()
