"""Where a first sighting's time goes in a padded graph, per case (GPU).

    python benchmarks/first_sighting_probe.py --out benchmarks/results

`encoder_bench.py`'s first-sighting column times `EncoderRunner.run(..., recurring=False)`.
Here the same runner (compiled forward, graphs captured) takes each case's budget graph and
times, in turns, each sample started on an idle GPU:
- `run`: `runner.run(pixels, specs, recurring=False)` (the benchmark's column; its route printed);
- `graph`: the pack on that graph with its metadata built beforehand (`_run_graph`: copy in,
  replay, copy out, the finite check), so `run - graph` is the plan's host time and reordering;
- `replay`: the graph's replay alone on the filled buffers, so `graph - replay` is the copies and
  the check;
- `own`: `runner.run` once the pack has its own exact-layout graph (what a recurring pack gets,
  where the runner kept it: `own_kept`), so `run - own` is what the first sighting pays over a
  recurring pack (padding rows, the varlen layout, the plan);
- `plan` and `metadata`: the host's planning and the metadata build alone (no GPU work).
The budgets are the benchmark's for these cases only (a few graphs, so startup is short), and
the compiled exact route is off: every case runs on graphs. `--fine-budget-steps` picks the
ladder whose budgets the cases land in.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.encoder_bench import CASES, build_case, route  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from benchmarks.launch_probe import host_timeline  # noqa: E402
from encoder_graphs.budgets import fitting_budget  # noqa: E402
from encoder_graphs.config import build_ladder  # noqa: E402
from encoder_graphs.runner import EncoderRunner, GraphConfig, canonical_order  # noqa: E402
from encoder_graphs.selfcheck import interleaved_ms  # noqa: E402
from models import from_preset  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke test
PROBED = ("8 x 448x448", "video 16 x 448x448", "mixed 896 + 4x448 + 8x224", "1 x 1792x1792")


def probe_case(runner: EncoderRunner, encoder, name: str, rng) -> dict:
    _, pixels, specs = build_case(encoder, CASES[name], rng)
    order = canonical_order(specs)  # as `run` orders the pack before planning it
    rows = _item_rows(pixels, specs)
    pixels = torch.cat([rows[i] for i in order])
    specs = [specs[i] for i in order]
    tokens = sum(s.output_tokens for s in specs)
    budget = fitting_budget(runner.ladder, tokens)
    entry, metadata = runner._place(specs, budget)
    routes = []

    def run() -> None:
        splits = runner.stats.split_packs
        runner.run(pixels, specs, recurring=False)
        routes.append(route(runner.stats.last) + (" (split)" if runner.stats.split_packs > splits else ""))

    def own_graph() -> None:
        runner.run(pixels, specs)

    with torch.inference_mode():
        run()
        for _ in range(2):  # the second sighting captures the pack's own graph
            own_graph()
        runner._fill(entry, pixels, metadata)
        timings = interleaved_ms(
            {
                "run": run,
                "graph": lambda: runner._run_graph(entry, metadata, pixels, specs, DEVICE),
                "replay": lambda: runner._execute(entry),  # the replay (CPU: the padded forward)
                "own": own_graph,
                "plan": lambda: runner._plan(specs, tokens, budget),
                "metadata": lambda: encoder.pack_metadata(specs, entry.layout),
            },
            DEVICE,
            repeats=15,
            warmup=3,
        )
        timeline = host_timeline(run) if DEVICE.type == "cuda" else {"first_launch_ms": float("nan")}
    return {
        "case": name,
        "graph": list(entry.key),
        "rows": sum(s.input_patches for s in specs),
        "graph_rows": budget * encoder.merge_unit,
        "route": routes[-1],
        "own_kept": tuple(s.grid_thw for s in specs) in runner._recurring,
        **{f"{k}_ms": round(v, 3) for k, v in timings.items()},
        "host_timeline_of_run": timeline,
    }


def _item_rows(pixels: torch.Tensor, specs) -> list[torch.Tensor]:
    offsets = np.cumsum([0] + [s.input_patches for s in specs])
    return [pixels[offsets[i] : offsets[i + 1]] for i in range(len(specs))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-vl-8b")
    parser.add_argument("--fine-budget-steps", type=int, default=GraphConfig.fine_budget_steps)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="first_sighting_probe")
    args = parser.parse_args()
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    encoder = from_preset(args.preset, dtype=dtype, device=DEVICE, seed=0)
    rng = np.random.default_rng(0)
    ladder, _ = build_ladder(GraphConfig(fine_budget_steps=args.fine_budget_steps), 64)
    needed = set()
    for name in PROBED:
        _, _, specs = build_case(encoder, CASES[name], np.random.default_rng(1))
        needed.add(fitting_budget(ladder, sum(s.output_tokens for s in specs)))
    budgets = tuple(sorted({64, *needed}))
    runner = EncoderRunner(encoder, GraphConfig(budgets=budgets, compile=True, compile_exact=False))
    runner.capture(progress=lambda message: None)
    rows = [probe_case(runner, encoder, name, rng) for name in PROBED]
    record = {**environment(), "budgets": list(budgets), "fine_budget_steps": args.fine_budget_steps, "cases": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(record, indent=2))
    print(f"{record['device']}, torch {record['torch']}; budgets {budgets}")
    print("| case | graph | rows / graph rows | route | run | graph | replay | own | plan | metadata | first launch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {tuple(r['graph'])} | {r['rows']} / {r['graph_rows']} | {r['route']} "
            f"| {r['run_ms']:.2f} | {r['graph_ms']:.2f} | {r['replay_ms']:.2f} | {r['own_ms']:.2f} "
            f"| {r['plan_ms']:.2f} | {r['metadata_ms']:.2f} "
            f"| {r['host_timeline_of_run']['first_launch_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
