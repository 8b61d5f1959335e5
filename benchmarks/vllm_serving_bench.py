"""The deployment a user would choose, on two GPUs: E/PD (our encoder replica feeding one vLLM replica by
reference, or both on each GPU) against vLLM alone with data parallelism 2, open loop at rising rates.

    python benchmarks/vllm_serving_bench.py --checkpoint /tmp/qwen3-vl-8b-random --systems ours --out DIR
    python benchmarks/vllm_serving_bench.py --checkpoint /tmp/qwen3-vl-8b-random --systems vllm-dp2 --out DIR
    python benchmarks/vllm_serving_bench.py --report --out DIR      # the table and plots of what DIR holds

All systems serve the same checkpoint (`python -m models.tiny_checkpoint qwen3-vl DIR --preset qwen3-vl-8b
--device cuda`) through their OpenAI chat API and get the same requests: `ours` is `serve run` of
configs/epd-vllm.yaml pointed at it (one encoder replica on one GPU, one `VLLMReplica` on the other),
`ours-colocated` of configs/epd-vllm-colocated.yaml (a `ColocatedReplica`, encoder and vLLM, on each GPU);
`vllm-dp2` is `vllm serve --data-parallel-size 2` with its ViT CUDA graphs on (`cudagraph_mm_encoder`, the V1
model runner that uses them); `vllm-epd` is vLLM's own encoder disaggregation, an `--mm-encoder-only` instance
on GPU 0 and a prefill-decode one on GPU 1 sharing embeddings through its `ECExampleConnector` (in
/dev/shm), each request sent to the first with one token, then to the second, as vLLM's EPD proxy does
(`benchmarks/common/serving_systems.py`). Workloads (every image unique, so no cache hits):
- image-heavy: 1-4 JPEG photos from 448x448 to 1920x1080 and a short question;
- image-light: one 224x224 photo and 1,000-2,000 tokens of text.
Each answer is 64 tokens (`ignore_eos`), greedy. Arrivals are Poisson at each rate of `--rates` in turn for
`--seconds` (client processes share the rate; `--merge` keeps a system's saved rates not measured again);
a rate's requests all finish before the next begins, and the ramp stops once a rate overloads the system
(p99 TTFT over `--stop-ttft`, errors, or fewer answers than asked). TTFT is the time from sending a
request to the first chunk carrying a generated token (ours: every chunk carries `token_ids`; vLLM's with
`return_token_ids`). Reported per rate: TTFT p50/p99, end-to-end p50, answered requests/s and output
tokens/s (over the first send to the last answer), each GPU's mean utilisation (nvidia-smi, every 0.5 s)
and the host cores the servers kept busy (all busy cores less the clients'); per workload: the answered
requests/s of the highest rate within `SLO_TTFT_S` (p99 TTFT), with and without every lower rate passing.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import multiprocessing as mp
import random
import signal
import sys
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKLOADS = {
    "image-heavy": {
        "images": (1, 4),
        "sizes": [(448, 448), (640, 480), (1024, 768), (1280, 720), (1920, 1080)],
        "text_tokens": (8, 32),
        "rates": [1, 2, 4, 8, 12, 16, 24, 32],
    },
    "image-light": {
        "images": (1, 1),
        "sizes": [(224, 224)],
        "text_tokens": (1000, 2000),
        "rates": [2, 4, 8, 16, 24, 32, 48],
    },
}
OUTPUT_TOKENS = 64
SLO_TTFT_S = 2.0
"""The p99 TTFT a rate must keep to count as served (the issue's SLO)."""
WORDS = (
    "the of and to in is that for it as with was on be by at this from or an are not have which one all were "
    "image river window light market street mountain garden table evening morning city train color shadow "
    "building people water paper music forest summer winter cloud field bridge harbor station corner story"
).split()


# ---- requests (pure) ----


def photo(width: int, height: int, seed: int) -> np.ndarray:
    """A photo-like RGB image: smooth gradients and fine noise (JPEG sizes like a camera's)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([np.sin(x / rng.uniform(20, 200) + c) * np.cos(y / rng.uniform(20, 200) - c) for c in range(3)], -1)
    noise = rng.normal(0, 0.08, (height, width, 3))
    return np.clip((base * 0.5 + 0.5 + noise) * 255, 0, 255).astype(np.uint8)


def stamped(image: np.ndarray, index: int) -> np.ndarray:
    """`image` with a 16x16 block of its own, so each request's images hash apart (no cache hits)."""
    out = image.copy()
    rng = np.random.default_rng(index)
    row, col = rng.integers(0, image.shape[0] - 16), rng.integers(0, image.shape[1] - 16)
    out[row : row + 16, col : col + 16] = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    return out


def data_url(image: np.ndarray) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def text_of(tokens: int, rng: random.Random, count_tokens) -> str:
    """Random words with about `tokens` tokens (`count_tokens`: the checkpoint's tokenizer)."""
    words = [rng.choice(WORDS) for _ in range(tokens)]
    while len(words) > 1 and count_tokens(" ".join(words)) > tokens:
        words = words[: max(1, int(len(words) * 0.95))]
    return " ".join(words)


def request_body(workload: dict, index: int, seed: int, bases: dict, count_tokens) -> dict:
    """One chat request of `workload`: its images (unique), its text, 64 greedy tokens, streamed."""
    rng = random.Random(seed * 1_000_003 + index)
    parts = [
        {
            "type": "image_url",
            "image_url": {"url": data_url(stamped(bases[rng.choice(workload["sizes"])], rng.getrandbits(31)))},
        }
        for _ in range(rng.randint(*workload["images"]))
    ]
    text = f"Request {seed}-{index}. " + text_of(rng.randint(*workload["text_tokens"]), rng, count_tokens)
    return {
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def arrivals(rate: float, seconds: float, rng: random.Random) -> list[float]:
    """Poisson arrival offsets (s) at `rate` per second within `seconds`."""
    times, now = [], rng.expovariate(rate)
    while now < seconds:
        times.append(now)
        now += rng.expovariate(rate)
    return times


# ---- what a rate measured (pure) ----


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[dict], rate: float, seconds: float) -> dict:
    """A rate's numbers from its requests' records (`sent`, `ttft`, `end` in s from the rate's start;
    `tokens`; `error`)."""
    ok = [r for r in records if r["error"] is None]
    span = (max(r["end"] for r in ok) - min(r["sent"] for r in records)) if ok else seconds
    ttft = [r["ttft"] for r in ok]
    return {
        "rate": rate,
        "seconds": seconds,
        "sent": len(records),
        "answered": len(ok),
        "errors": len(records) - len(ok),
        "error_kinds": sorted({r["error"] for r in records if r["error"]})[:3],
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile([r["end"] - r["sent"] for r in ok], 50),
        "requests_per_s": len(ok) / span,
        "output_tokens_per_s": sum(r["tokens"] for r in ok) / span,
        "output_tokens_mean": (sum(r["tokens"] for r in ok) / len(ok)) if ok else 0,
    }


def overloaded(level: dict, stop_ttft: float) -> bool:
    """A rate past what the system serves: p99 TTFT over `stop_ttft`, an error, or under 85% answered per second."""
    return (
        level["errors"] > 0
        or level["ttft_p99_s"] is None
        or level["ttft_p99_s"] > stop_ttft
        or level["requests_per_s"] < 0.85 * level["rate"]
    )


def rate_at_slo(levels: list[dict], slo_ttft: float, every_below: bool = True) -> float:
    """Answered requests/s at the highest rate that kept its p99 TTFT within `slo_ttft` without errors
    (0: none); `every_below`: only up to the first rate that did not (a p99 over a few hundred requests
    is noisy, so the report gives both)."""
    served = 0.0
    for lv in sorted(levels, key=lambda lv: lv["rate"]):
        if lv["errors"] or lv["ttft_p99_s"] is None or lv["ttft_p99_s"] > slo_ttft:
            if every_below:
                break
            continue
        served = max(served, lv["requests_per_s"])
    return served


def parse_rates(entries: list[str] | None, workloads: list[str]) -> dict[str, list[float] | None]:
    """`--rates`: plain numbers for every workload, or `WORKLOAD=R1,R2,...` for one; a workload
    given none runs its default rates (None)."""
    rates: dict[str, list[float] | None] = dict.fromkeys(workloads)
    for entry in entries or []:
        name, _, values = entry.rpartition("=")
        if name and name not in workloads:
            raise ValueError(f"--rates {entry}: {name} is not one of the workloads run ({', '.join(workloads)})")
        for workload in [name] if name else workloads:
            rates[workload] = (rates[workload] or []) + [number(v) for v in values.split(",") if v]
    return rates


def number(text: str) -> float:
    """A rate as given: whole numbers stay ints, so a rate's requests (seeded by its text) match earlier runs'."""
    value = float(text)
    return int(value) if value.is_integer() else value


def merge_levels(kept: list[dict], measured: list[dict]) -> list[dict]:
    """A workload's levels after a re-measure of some rates: the new ones replace those at their rates,
    the others stay (each level records its own `seconds`), in rate order."""
    rates = {lv["rate"] for lv in measured}
    return sorted([lv for lv in kept if lv["rate"] not in rates] + measured, key=lambda lv: lv["rate"])


# ---- the load: client processes, one asyncio loop each ----


def client_process(jobs, results, barrier, target: dict, checkpoint: str) -> None:
    """Runs each job (a share of one rate) it is given: builds its requests, waits for the others, sends
    them open loop, and reports one record per request."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    count_tokens = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
    bases: dict = {}
    while (job := jobs.get()) is not None:
        workload = WORKLOADS[job["workload"]]
        for size in workload["sizes"]:
            bases.setdefault(size, photo(*size, seed=size[0] * 7 + size[1]))
        rng = random.Random(job["seed"])
        offsets = arrivals(job["rate"], job["seconds"], rng)
        bodies = [
            {**request_body(workload, i, job["seed"], bases, count_tokens), "model": target["model"], **target["extra"]}
            for i in range(len(offsets))
        ]
        barrier.wait()
        results.put(asyncio.run(open_loop(target["url"], offsets, bodies, job["timeout"], target["encode_url"])))


async def open_loop(
    url: str, offsets: list[float], bodies: list[dict], timeout: float, encode_url: str | None = None
) -> list[dict]:
    """Each body sent at its offset, streamed; with `encode_url` (vLLM's EPD) first to its encoder
    instance, as vLLM's EPD proxy does, the TTFT counting both."""
    import aiohttp

    from benchmarks.common.serving_systems import encode_body

    start = time.monotonic()
    # idle connections closed here before any server closes them (uvicorn: after 5 s), or a request sent on
    # one the server is closing fails with ServerDisconnectedError (it stopped vLLM's 7/s rate once)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:

        async def one(offset: float, body: dict) -> dict:
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            record = {"sent": time.monotonic() - start, "ttft": None, "end": None, "tokens": 0, "error": None}
            try:
                if encode_url is not None:
                    async with session.post(f"{encode_url}/v1/chat/completions", json=encode_body(body)) as reply:
                        if reply.status != 200:
                            raise RuntimeError(f"encoder HTTP {reply.status}: {(await reply.text())[:150]}")
                await stream_chat(session, url, body, record, start)
            except Exception as error:  # noqa: BLE001 - every failure is a record
                record["error"] = f"{type(error).__name__}: {error}"[:200]
            record["end"] = time.monotonic() - start
            if record["error"] is None and record["ttft"] is None:
                record["error"] = "no token"
            return record

        return await asyncio.gather(*(one(o, b) for o, b in zip(offsets, bodies)))


async def stream_chat(session, url: str, body: dict, record: dict, start: float) -> None:
    async with session.post(f"{url}/v1/chat/completions", json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {(await reply.text())[:150]}")
        async for line in reply.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"])[:150])
            ids = chunk.get("token_ids") or next((c.get("token_ids") for c in chunk.get("choices") or []), None)
            if ids:
                record["tokens"] += len(ids)
                if record["ttft"] is None:
                    record["ttft"] = time.monotonic() - start - record["sent"]


def time_for_a_rate(deadline: float, seconds: float, now: float) -> bool:
    """Whether a rate's arrivals (and 30 s to drain them) still end before the time limit."""
    return now <= deadline - seconds - 30


def run_workload(name: str, args, target: dict, log) -> list[dict]:
    """Every rate of the workload in turn, until one overloads the system or time runs out."""
    from benchmarks.common.utilisation import CpuSampler, GpuSampler

    ctx = mp.get_context("spawn")
    jobs, results = [ctx.Queue() for _ in range(args.clients)], ctx.Queue()
    barrier = ctx.Barrier(args.clients + 1)
    workers = [
        ctx.Process(target=client_process, args=(jobs[i], results, barrier, target, args.checkpoint))
        for i in range(args.clients)
    ]
    for worker in workers:
        worker.start()
    levels = []
    try:
        for rate in args.rates.get(name) or WORKLOADS[name]["rates"]:
            if not time_for_a_rate(args.deadline, args.seconds, time.monotonic()):
                log(f"{name}: stopping before {rate}/s: time limit")
                break
            for i in range(args.clients):
                seed = zlib.crc32(f"{name} {rate} {i}".encode())  # the same requests for every system
                jobs[i].put(
                    {
                        "workload": name,
                        "rate": rate / args.clients,
                        "seconds": args.seconds,
                        "seed": seed,
                        "timeout": args.request_timeout,
                    }
                )
            barrier.wait(timeout=300)
            sampler, cpu = GpuSampler(), CpuSampler([worker.pid for worker in workers])
            records = [
                r for _ in range(args.clients) for r in results.get(timeout=args.seconds + args.request_timeout + 60)
            ]
            level = summarize(records, rate, args.seconds) | {"gpus": sampler.stop(), "cpu": cpu.stop()}
            levels.append(level)
            log(f"{name} {rate:>5}/s: {format_level(level)}")
            if overloaded(level, args.stop_ttft):
                break
    finally:
        for queue in jobs:
            queue.put(None)
        for worker in workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()
    return levels


def busiest(level: dict, count: int = 3) -> str:
    """The level's busiest server processes and the cores each used: a Serve replica by its deployment
    (`ray::ServeReplica:app:Deployment`), anything else by its title's first word."""
    found = level.get("cpu", {}).get("busiest_processes", [])[:count]
    names = [title.split()[0].rsplit(":", 1)[-1].rsplit("/", 1)[-1] for title, _ in found]
    return ", ".join(f"{name} {cores}" for name, (_, cores) in zip(names, found)) or "-"


def format_level(level: dict) -> str:
    p = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    gpus = " ".join(f"{g}:{v['util_pct']:.0f}%" for g, v in level.get("gpus", {}).items())
    if "cpu" in level:
        gpus += f" server cores {level['cpu']['server_cores']} (busiest: {busiest(level)})"
    return (
        f"{level['answered']}/{level['sent']} answered, {level['requests_per_s']:.2f} req/s, "
        f"{level['output_tokens_per_s']:.0f} out tok/s, "
        f"TTFT p50 {p(level['ttft_p50_s'])} p99 {p(level['ttft_p99_s'])} s, "
        f"e2e p50 {p(level['e2e_p50_s'])} s, {gpus} {level['error_kinds'] or ''}"
    )


def probe_body(model: str) -> dict:
    """A chat with an image: a system that answers it has met its encoders."""
    image = {"type": "image_url", "image_url": {"url": data_url(photo(64, 64, seed=0))}}
    content = [image, {"type": "text", "text": "Hi"}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


def measure(system: str, args, out: Path) -> int:
    """Starts `system`, runs each workload's rates against it, saves and reports; the levels measured."""
    from benchmarks.common.environment import environment
    from benchmarks.common.serving_systems import keep_serve_logs, prefill_budgets, start_system, stop_system

    def log(line: str) -> None:
        print(line, flush=True)
        with open(out / f"{system}.log", "a") as file:
            file.write(line + "\n")

    started = time.monotonic()
    if not time_for_a_rate(args.deadline, args.seconds, started):  # no server started for nothing
        log(f"{system}: not started: the time limit leaves no rate time to run")
        return 0
    path = out / f"{system}.json"
    kept = json.loads(path.read_text())["workloads"] if args.merge and path.exists() else {}
    running = start_system(system, args, out, log, probe_body)
    target = {"url": running.url, "model": running.model, "extra": running.extra, "encode_url": running.encode_url}
    record = {"system": system, "environment": environment(), "startup_s": round(time.monotonic() - started, 1)}
    record["model"] = running.model  # the chat model's id, as the system's /v1/models lists it
    record["workloads"] = dict(kept)
    count = 0
    try:
        for name in args.workloads:
            # a few requests of the workload first: its first images and prompt lengths reach both sides
            run_warmup = argparse.Namespace(**{**vars(args), "rates": {name: [1]}, "seconds": 5})
            run_workload(name, run_warmup, target, lambda line: log("warm-up " + line))
            measured = run_workload(name, args, target, log)
            count += len(measured)
            record["workloads"][name] = merge_levels(kept.get(name, []), measured)
            path.write_text(json.dumps(record, indent=1))
    finally:
        stop_system(running)
        keep_serve_logs(system, out)
        record["max_num_batched_tokens"] = prefill_budgets(system, out)
        path.write_text(json.dumps(record, indent=1))
    report(out)
    return count


# ---- the report ----


def report(out: Path) -> None:
    from benchmarks.common.serving_systems import SYSTEMS

    records = {
        r["system"]: r for r in (json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.stem in SYSTEMS)
    }
    lines = ["# E/PD against vLLM alone (two GPUs, open loop)", ""]
    for system, record in records.items():
        env = record["environment"]
        budgets = record.get("max_num_batched_tokens")
        lines.append(
            f"- {system}: {env['device']}, torch {env['torch']}, ray {env['ray']}, started in {record['startup_s']} s"
            + ("" if budgets is None else f", vLLM's max_num_batched_tokens {budgets or 'not logged'}")
        )
    for name in WORKLOADS:
        lines += [
            "",
            f"## {name}",
            "",
            "| system | rate/s | window s | answered req/s | out tok/s | TTFT p50 s | TTFT p99 s | e2e p50 s "
            "| GPU util | server cores | busiest processes, cores |",
        ]
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for system, record in records.items():
            for lv in record["workloads"].get(name, []):
                gpus = " ".join(f"{v['util_pct']:.0f}%" for v in lv["gpus"].values())
                lines.append(
                    f"| {system} | {lv['rate']} | {lv.get('seconds', 15):g} | {lv['requests_per_s']:.2f} | "
                    f"{lv['output_tokens_per_s']:.0f} | "
                    f"{lv['ttft_p50_s'] or 0:.2f} | {lv['ttft_p99_s'] or 0:.2f} | {lv['e2e_p50_s'] or 0:.2f} | {gpus} "
                    f"| {lv.get('cpu', {}).get('server_cores', '-')} | {busiest(lv)} |"
                )
        at_slo = {
            s: (
                rate_at_slo(r["workloads"].get(name, []), SLO_TTFT_S),
                rate_at_slo(r["workloads"].get(name, []), SLO_TTFT_S, False),
            )
            for s, r in records.items()
        }
        lines += [
            "",
            f"Answered requests/s at p99 TTFT <= {SLO_TTFT_S:g} s, every lower rate passing too / the highest passing "
            "rate: " + ", ".join(f"{s} {every:.2f} / {highest:.2f}" for s, (every, highest) in at_slo.items()),
        ]
        plot(records, name, out / f"{name}.png")
    (out / "vllm_serving.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(records: dict, name: str, path: Path) -> None:
    from benchmarks.common.plots import pyplot

    if (plt := pyplot()) is None:
        return
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for system, record in records.items():
        levels = record["workloads"].get(name, [])
        rates = [lv["rate"] for lv in levels]
        axes[0].plot(rates, [lv["ttft_p99_s"] for lv in levels], "o-", label=f"{system} p99")
        axes[0].plot(rates, [lv["ttft_p50_s"] for lv in levels], "x--", label=f"{system} p50")
        axes[1].plot(rates, [lv["output_tokens_per_s"] for lv in levels], "o-", label=system)
        for gpu in sorted({g for lv in levels for g in lv["gpus"]}):
            axes[2].plot(
                rates, [lv["gpus"].get(gpu, {}).get("util_pct") for lv in levels], "o-", label=f"{system} {gpu}"
            )
    axes[0].axhline(SLO_TTFT_S, color="grey", linewidth=0.8)
    for axis, title in zip(axes, ("TTFT (s)", "output tokens/s", "GPU utilisation (%)")):
        axis.set_xlabel("offered requests/s")
        axis.set_title(f"{name}: {title}")
        axis.legend(fontsize=7)
    axes[0].set_yscale("log")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="the checkpoint both systems serve")
    parser.add_argument("--systems", default="ours,vllm-dp2")
    parser.add_argument("--config", type=Path, help="our systems: another E/PD config than `OURS` names")
    parser.add_argument("--workloads", default="image-heavy,image-light")
    parser.add_argument(
        "--rates", nargs="*", help="requests/s in turn: numbers for every workload or WORKLOAD=R1,R2 (default: its own)"
    )
    parser.add_argument(
        "--merge", action="store_true", help="keep the system's saved levels at rates not measured again"
    )
    parser.add_argument("--seconds", type=float, default=15, help="each rate's arrivals")
    parser.add_argument("--clients", type=int, default=4, help="client processes sharing each rate")
    parser.add_argument("--stop-ttft", type=float, default=10.0)
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--time-limit", type=float, default=3600.0, help="no rate starts that would end after it")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", action="store_true", help="only the table and plots of what --out holds")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM still stops the server it started
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        report(args.out)
        return
    args.deadline, args.max_tokens = time.monotonic() + args.time_limit, OUTPUT_TOKENS
    args.workloads = args.workloads.split(",")
    args.rates = parse_rates(args.rates, args.workloads)
    from benchmarks.common.serving_systems import SYSTEMS

    empty = []
    for system in args.systems.split(","):
        assert system in SYSTEMS, f"{system}: one of {SYSTEMS}"
        if measure(system, args, args.out) == 0:
            empty.append(system)
    if empty:  # a run that timed nothing must not pass for one that did
        sys.exit(f"measured no rate for {', '.join(empty)}: the time limit ran out first (raise --time-limit)")


if __name__ == "__main__":
    main()
