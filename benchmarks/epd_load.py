"""E/PD on one host: chat requests through router -> encoder replicas -> LLM replica.

    python benchmarks/epd_load.py --preset qwen3-vl-8b --device cuda --requests 64 --concurrency 8

Deploys configs/epd.yaml with the given preset for both the encoder and the LLM (random
weights), sends OpenAI-shaped chat requests with 1-3 images each, and records latency, tokens
and the LLM replica's measured embedding handoff (bytes and milliseconds per image).
On one GPU the two deployments share it (`--gpu-share` of a GPU each).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.environment import environment  # noqa: E402

SIZES = [(224, 224), (448, 448), (640, 480), (896, 896)]


def data_url(width: int, height: int, seed: int) -> str:
    array = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-vl-tiny")
    parser.add_argument("--family", default="qwen3-vl")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gpu-share", type=float, default=0.5)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    from ray import serve

    from tests.serve_harness import ServeHarness

    harness = ServeHarness(num_cpus=None)
    gpus = args.gpu_share if args.device == "cuda" else 0
    model = {"family": args.family, "preset": args.preset, "device": args.device}
    url = harness.deploy(
        "configs/epd.yaml",
        deployments={
            "EncoderReplica": {"ray_actor_options": {"num_cpus": 1, "num_gpus": gpus}},
            "LLMReplica": {"ray_actor_options": {"num_cpus": 1, "num_gpus": gpus}},
        },
        model=model,
        llm=dict(model),
        graphs={"max_budget_tokens": 4096},
    )
    urls = [data_url(*SIZES[i % len(SIZES)], seed=i) for i in range(8)]
    rng = np.random.default_rng(0)
    bodies = []
    for _ in range(args.requests):
        picks = rng.integers(0, len(urls), int(rng.integers(1, 4)))
        content = [{"type": "text", "text": "Describe the pictures."}]
        content += [{"type": "image_url", "image_url": {"url": urls[p]}} for p in picks]
        bodies.append(
            {"messages": [{"role": "user", "content": content}], "max_tokens": args.max_tokens, "temperature": 0}
        )

    async def run(batch):
        semaphore = asyncio.Semaphore(args.concurrency)
        async with httpx.AsyncClient(timeout=600) as client:

            async def one(body):
                async with semaphore:
                    start = time.perf_counter()
                    reply = await client.post(url + "/v1/chat/completions", json=body)
                    return reply.status_code, reply.json(), time.perf_counter() - start

            return await asyncio.gather(*(one(b) for b in batch))

    asyncio.run(run(bodies[:4]))  # warm-up
    start = time.perf_counter()
    results = asyncio.run(run(bodies))
    wall_s = time.perf_counter() - start
    latencies = sorted(r[2] for r in results if r[0] == 200)
    usage = [r[1]["usage"] for r in results if r[0] == 200]
    llm = serve.get_deployment_handle("LLMReplica", app_name="epd").describe.remote().result()
    router = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["router"]

    record = {
        **environment(),
        "requests": len(results),
        "ok": len(latencies),
        "wall_s": wall_s,
        "p50_s": latencies[len(latencies) // 2] if latencies else None,
        "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None,
        "vision_tokens": sum(u["vision_tokens"] for u in usage),
        "completion_tokens": sum(u["completion_tokens"] for u in usage),
        "llm_handoff": llm,
        "router_embedding_bytes_received": router["embedding_bytes_received"],
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"epd_load_{args.preset}.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
