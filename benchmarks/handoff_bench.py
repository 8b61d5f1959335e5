"""Cost of handing one image's embeddings from an encoder replica to an LLM replica.

    python benchmarks/handoff_bench.py --out benchmarks/results

Timed from the router asking the encoder for the result until the LLM holds the tensors.
Three Ray actors stand for the encoder replica, the router and the LLM replica (the same
mechanism the deployments use: `ray.put` in the encoder, references forwarded by the
router, `await ref` in the LLM). Compared with the alternative of returning the tensors to
the router and sending them on by value. Sizes are Qwen3-VL-8B's (hidden 4096, bf16, 3
deepstack layers: 4 arrays per image). One node: the object store moves bytes by shared
memory; across nodes add the network transfer of the same bytes once (by reference) or
twice (through the router).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common.environment import environment  # noqa: E402
from deployments.wire import item_nbytes, item_to_wire  # noqa: E402
from models.protocol import ItemOutput  # noqa: E402

HIDDEN, DEEPSTACK = 4096, 3


@ray.remote(num_cpus=0)
class Encoder:
    def __init__(self):
        self.items: dict[int, ItemOutput] = {}

    def make(self, tokens: int, as_ref: bool):
        """An encoded image's outputs (made once per size, so timing covers only the handoff)."""
        if tokens not in self.items:
            self.items[tokens] = ItemOutput(
                torch.randn(tokens, HIDDEN, dtype=torch.bfloat16),
                torch.randn(DEEPSTACK, tokens, HIDDEN, dtype=torch.bfloat16),
            )
        item = item_to_wire(self.items[tokens])
        return [ray.put(item)] if as_ref else [item]


@ray.remote(num_cpus=0)
class LLM:
    async def receive(self, payload, start: float) -> dict:
        item = await payload[0] if isinstance(payload[0], ray.ObjectRef) else payload[0]
        moved = item_nbytes(item)
        return {"bytes": moved, "ms": (time.perf_counter() - start) * 1e3}


@ray.remote(num_cpus=0)
class Router:
    def __init__(self, encoder, llm):
        self.encoder, self.llm = encoder, llm

    async def forward(self, tokens: int, as_ref: bool) -> dict:
        """Encoder's result -> router -> LLM; timed from the router's call until the LLM holds tensors."""
        start = time.perf_counter()
        payload = await self.encoder.make.remote(tokens, as_ref)  # refs stay refs; tensors land here
        result = await self.llm.receive.remote(payload, start)
        result["router_held_bytes"] = 0 if as_ref else result["bytes"]
        return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    router = Router.remote(Encoder.remote(), LLM.remote())
    rows = []
    for tokens in (64, 256, 1024, 4096):
        for as_ref in (True, False):
            samples = [ray.get(router.forward.remote(tokens, as_ref)) for _ in range(args.repeats + 1)][1:]
            ms = sorted(s["ms"] for s in samples)[len(samples) // 2]
            rows.append(
                {
                    "tokens": tokens,
                    "mode": "reference" if as_ref else "through router",
                    "bytes_per_image": samples[0]["bytes"],
                    "router_held_bytes": samples[0]["router_held_bytes"],
                    "handoff_ms": round(ms, 3),
                }
            )
    print("| tokens | mode | MB per image | MB held by router | handoff ms (median) |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['mode']} | {r['bytes_per_image'] / 1e6:.1f} | "
            f"{r['router_held_bytes'] / 1e6:.1f} | {r['handoff_ms']:.2f} |"
        )
    record = {
        **environment(),
        "machine": platform.platform(),
        "cpus": ray.cluster_resources().get("CPU"),
        "ray": ray.__version__,
        "rows": rows,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "handoff_bench.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
