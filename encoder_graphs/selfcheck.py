"""Synthetic packs, errors and timings for the warm-up's checks (and for benchmarks)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from models.protocol import EncoderOutput, ItemSpec, VisionEncoder


def synthetic_specs(
    encoder: VisionEncoder, token_budget: int, max_seqlen: int, max_items: int, frame: int | None = None
) -> list[ItemSpec]:
    """The encoder's sample images, frames as long as `frame` (default: `max_seqlen`) allows,
    filling up to the budget."""
    rows = token_budget * encoder.merge_unit
    item = encoder.synthetic_item(min(max_seqlen, frame or max_seqlen, rows))
    count = max(1, min(max_items, rows // item.input_patches))
    specs = [item] * count
    left = rows - count * item.input_patches
    if count < max_items and left >= encoder.merge_unit:
        rest = encoder.synthetic_item(left)
        if rest.input_patches <= left:
            specs.append(rest)
    return specs


def sample_frame(buckets: Sequence[int], max_seqlen: int) -> int:
    """The frame length that times a graph of bucket `max_seqlen` among a budget's `buckets`: the
    bucket itself, except in the budget's last bucket (its rows): at most twice the bucket below.
    A pack lands there for one frame just past the bucket below (a 1920x1080 photo: 8160 rows in
    a 32768-row budget); priced on one frame of all the rows, such packs looked several times
    dearer than they are and the planner sent them to slower routes."""
    below = [b for b in buckets if b < max_seqlen]
    if not below or max_seqlen < max(buckets):
        return max_seqlen
    return min(max_seqlen, 2 * max(below))


def synthetic_pixels(specs: list[ItemSpec], patch_dim: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Normalized-pixel-like values (mean 0, std 1) for the specs, drawn on `device` (seeded per
    device type), so that a large sample pack costs the host nothing."""
    generator = torch.Generator(device=device).manual_seed(seed)
    rows = sum(s.input_patches for s in specs)
    return torch.randn(rows, patch_dim, generator=generator, device=device)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| in float32 (reads the result: waits for the device).
    Computed on the GPU when either is there: a pack's outputs copied to the host checked on the
    host cost hundreds of ms of CPU for a large pack."""
    device = actual.device if actual.device.type != "cpu" else expected.device
    actual, expected = actual.to(device), expected.to(device).float()
    scale = expected.abs().max().clamp_min(1e-12)
    return ((actual.float() - expected).abs().max() / scale).item()


def outputs_error(outputs: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> float:
    """The largest relative error over the expected tensors (NaN or inf when one is not finite)."""
    return max(relative_error(outputs[name], want) for name, want in expected.items())


def pack_error(tokens: torch.Tensor, deepstack: torch.Tensor | None, eager: EncoderOutput) -> float:
    """Relative error of a pack's used output rows against the eager forward of the same items."""
    error = relative_error(tokens, eager.tokens[: tokens.shape[0]])
    if eager.deepstack is not None and deepstack is not None:
        error = max(error, relative_error(deepstack, eager.deepstack[:, : tokens.shape[0]]))
    return error


def interleaved_ms(
    paths: dict[str, Callable[[], object]], device: torch.device, repeats: int = 3, warmup: int = 1
) -> dict[str, float]:
    """Median wall ms of each path, synchronized, timed in turns so that drift and background work
    hit every path alike; the order flips every round (A, B, C, C, B, A, ...) so no path always
    runs right after the same other one (a GPU that drops its clocks under a long run would
    otherwise tax whichever path comes next)."""
    for _ in range(warmup):
        for fn in paths.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in paths}
    order = list(paths.items())
    for round_ in range(repeats):
        for name, fn in order if round_ % 2 == 0 else order[::-1]:
            samples[name].append(synchronized_ms(fn, device))
    return {name: sorted(values)[len(values) // 2] for name, values in samples.items()}


def back_to_back_ms(fn: Callable[[], object], device: torch.device, repeats: int = 20, warmup: int = 3) -> float:
    """Mean wall ms of `fn` called `repeats` times back to back with one sync at the end: the
    per-call cost of short kernels without a sync in each sample (for kernel probes)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3 / repeats


def captured(
    fn: Callable[[], object],
    warmup: int = 2,
    calls: int = 1,
    mode: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> torch.cuda.CUDAGraph:
    """`fn` called `calls` times in one CUDA graph, after `warmup` calls on a side stream, both in
    `mode()` (e.g. an encoder's `capturing`, so the warm-up picks the kernels the capture will)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with mode():
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    return graph


def graph_replay_ms(fn: Callable[[], object], repeats: int = 20, warmup: int = 2) -> float:
    """`fn` captured in one CUDA graph and replayed back to back: its cost as the runner pays
    it, launch overhead excluded (for kernel probes)."""
    return back_to_back_ms(captured(fn, warmup).replay, torch.device("cuda"), repeats)


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int = 3, warmup: int = 1) -> float:
    """Median wall ms of `fn`, synchronized."""
    return interleaved_ms({"fn": fn}, device, repeats, warmup)["fn"]


class DeviceTimer:
    """Device time from its creation to `stop`, without waiting: CUDA events on the current stream
    (the GPU's span, idle gaps while the host launches included), else `clock` (seconds)."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter):
        self.device, self.clock = device, clock
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record(torch.cuda.current_stream(device))
        else:
            self._began = clock()

    def stop(self) -> DeviceTimer:
        if self.device.type == "cuda":
            self._events[1].record(torch.cuda.current_stream(self.device))
        else:
            self._ms = (self.clock() - self._began) * 1e3
        return self

    def done(self) -> bool:
        """Whether the stop was reached (no wait)."""
        return self.device.type != "cuda" or self._events[1].query()

    def ms(self) -> float:
        """Waits for the stop."""
        if self.device.type != "cuda":
            return self._ms
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1])


def synchronized_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Wall ms of one call of `fn`, the device idle before and done after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def best_ms(fn: Callable[[], object], device: torch.device, repeats: int = 2) -> float:
    """The fastest of `repeats` synchronized runs of an already warm `fn`: the least noisy single
    number for a cost model (noise only ever adds time)."""
    return min(synchronized_ms(fn, device) for _ in range(repeats))
