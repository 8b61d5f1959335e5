"""End to end, as a caller sees it: the service against what a user would deploy instead.

    python benchmarks/e2e_bench.py --config configs/gpu.yaml --out benchmarks/results/e2e_h100

Systems (`--systems`; each saved as `<out>/e2e_<system>.json`, the report built from all there):
- `ours`: `serve run <config>` in a separate process, as a user starts it. Records the seconds to
  the first correct answer and to full speed (every graph live), then loads it closed-loop through
  the handle (from this separate driver process, or `--handle-processes` of them), HTTP
  safetensors and HTTP JSON at each concurrency (a point also records the host's busy cores and
  each GPU's utilisation, from nvidia-smi), one 448x448 image at concurrency 1, and checks that
  handle and HTTP results agree.
  `--restart` starts it once more (the compile cache now filled) and records the same times.
  `--replicas 4 2 1`: one service measured at each count in turn, scaled down while warm.
  `--settle S`: S seconds of unrecorded load first (each graph's first pack is checked against eager).
- `batched`, `plain`: `benchmarks/common/baselines.py` on the same GPU (transformers' tower behind a
  Serve deployment, with and without `@serve.batch`), through HTTP JSON and the handle.
- `encoder`: the encoder alone in this process (the config's runner, fully warmed) on the same
  item stream, packed by the router's packing rule: the ceiling the service is measured against.
The workload: fixed-seed photos of common sizes 224x224 to 1920x1080 (JPEG), 1-3 per request,
and a share of 8-frame videos (given as frames); requests opt out of the service's embedding
cache. A point's throughput counts the requests that complete within its window, after its warm-up.
Prints a table, saves JSON and PNG plots (throughput against concurrency, latency CDF)
with device, versions and command.

`--load-step`: instead, `serve run <config>` (e.g. configs/multi-gpu.yaml, autoscaling) under a
`--schedule` of closed-loop callers, through each of `--interfaces` in turn:

    python benchmarks/e2e_bench.py --config configs/multi-gpu.yaml --load-step \
        --schedule "0:0,30:96,230:96,260:0,560:0" --interfaces handle,safetensors --handle-processes 4 \
        --out benchmarks/results/load_step_h200x2

The callers change linearly between `seconds:callers` points (a time given twice is a step); the
last point's time is the run's length, so end with time at the last load for Serve to scale back.
Per `--window` seconds it records the scheduled callers, vision tokens/s and p50/p99 latency of the
requests completed in it, errors, the encoder replicas by state (`serve.status()`) and each
replica's warm-up stage (the router's `detail()`); saved as `<out>/load_step_<interface>.json`
with a plot of load, throughput, latency and replicas against time (`.png`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# `serve run` starts its cluster with token authentication unless told otherwise; the driver must
# say so before Ray is imported, as the router's "Attach from Python" line does.
os.environ.setdefault("RAY_AUTH_MODE", "token")
sys.path.insert(0, str(ROOT))

from benchmarks.common.clients import ClientPool, handle_call, handle_load, handle_setup, http_setup  # noqa: E402
from benchmarks.common.cpu import Window  # noqa: E402
from benchmarks.common.failover import failover  # noqa: E402
from benchmarks.common.load_step import report_load_steps, run_load_step  # noqa: E402
from benchmarks.common.plots import plot, plot_scaling  # noqa: E402
from benchmarks.common.record import Discard, Record, load_runs  # noqa: E402
from benchmarks.common.report import scaling_table, table  # noqa: E402
from benchmarks.common.schedule import parse_schedule  # noqa: E402
from benchmarks.common.serve_log import SLOW_PROBE, occurrences  # noqa: E402
from benchmarks.common.service import (  # noqa: E402
    compare_handle_and_http,
    counters,
    fixed_replicas,
    rescale,
    start_service,
)
from benchmarks.common.service_counters import counted_between  # noqa: E402
from benchmarks.common.stats import summarize  # noqa: E402
from benchmarks.common.utilisation import GpuSampler  # noqa: E402
from benchmarks.common.workload import decoded_items, http_body, single_images, workload  # noqa: E402


def measure(
    args,
    name: str,
    interfaces: dict,
    requests: list[list],
    concurrencies: list[int],
    rows: dict,
    record: Record,
    snapshot: Callable[[], dict] | None = None,
    pools: dict | None = None,
) -> None:
    """Fill `rows` (part of `record`, saved after each point). `interfaces`: name -> ("http", url,
    format), ("handle", call) or ("handles", address, app, processes). Each point records the cores
    the Serve processes and the benchmark's own callers used during it (is the router or the
    caller the limit?) and, with `snapshot`, the service's own counters after it and what they
    grew by during it."""
    own = pools is None
    pools = {} if own else pools
    try:
        for interface, how in interfaces.items():
            _measure_interface(args, name, interface, how, requests, concurrencies, rows, record, snapshot, pools)
    finally:
        if own:
            for pool in pools.values():
                pool.close()


def _measure_interface(args, name, interface, how, requests, concurrencies, rows, record, snapshot, pools) -> None:
    key = (interface, how[:3], id(requests))  # client processes per interface and workload (kept alive by the pool)
    if how[0] in ("handles", "http") and key not in pools:
        if how[0] == "handles":
            pools[key] = ClientPool(handle_setup, (how[1], how[2], requests), how[3], requests, args.client_niceness)
        else:
            bodies = [http_body(r, how[2], name == "ours") for r in requests]
            processes = min(args.http_processes, max(concurrencies))
            pools[key] = ClientPool(http_setup, (how[1], bodies, how[2]), processes, requests, args.client_niceness)
    for concurrency in concurrencies:
        seconds = args.seconds + args.warmup
        window, clients_cpu = Window(), 0.0  # callers in other processes report their own CPU
        before = snapshot() if snapshot is not None else None
        gpus = GpuSampler()  # over the point's warm-up and window
        if how[0] in ("handles", "http"):
            samples, clients_cpu = pools[key].load(concurrency, seconds, window)
        else:
            window.open()
            samples = asyncio.run(handle_load(how[1], requests, concurrency, seconds))
            window.close()
        row = rows.setdefault(interface, {})[str(concurrency)] = summarize(samples, args.warmup, args.seconds)
        row["gpus"] = gpus.stop()  # each GPU's mean utilisation: how much of the time its kernels ran
        row["cores_used"] = {k: round(v / window.elapsed, 2) for k, v in window.serve_used.items()}
        row["host_busy_cores"] = round(window.host_used / window.elapsed, 2)  # every process, of `cpus`
        callers = window.own_used + clients_cpu
        row["cores_used"]["benchmark_callers"] = round(callers / window.elapsed, 2)
        packing = ""
        if snapshot is not None:
            after = snapshot()
            for _ in range(8 if "router_pid" in before else 0):  # the proxy picks the router that answers
                if after.get("router_pid") == before.get("router_pid"):
                    break
                after = snapshot()
            row["service_after"], row["service_window"] = after, counted_between(before, after)
            packing = f"  window {row['service_window']}"
        print(
            f"{name:8s} {interface:12s} c={concurrency:3d} {row['tokens_per_s']:10.0f} tok/s  "
            f"p50 {row['p50_ms']:8.1f} ms  p99 {row['p99_ms']:8.1f} ms  errors {row['errors']}  "
            f"cores {row['cores_used']} host {row['host_busy_cores']} gpus {row['gpus'] or '-'}  "
            f"stages {row['server_timing_p50_ms'] or '-'}{packing}",
            flush=True,
        )
        record.save()


# ---- the service ----


def run_ours(args, requests: list[list]) -> list[Path]:
    """Start the service once and measure it at each of `--replicas` in turn (largest first:
    scaling down keeps replicas that are warm), each count's results in `<out>/replicas_<n>/`
    where there are several; returns the folders written."""
    import ray
    from ray import serve

    counts = args.replicas or [None]
    folders = [args.out / f"replicas_{n}" if len(counts) > 1 else args.out for n in counts]
    configs = [fixed_replicas(args.config, n, out) if n else args.config for n, out in zip(counts, folders)]
    # a replica is killed at the last count that leaves a survivor (before scaling down drops the replacement)
    kill_at = max((i for i, n in enumerate(counts) if (n or 2) >= 2), default=None) if args.failover else None
    service, startup = start_service(args, configs[0], folders[0], "cold", counts[0])
    pools: dict = {}  # client processes, kept across points and replica counts
    try:
        ray.init(address=service.address, log_to_driver=False)
        handle = serve.get_app_handle(startup["app"])
        call = handle_call(handle)
        url = startup["url"]
        drivers = ("handles", service.address, startup["app"], args.handle_processes)
        interfaces = {
            "handle": ("handle", call) if args.handle_processes == 1 else drivers,
            "safetensors": ("http", url + "/v1/encode", "safetensors"),
            "json": ("http", url + "/v1/encode", "base64"),
        }
        if args.settle:  # every graph's first pack is checked against eager: not the steady state
            print(f"settle: {args.settle} s of load, not recorded", flush=True)
            first = args.interfaces.split(",")[0]
            unrecorded = argparse.Namespace(**{**vars(args), "seconds": args.settle, "warmup": 0.0})
            measure(
                unrecorded,
                "ours",
                {first: interfaces[first]},
                requests,
                [max(callers(args, counts[0]))],
                {},
                Discard(),
                None,
                pools,
            )
        for index, (replicas, out, config) in enumerate(zip(counts, folders, configs)):
            record = Record(out, "ours", config)
            if index == 0:
                record["startup"] = {"cold": startup}
            else:
                record["rescaled"] = rescale(config, service, startup, replicas, args.startup_timeout)
            record.save()
            if args.single:
                single = {"handle": ("handle", call), "safetensors": interfaces["safetensors"]}
                record["single_448"] = {}
                measure(
                    args, "ours", single, single_images(args.single), [1], record["single_448"], record, pools=pools
                )
            chosen = {k: interfaces[k] for k in args.interfaces.split(",")}
            record["mixed"] = {}

            def snapshot() -> dict:
                probes = occurrences(service.log.read_text(errors="replace"), SLOW_PROBE)
                return {**counters(handle), "slow_queue_probes": probes}

            levels = callers(args, replicas)
            measure(args, "ours", chosen, requests, levels, record["mixed"], record, snapshot, pools)
            record["handle_vs_http_max_rel_error"] = compare_handle_and_http(handle, url, requests[:16])
            if index == kill_at:
                record["failover"] = failover(
                    args, call, requests, service, startup["app"], lambda n: max(callers(args, n))
                )
                record.save()
            detail = handle.detail.remote().result(timeout_s=30)["encoder"]
            record["router"], record["replica"] = detail["router"], detail["replica"]
            record["complete"] = not args.restart
            record.save()
    finally:
        for pool in pools.values():
            pool.close()
        ray.shutdown()
        service.stop()
    if args.restart:
        service, record["startup"]["warm_cache"] = start_service(args, configs[0], args.out, "warm_cache", counts[0])
        service.stop()
        record["complete"] = True
        record.save()
    return folders


def callers(args, replicas: int | None) -> list[int]:
    """The concurrencies of the mixed load at `replicas` encoder replicas: `--callers-per-replica`
    times the count (the same load per replica at every count), else `--concurrency`."""
    if args.callers_per_replica and replicas:
        return [args.callers_per_replica * replicas]
    return args.concurrency


# ---- baselines and the encoder alone ----


def model_args(args) -> dict:
    return yaml.safe_load(args.config.read_text())["applications"][0]["args"]


def run_baseline(args, name: str, requests: list[list], record: Record) -> None:
    import ray
    from ray import serve

    from benchmarks.common.baselines import BatchedTower, PlainTower
    from deployments.config import AppConfig

    model = AppConfig.model_validate(model_args(args)).model
    deployment = {"batched": BatchedTower, "plain": PlainTower}[name]
    ray.init(log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.baseline_port})
    try:
        gpus = {"num_gpus": 1 if model.device == "cuda" else 0}
        dtype = (
            "bfloat16" if model.dtype == "auto" and model.device == "cuda" else model.dtype.replace("auto", "float32")
        )
        app = deployment.options(ray_actor_options=gpus).bind(model.model_id, dtype, model.device)
        handle = serve.run(app, name=name, route_prefix=f"/{name}")

        async def call(items: list) -> int:
            return sum(int(o["tokens"].shape[0]) for o in await handle.encode.remote(items))

        url = f"http://127.0.0.1:{args.baseline_port}/{name}"
        interfaces = {"handle": ("handle", call), "json": ("http", url, "base64")}
        interfaces = {k: v for k, v in interfaces.items() if k in args.interfaces.split(",")}
        record["mixed"] = {}
        measure(args, name, interfaces, requests, args.concurrency, record["mixed"], record)
    finally:
        serve.shutdown()
        ray.shutdown()


def run_encoder(args, requests: list[list], record: Record) -> None:
    """The config's runner here, fully warmed, on the workload's items packed by the router's rule."""
    import torch

    from deployments.app import deployment_ladder
    from deployments.config import AppConfig
    from deployments.encoder.replica import load_encoder
    from encoder_graphs.packing import PackItem, pack_items
    from encoder_graphs.runner import EncoderRunner

    config = AppConfig.model_validate(model_args(args))
    encoder = load_encoder(config)
    ladder = deployment_ladder(config)
    runner = EncoderRunner(encoder, config.graphs, ladder)
    start = time.perf_counter()
    runner.prepare(progress=lambda m: None)
    runner.warm_up(progress=lambda m: None)
    warm_s = time.perf_counter() - start
    pre, items = encoder.preprocessor, decoded_items(encoder.preprocessor, requests)
    queue = [PackItem(i, spec.modality, spec.output_tokens, spec.grid_thw[0]) for i, (_, spec) in enumerate(items)]
    packs = pack_items(queue, ladder.budgets, ladder.max_items, ladder.max_segments)

    def run_all() -> tuple[int, float]:
        torch.cuda.synchronize() if encoder.device.type == "cuda" else None
        begin, tokens = time.perf_counter(), 0
        for pack in packs:
            chosen = [items[p.key] for p in pack.items]
            values = pre.pixel_values([c[0] for c in chosen], pack.modality, device=encoder.device)
            runner.run(values.to(encoder.dtype), [c[1] for c in chosen], output_device="cpu")
            tokens += pack.tokens
        return tokens, time.perf_counter() - begin

    run_all()  # every pack seen once: what a recurring pack would be on the service after a while
    tokens, seconds = run_all()
    record.update(warm_up_s=round(warm_s, 1), packs=len(packs), tokens=tokens, tokens_per_s=round(tokens / seconds, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs/gpu.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/e2e")
    parser.add_argument("--systems", default="ours,batched,plain,encoder")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window per point (after --warmup)")
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="ours: seconds of load (first interface, highest concurrency) after startup, not recorded: "
        "each graph's first pack on each replica is checked against eager",
    )
    parser.add_argument("--requests", type=int, default=256, help="distinct requests in the workload")
    parser.add_argument("--restart", action="store_true", help="ours: start again with the filled compile cache")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--baseline-port", type=int, default=8011)
    parser.add_argument("--report", action="store_true", help="only rebuild the table and plot from <out>")
    parser.add_argument(
        "--interfaces", default="handle,safetensors,json", help="interfaces of the mixed load (baselines: handle, json)"
    )
    parser.add_argument(
        "--single", type=int, default=256, help="ours: distinct 448x448 images at concurrency 1 (0: skip)"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        nargs="+",
        help="ours: this many encoder replicas, autoscaling off; several (largest first): one service "
        "scaled down to each in turn, results in <out>/replicas_<n>/ and a scaling table in <out>/scaling.md",
    )
    parser.add_argument(
        "--failover", type=float, default=0, help="ours: seconds of handle load with one encoder replica killed"
    )
    parser.add_argument(
        "--handle-processes",
        type=int,
        default=1,
        help="ours: driver processes sharing the mixed handle load (1: all callers in this process)",
    )
    parser.add_argument(
        "--client-niceness",
        type=int,
        default=0,
        choices=range(0, 20),
        metavar="0-19",
        help="raise the client processes' nice value by this much (15: as Ray's workers, e.g. a deployment "
        "calling the service; 0: plain processes, which the scheduler favours over the service's nice-15 workers)",
    )
    parser.add_argument(
        "--http-processes",
        type=int,
        default=8,
        help="client processes sharing each HTTP load (one Python process cannot read a fast service's responses)",
    )
    parser.add_argument(
        "--callers-per-replica",
        type=int,
        default=0,
        help="with --replicas: the mixed load at this many callers per encoder replica (a closed loop "
        "of fixed callers gives more replicas less each), instead of --concurrency",
    )
    parser.add_argument(
        "--load-step",
        action="store_true",
        help="ours under --schedule through each of --interfaces in turn (see above), instead of the systems",
    )
    parser.add_argument(
        "--schedule",
        default="0:0,30:96,230:96,260:0,560:0",
        help="--load-step: seconds:callers points, linear between them, a time given twice a step",
    )
    parser.add_argument("--window", type=float, default=5.0, help="--load-step: seconds per recorded window")
    parser.add_argument(
        "--poll", type=float, default=2.0, help="--load-step: seconds between observations of Serve's replicas"
    )
    args = parser.parse_args()
    if args.load_step:
        if not 1 <= args.window <= 60 or not 0.5 <= args.poll <= args.window:
            parser.error("--window takes 1-60 s, --poll 0.5 s up to --window")
        try:
            schedule = parse_schedule(args.schedule)
        except ValueError as error:
            parser.error(f"--schedule: {error}")
    if args.callers_per_replica and not args.replicas:
        parser.error("--callers-per-replica needs --replicas")
    if args.http_processes < 1 or args.handle_processes < 1:
        parser.error("--http-processes and --handle-processes take 1 or more")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replicas and len(args.replicas) > 1 and not args.report:
        if args.systems != "ours" or args.restart or args.replicas != sorted(args.replicas, reverse=True):
            parser.error("several --replicas: --systems ours only, no --restart, largest count first")
    if args.load_step:
        if args.report:
            report_load_steps(args.out)
        else:
            run_load_step(args, schedule, workload(args.requests))
        return
    folders = [args.out]
    if not args.report:
        requests = workload(args.requests)
        for system in args.systems.split(","):
            if system == "ours":
                folders = run_ours(args, requests)
                continue
            record = Record(args.out, system, args.config)
            if system == "encoder":
                run_encoder(args, requests, record)
            else:
                run_baseline(args, system, requests, record)
            record["complete"] = True
            record.save()
    elif args.replicas and len(args.replicas) > 1:
        folders = [args.out / f"replicas_{n}" for n in args.replicas]
    for folder in folders:
        runs = load_runs(folder)
        plot(runs, folder)
        report = table(runs)
        (folder / "e2e.md").write_text(report + "\n")
        print(report)
    if len(folders) > 1:
        scaling = {int(f.name.removeprefix("replicas_")): load_runs(f).get("ours", {}) for f in folders}
        report = scaling_table(scaling)
        (args.out / "scaling.md").write_text(report + "\n")
        plot_scaling(scaling, args.out)
        print(report)


if __name__ == "__main__":
    main()
