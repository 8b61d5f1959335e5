"""Load generator for the HTTP service: throughput, latency percentiles, correctness, router memory.

    python benchmarks/serve_load.py --config configs/gpu.yaml --requests 512 --concurrency 32 --verify
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --requests 2000 --concurrency 64 --bad-fraction 0.3

With `--config` it starts Ray and Serve in this process and deploys the YAML as `serve run`
would; with `--url` it loads a running service. Each request carries 1-3 images of mixed
sizes (PNG); `--bad-fraction` of them carry one malformed item instead (must get a 4xx).
`--verify` compares every returned embedding with the models/ eager path run here on the
same weights (the YAML's preset and seed), within `--tolerance` (relative, max-abs). Prints
a table and saves JSON with device, versions and command.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.environment import environment  # noqa: E402

SIZES = [(224, 224), (448, 448), (640, 480), (896, 896), (1280, 720), (300, 1000)]
BAD_ITEMS = [
    {"type": "image", "image": "%%% not base64 %%%"},
    {"type": "image", "image": base64.b64encode(b"definitely not an image").decode()},
    {"type": "image", "image": base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40).decode()},
    {"type": "image", "image": "", "unknown_field": 1},
]


def image_pool(count: int, seed: int = 0, sizes: list[tuple[int, int]] = SIZES) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pool = []
    for i in range(count):
        width, height = sizes[i % len(sizes)]
        array = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, "PNG")
        pool.append(buffer.getvalue())
    return pool


def make_requests(total: int, bad_fraction: float, pool: list[bytes], seed: int = 1) -> list[tuple[bool, list]]:
    rng = np.random.default_rng(seed)
    # One string per pool image, shared by every request: a copy per item had grown a
    # 12,000-request run to 23 GB before the first request was sent.
    encoded = [base64.b64encode(data).decode() for data in pool]
    requests = []
    for _ in range(total):
        picks = [int(i) for i in rng.integers(0, len(pool), int(rng.integers(1, 4)))]
        items = [{"type": "image", "image": encoded[p]} for p in picks]
        bad = bool(rng.random() < bad_fraction)
        if bad:
            items[int(rng.integers(0, len(items)))] = BAD_ITEMS[int(rng.integers(0, len(BAD_ITEMS)))]
        requests.append((bad, items, picks))
    return requests


USAGE_TAIL = re.compile(rb'"vision_tokens":\s*(\d+)')


async def run_load(
    url: str,
    requests,
    concurrency: int,
    timeout_s: float,
    keep_every: int = 1,
    cache: bool = True,
    on_done: Callable[[int], Awaitable[None]] | None = None,
) -> list[dict]:
    """Send every request; bodies are kept (parsed) only for every `keep_every`-th request, so the
    client's own JSON parsing of large embeddings does not bound the measured throughput.
    `cache=False` opts every request out of the embedding cache (every item really encoded);
    `on_done(n)` is awaited after the n-th completion (n counts from 1)."""
    completed = 0
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def one(index: int, request) -> dict:
            bad, items, picks = request
            async with semaphore:
                start = time.perf_counter()
                try:
                    body = {"items": items} if cache else {"items": items, "cache": False}
                    response = await client.post(url + "/v1/encode", json=body)
                    status, content = response.status_code, response.content
                except httpx.HTTPError as exc:
                    status, content = -1, json.dumps({"error": {"message": repr(exc)}}).encode()
                latency = time.perf_counter() - start
            nonlocal completed
            completed += 1
            if on_done is not None:
                await on_done(completed)
            tokens = USAGE_TAIL.search(content[-200:]) if status == 200 else None
            keep = status != 200 or index % keep_every == 0
            return {
                "index": index,
                "bad": bad,
                "picks": picks,
                "status": status,
                "latency_s": latency,
                "bytes": len(content),
                "vision_tokens": int(tokens.group(1)) if tokens else 0,
                "body": json.loads(content) if keep else None,
            }

        return await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))


def verify(results: list[dict], pool: list[bytes], model_args: dict, tolerance: float) -> dict:
    """Worst relative error of every good response against models/ eager on the same weights."""
    import torch
    from PIL import Image

    from deployments.config import AppConfig
    from deployments.encoder import load_encoder

    encoder = load_encoder(AppConfig.model_validate({"model": model_args}))
    pre = encoder.preprocessor
    cache: dict[int, torch.Tensor] = {}
    worst, checked, failures = 0.0, 0, 0
    for result in results:
        if result["bad"] or result["status"] != 200 or result["body"] is None:
            continue
        for pick, entry in zip(result["picks"], result["body"]["data"]):
            if pick not in cache:
                image = torch.from_numpy(np.asarray(Image.open(io.BytesIO(pool[pick])).convert("RGB")).copy())
                resized = pre.resize_image(image.permute(2, 0, 1).contiguous())
                spec = pre.spec("image", 1, *resized.shape[-2:])
                pixels = pre.pixel_values([resized], "image", device=encoder.device).to(encoder.dtype)
                cache[pick] = encoder.forward_eager(pixels, [spec]).tokens.float().cpu()
            got = torch.from_numpy(
                np.frombuffer(base64.b64decode(entry["embedding"]), "<f4").reshape(entry["shape"]).copy()
            )
            expected = cache[pick]
            error = ((got - expected).abs().max() / expected.abs().max()).item()
            worst = max(worst, error)
            failures += error > tolerance or got.shape != expected.shape
            checked += 1
    return {"items_checked": checked, "worst_relative_error": worst, "failures": failures, "tolerance": tolerance}


def summarize(results: list[dict], wall_s: float) -> dict:
    good = [r for r in results if not r["bad"]]
    bad = [r for r in results if r["bad"]]
    latencies = sorted(r["latency_s"] for r in good if r["status"] == 200)
    tokens = sum(r["vision_tokens"] for r in good if r["status"] == 200)

    def percentile(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1e3 if latencies else float("nan")

    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return {
        "requests": len(results),
        "good_ok": sum(r["status"] == 200 for r in good),
        "good_failed": sum(r["status"] != 200 for r in good),
        "bad_4xx": sum(400 <= r["status"] < 500 for r in bad),
        "bad_not_4xx": sum(not 400 <= r["status"] < 500 for r in bad),
        "statuses": statuses,
        "wall_s": wall_s,
        "requests_per_s": len(results) / wall_s,
        "vision_tokens_per_s": tokens / wall_s,
        "response_mb_per_s": sum(r["bytes"] for r in results) / wall_s / 1e6,
        "p50_ms": percentile(0.50),
        "p90_ms": percentile(0.90),
        "p99_ms": percentile(0.99),
        "mean_ms": statistics.fmean(latencies) * 1e3 if latencies else float("nan"),
    }


def rss_summary(samples: list[tuple[int, float]]) -> dict:
    """Router RSS samples (completions, MB; the first taken idle, before the load). Growth and
    growth per 1,000 requests are taken from the first sample under load, over each half of
    the run: a leak keeps its slope, allocator pools filling flatten out. The idle-to-loaded
    step is the working set of the requests in flight, reported apart."""
    idle, loaded = samples[0], samples[1:]
    half = len(loaded) // 2

    def slope(part: list[tuple[int, float]]) -> float:
        (n0, mb0), (n1, mb1) = part[0], part[-1]
        return (mb1 - mb0) / (n1 - n0) * 1000 if n1 > n0 else float("nan")

    return {
        "samples": samples,
        "idle_mb": idle[1],
        "in_flight_step_mb": loaded[0][1] - idle[1] if loaded else float("nan"),
        "growth_under_load_mb": loaded[-1][1] - loaded[0][1] if loaded else float("nan"),
        "mb_per_1000_first_half": slope(loaded[: half + 1]) if loaded else float("nan"),
        "mb_per_1000_second_half": slope(loaded[half:]) if loaded else float("nan"),
    }


def deploy(config_path: str) -> tuple[str, dict]:
    import yaml

    from tests.serve_harness import ServeHarness

    # configs/gpu.yaml on a fresh H100: 204 s to compile, capture and self-check the Qwen3-VL-8B
    # replica (serve_load_gpu_h100_exact.json), more than the tests' default wait.
    harness = ServeHarness(num_cpus=None, deploy_timeout_s=900)
    url = harness.deploy(config_path)
    return url, yaml.safe_load(Path(config_path).read_text())["applications"][0]["args"]["model"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML to deploy in this process")
    parser.add_argument("--url", help="a running service")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--bad-fraction", type=float, default=0.0)
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--tolerance", type=float, default=3e-2)
    parser.add_argument("--verify-every", type=int, default=8, help="verify every n-th request's body")
    parser.add_argument("--timeout-s", type=float, default=120)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="serve_load")
    parser.add_argument("--no-cache", action="store_true", help="opt every request out of the embedding cache")
    parser.add_argument(
        "--sizes",
        type=lambda text: [tuple(int(v) for v in size.split("x")) for size in text.split(",")],
        default=SIZES,
        help="image sizes WxH,WxH,... (default: 224x224 up to 1280x720)",
    )
    parser.add_argument("--rss-every", type=int, default=0, help="sample the router's RSS every n completions")
    args = parser.parse_args()
    if not args.config and not args.url:
        parser.error("give --config or --url")
    url, model_args = deploy(args.config) if args.config else (args.url, None)
    pool = image_pool(24, sizes=args.sizes)
    asyncio.run(run_load(url, make_requests(8, 0.0, pool, seed=99), 8, args.timeout_s))  # warm-up
    requests = make_requests(args.requests, args.bad_fraction, pool)
    start = time.perf_counter()
    keep_every = args.verify_every if args.verify else len(requests) + 1
    rss: list[tuple[int, float]] = []

    def router_rss_mb() -> float:
        return httpx.get(url + "/v1/models", timeout=args.timeout_s).json()["data"][0]["router"]["rss_mb"]

    async def sample_rss(done: int) -> None:
        if args.rss_every and done % args.rss_every == 0:
            try:
                rss.append((done, await asyncio.to_thread(router_rss_mb)))
            except httpx.HTTPError as exc:  # a missed sample must not end the run
                print(f"{done} done, RSS sample failed: {exc!r}", flush=True)
                return
            print(f"{done} done, router RSS {rss[-1][1]:.1f} MB, {time.perf_counter() - start:.0f} s", flush=True)

    if args.rss_every:
        rss.append((0, router_rss_mb()))
    results = asyncio.run(
        run_load(url, requests, args.concurrency, args.timeout_s, keep_every, not args.no_cache, sample_rss)
    )
    summary = summarize(results, time.perf_counter() - start)
    if args.rss_every:
        if rss[-1][0] != len(results):
            rss.append((len(results), router_rss_mb()))
        summary["router_rss"] = rss_summary(rss)
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
    summary["router"] = model["router"]
    summary["encoder"] = model.get("encoder")
    if args.verify:
        summary["verify"] = verify(results, pool, model_args, args.tolerance)

    record = {
        **environment(),
        "cpu_cores": os.cpu_count(),
        "config": args.config,
        "concurrency": args.concurrency,
        "summary": summary,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2))
    failed = summary["good_failed"] or summary["bad_not_4xx"] or (args.verify and summary["verify"]["failures"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
