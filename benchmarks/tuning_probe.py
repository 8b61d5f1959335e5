"""Does inductor's kernel tuning buy MFU on large exact packs? Qwen3-VL-8B, one process (GPU).

    python benchmarks/tuning_probe.py --configs default coordinate_descent --out benchmarks/results

For each inductor configuration (dynamo reset in between, so each compiles afresh), each case
runs on its exact layout through `torch.compile(forward_padded, dynamic=True)` captured in a
CUDA graph (the runner's shape graphs), and is timed by replay. Configurations:
- default: what the runner compiles with;
- coordinate_descent: `torch._inductor.config.coordinate_descent_tuning = True` (Triton
  block sizes / warps searched per kernel on its first shapes: layer norms, rotary, copies);
- max_autotune: `mode="max-autotune-no-cudagraphs"` (Triton matmul templates benchmarked
  against cuBLAS too; much longer compiles; not run so far);
- multi_kernel: `triton.multi_kernel = 1` (persistent and looped reductions both generated,
  the faster picked by benchmark);
- t_fc2_proj, t_down, t_all: linear weights column-major (`lay_out_weights`);
- plain_norms: Qwen3-VL's tower through transformers' own forward, the residual adds and layer
  norms left to inductor (`qwen3_vl.FUSED_RESIDUAL_NORMS` False; the default fuses each pair in
  one Triton kernel, `models/triton_norm.py`);
- persistent: inductor heuristics that make row reductions of up to 2048 columns persistent
  (one pass over each row; the default stops at 1024, below the towers' 1152 / 1280).

Results (H100, 2026-11-22): `tuning_probe_run1.json` (default vs coordinate_descent) and
`tuning_probe.json` (persistent, multi_kernel, default): every variant within the spread of
the same default graph between the two runs (4-5%).
Prints a table of replay ms and MFU per (config, case), with compile seconds and the error
against the uncompiled eager forward.
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

from benchmarks.encoder_bench import CASES, build_case, measure_peak_tflops, useful_flops  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from benchmarks.fusion_probe import kernel_profile  # noqa: E402
from benchmarks.weight_layout_probe import set_column_major  # noqa: E402
from encoder_graphs.selfcheck import back_to_back_ms, captured, relative_error  # noqa: E402
from models import from_preset, qwen3_vl  # noqa: E402

CUDA = torch.device("cuda")
TRANSPOSED = {"t_fc2_proj": ("attn.proj", "mlp.linear_fc2"), "t_down": ("mlp.down_proj",), "t_all": ("",)}
"""Weight layouts: the linear layers whose names end so hold their weights column-major (the
same [out, in] tensor, strides (1, out)), so `F.linear` hands cuBLAS a row-major [in, out]
operand: another kernel choice (`gemm_probe.json`: fc2 679 against 604 TFLOP/s at 6272 rows)."""
CONFIGS = ("default", "coordinate_descent", "max_autotune", "multi_kernel", "persistent", "plain_norms", *TRANSPOSED)


def lay_out_weights(encoder, suffixes: tuple[str, ...]) -> None:
    """Linear weights of the tower whose names end with one of `suffixes` column-major, the
    rest row-major (contiguous)."""
    for name, module in encoder.tower.named_modules():
        if isinstance(module, torch.nn.Linear):
            set_column_major(module, bool(suffixes) and name.endswith(suffixes))


def persistent_rows_choices():
    """Inductor heuristics with persistent (one-pass) row reductions up to 2048 columns: the
    default stops at 1024, so the towers' layer norms over 1152 (Qwen3-VL-8B) or 1280
    (Qwen2.5-VL-7B) columns loop over each row twice."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class PersistentRows(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction, *args, **kwargs):
            if features.get_reduction_hint() == ReductionHint.INNER and V.graph.sizevars.statically_known_leq(
                features.reduction_numel, 2048
            ):
                return True
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction, *args, **kwargs)

    return V.set_choices_handler(PersistentRows())


def compiled_forward(encoder, config: str):
    import contextlib

    import torch._inductor.config as inductor

    torch._dynamo.reset()
    qwen3_vl.FUSED_RESIDUAL_NORMS = config != "plain_norms"
    lay_out_weights(encoder, TRANSPOSED.get(config, ()))
    inductor.coordinate_descent_tuning = config == "coordinate_descent"
    mode = "max-autotune-no-cudagraphs" if config == "max_autotune" else None
    options = {"triton.multi_kernel": 1} if config == "multi_kernel" else None
    forward = torch.compile(encoder.forward_padded, dynamic=True, mode=mode, options=options)
    context = persistent_rows_choices if config == "persistent" else contextlib.nullcontext

    def call(*args):
        with context():
            return forward(*args)

    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--preset", default="qwen3-vl-8b")
    parser.add_argument("--configs", nargs="+", default=["default", "coordinate_descent"], choices=CONFIGS)
    parser.add_argument("--cases", nargs="+", default=["8 x 448x448", "1 x 1792x1792"])
    parser.add_argument("--profile", action="store_true", help="kernel-category profile of each graph")
    parser.add_argument("--tag", default="", help="suffix of the result file name")
    args = parser.parse_args()
    peak = measure_peak_tflops(CUDA)
    encoder = from_preset(args.preset, dtype=torch.bfloat16, device=CUDA, seed=0)
    rng = np.random.default_rng(0)
    built = {case: build_case(encoder, CASES[case], rng) for case in args.cases}
    rows = []
    out_dir = Path(args.out)
    for config in args.configs:
        forward = compiled_forward(encoder, config)
        for case, (_, pixels, specs) in built.items():
            layout = encoder.exact_layout(specs)
            metadata = {k: v.to(CUDA) for k, v in encoder.pack_metadata(specs, layout).items()}
            dense = len({s.frame_patches for s in specs}) == 1
            with torch.inference_mode(False), torch.no_grad():
                start = time.perf_counter()
                out = forward(pixels, metadata, layout, dense)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - start
                error = relative_error(out.tokens, encoder.forward_eager(pixels, specs).tokens)
                with torch.compiler.set_stance("fail_on_recompile"):
                    graph = captured(lambda: forward(pixels, metadata, layout, dense))
                ms = back_to_back_ms(graph.replay, CUDA, repeats=20)
                profile = kernel_profile(graph.replay) if args.profile else None
            flops = useful_flops(encoder, specs)
            row = {
                "config": config,
                "case": case,
                "compile_s": round(compile_s, 1),
                "err_vs_eager": error,
                "graph_ms": ms,
                "mfu": flops / (ms * 1e-3) / (peak * 1e12),
            }
            if profile is not None:
                row["profile_ms"], row["profile_table"] = profile
                print(profile[1])
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "profile_table"}), flush=True)
    record = {
        **environment(),
        "peak_tflops": peak,
        "rows": rows,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"tuning_probe{args.tag}.json").write_text(json.dumps(record, indent=2))
    print(f"\npeak {peak:.0f} TFLOP/s, {record['device']}, torch {record['torch']}")
    print("| config | case | compile s | err | graph ms | MFU | kernel ms by category |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        kernels = ", ".join(f"{k} {v:.2f}" for k, v in r.get("profile_ms", {}).items())
        print(
            f"| {r['config']} | {r['case']} | {r['compile_s']} | {r['err_vs_eager']:.1e} "
            f"| {r['graph_ms']:.2f} | {r['mfu']:.1%} | {kernels} |"
        )


if __name__ == "__main__":
    main()
