"""GPU kernel time by kind (matmul, attention, norm, elementwise, copy) over one call, from torch's
profiler: where each system's time goes, so a throughput gap between systems names the kernels behind it."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch

KINDS = ("matmul", "attention", "norm", "elementwise", "copy", "other")
"""Kinds in the order tables show them."""

_RULES = (
    # FlashAttention-3 is a CUTLASS kernel: attention is matched before matmul's "cutlass"
    ("attention", ("flash", "fmha", "_varlen_forward", "sdpa", "softmax")),
    ("matmul", ("nvjet", "gemm", "gemv", "cutlass", "xmma", "cublas", "splitk")),
    ("norm", ("norm",)),
    ("copy", ("memcpy", "memset", "copy", "catarray", "fill")),
    # aten's and vLLM's pointwise kernels (GELU, adds, rotary); inductor's are sorted out before the rules
    ("elementwise", ("elementwise", "rotary", "gelu", "act_and_mul", "reduce")),
)


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel, from its name. Inductor names a fused kernel after the ops it fuses
    (`triton_poi_fused_..._exact_attention_...` is a rotary embedding beside our attention op), so
    its fused kernels count as elementwise, not as the ops in their names."""
    lower = name.lower()
    if lower.startswith("triton_tem_"):  # inductor's templates: matmuls, or flex attention
        return "attention" if "attention" in lower else "matmul"
    if lower.startswith("triton_"):
        # a norm inductor decomposed (RMSNorm: mean of squares, rsqrt) fuses under its parts' names
        return "norm" if "norm" in lower or ("rsqrt" in lower and "mean" in lower) else "elementwise"
    for kind, keys in _RULES:
        if any(key in lower for key in keys):
            return kind
    return "other"


def kernel_time(fn: Callable[[], object], device: torch.device, top: int = 12) -> dict:
    """Profile one call of `fn` (CUDA kernels, CUDA graph replays' included): `summarise` of its
    kernels and its wall ms."""
    if device.type != "cuda":
        raise ValueError("kernel time needs a CUDA device")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [(event.name, event.device_time_total / 1e3) for event in prof.events() if event.device_type == cuda]
    return summarise(kernels, wall_ms, top)


def kernel_times(
    passes: dict[str, Callable[[], object]],
    device: torch.device,
    deadline: float,
    measure: Callable[[Callable[[], object], torch.device], dict] | None = None,
) -> dict[str, dict]:
    """`kernel_time` (or `measure`) of each system's pass in turn, none begun after `deadline`
    (`time.monotonic()`): the systems profiled before the limit keep their rows, the rest have none."""
    measure = measure or kernel_time
    kernels = {}
    for name, fn in passes.items():
        if time.monotonic() > deadline:
            print(f"kernel time: stopped before {name} (the time limit)", flush=True)
            break
        kernels[name] = measure(fn, device)
        print(f"{name}: kernel ms by kind {kernels[name]['by_kind_ms']}", flush=True)
    return kernels


def summarise(kernels: Iterable[tuple[str, float]], wall_ms: float, top: int = 12) -> dict:
    """The `(name, ms)` kernels of one call: the wall ms, the kernels' summed ms (busy, where kernels do
    not overlap), their count, ms per kind and the `top` kernels by ms as (name, ms, launches): the same
    kernel slower at the same launches did the same work more slowly (a clock to look at)."""
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    count = 0
    for name, ms in kernels:
        by_kind[kernel_kind(name)] += ms
        by_name[name[:160]][0] += ms
        by_name[name[:160]][1] += 1
        count += 1
    if not count:  # CUPTI gave no kernel records: zeros would read as a measurement
        raise RuntimeError("the profiler recorded no CUDA kernels (is CUPTI available?)")
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {
        "wall_ms": wall_ms,
        "kernel_ms": sum(by_kind.values()),
        "kernels": count,
        "by_kind_ms": {kind: by_kind.get(kind, 0.0) for kind in KINDS},
        "top": [[name, ms, launches] for name, (ms, launches) in ranked],
    }


def kernel_table(systems: dict[str, dict]) -> str:
    """Markdown: ms per kind for each system that has a `kernel_time` record, and its mean SM clock, power
    and power-capped share over its throughput passes where sampled (`clocks`)."""
    lines = [
        "| system | wall ms | kernel ms | " + " | ".join(KINDS) + " | kernels | SM MHz | W | power-capped |",
        "|---|" + "---|" * (len(KINDS) + 6),
    ]
    for name, system in systems.items():
        record = system.get("kernel_time")
        if not record:
            continue
        kinds = " | ".join(f"{record['by_kind_ms'][kind]:.1f}" for kind in KINDS)
        clocks = system.get("clocks") or {}
        capped = "" if clocks.get("power_capped") is None else f"{clocks['power_capped']:.0%}"
        lines.append(
            f"| {name} | {record['wall_ms']:.1f} | {record['kernel_ms']:.1f} | {kinds} | {record['kernels']} "
            f"| {clocks.get('sm_mhz', '')} | {clocks.get('power_w', '')} | {capped} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""
