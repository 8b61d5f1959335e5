"""What the compiled exact route costs the first time it meets a pack shape, against later times (GPU).

    python benchmarks/cold_probe.py --out benchmarks/results

The runner learns what routes without a graph cost from the packs they serve. Its first GPU run
learned 8.9x the startup estimate for 8 x 448x448 on the exact route, and 1.06x for the
1792x1792 image; this probe says where such a first run's time goes:
- `exact`: `EncoderRunner._forward_exact` (the compiled forward on the pack's exact layout, as
  the runner warms it at startup) on each equal-segment case the route takes, three calls in a
  row, each synchronized: the first call against the later ones. Without graphs there is no
  self-check to lower the route's smallest pack, so only packs of >= ~8192 rows (32 x 224x224,
  1792x1792) take it here;
- `sdpa`: one dense cuDNN attention call (16 heads x 72, as Qwen3-VL-8B) on batch shapes not
  seen before in the process, first call against later ones.
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

from benchmarks.encoder_bench import CASES, build_case  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from encoder_graphs.runner import EncoderRunner, GraphConfig  # noqa: E402
from models import attention, from_preset  # noqa: E402

CUDA = torch.device("cuda")
EXTRA = {"4 x 448x448": [("image", 448, 448)] * 4, "16 x 224x224": [("image", 224, 224)] * 16}


def synced_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--preset", default="qwen3-vl-8b")
    args = parser.parse_args()
    encoder = from_preset(args.preset, dtype=torch.bfloat16, device=CUDA, seed=0)
    attention.set_backend(attention.DEFAULT_BACKEND)
    # No graphs: the exact route's compile, warmed as at the runner's startup. No self-check:
    # since `compile` without `cuda_graphs` is self-checked, it would run (and so warm) shapes
    # this probe times cold. (The startup also compiles the budgets' padded layouts since then.)
    runner = EncoderRunner(encoder, GraphConfig(compile=True, cuda_graphs=False, self_check=False))
    start = time.perf_counter()
    runner.capture(progress=lambda message: None)
    warm_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    exact = []
    cases = {name: items for name, items in CASES.items() if not name.startswith("mixed")}
    for name, items in {**cases, **EXTRA}.items():
        _, pixels, specs = build_case(encoder, items, rng)
        pixels = pixels.to(encoder.dtype)
        if not runner._compiles_exact(specs):
            continue
        compiled = []

        def call():
            compiled.append(runner._forward_exact(pixels, specs)[1])

        with torch.inference_mode():
            ms = [synced_ms(call) for _ in range(3)]
        exact.append({"case": name, "ms": [round(m, 2) for m in ms], "compiled": compiled})
        print(f"exact {name}: {ms[0]:.1f} ms first, then {ms[1]:.1f}, {ms[2]:.1f} (compiled {compiled})", flush=True)
    sdpa = []
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for count, length in ((3, 500), (5, 900), (7, 784), (1, 9000), (2, 9000)):
        q, k, v = (torch.randn(count, 16, length, 72, device=CUDA, dtype=torch.bfloat16) for _ in range(3))

        def attend(q=q, k=k, v=v):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                torch.nn.functional.scaled_dot_product_attention(q, k, v)

        ms = [synced_ms(attend) for _ in range(3)]
        sdpa.append({"batch": count, "seqlen": length, "ms": [round(m, 3) for m in ms]})
        print(f"sdpa {count} x {length}: {ms[0]:.2f} ms first, then {ms[1]:.3f}, {ms[2]:.3f}", flush=True)

    record = {
        **environment(),
        "attention": attention.DEFAULT_BACKEND,
        "preset": args.preset,
        "exact_warm_up_s": round(warm_s, 1),
        "exact": exact,
        "sdpa": sdpa,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cold_probe.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
