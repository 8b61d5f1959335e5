"""Varlen attention for packed vision sequences, registered with transformers.

transformers' vision towers take the varlen branch (one kernel over all segments, driven by
`cu_seqlens` and `max_seqlen`) only when `config._attn_implementation` contains "flash".
We register our own function under such a name:

- CUDA: a varlen kernel over all segments, driven by `cu_seqlens` in a static int32 buffer,
  no host sync, capturable in a CUDA graph. Three kernels (`set_backend`):
  - cuDNN's, through NVIDIA's own Python frontend (`nvidia-cudnn-frontend`, the `cudnn`
    extra), for layouts whose `max_seqlen` is >= `CUDNN_MIN_SEQLEN`: it caches its built graph
    and derives the ragged offsets on the device, so it captures (torch 2.11's own cuDNN
    varlen path rebuilds the graph on every call, 50-70 ms, and breaks capture). On an H100
    it runs the mixed pack's padded layout 1.55x faster than FlashAttention-2 at Qwen3-VL's
    16 x 72 heads and 1.64x at Qwen2.5-VL's 16 x 80 (`benchmarks/results/cudnn_probe.json`);
  - FlashAttention-2's (`aten._flash_attention_forward`): below that length (many short
    segments: Qwen2.5-VL's 64-patch windows, where cuDNN is 1.8x slower), and everywhere
    when the frontend is not installed or the GPU is older than Hopper;
  - ours, in Triton (`models/triton_attention.py`, backend "triton", the default on Hopper or
    newer): a tile as wide as the head (80 columns for Qwen3-VL's 72, not 128), for every varlen
    layout, and for long exact segments at Qwen3-VL's head dim. On an H100 it takes 10-22% less
    time than cuDNN's varlen kernel on the padded packs and 6-10% on mixed ones, 24% less than
    FlashAttention-2 on Qwen2.5-VL's windows, and 5% less than dense cuDNN on one 1792x1792
    image at 16 x 72 (`benchmarks/results/triton_probe.json`). End to end, same host
    (`encoder_bench_qwen3_{triton,cudnn}_session11.md`): Qwen3-VL-8B's 1792x1792 78.2 against
    80.1 ms, mixed pack 21.2 against 21.8.
  Every segment, padding included, must be <= `max_seqlen` or the result is silently wrong;
  callers guarantee it (see `models/layout.py`).
- CUDA, exact layouts (unpadded: eager, the runner's compiled exact route, or a recurring
  pack's own graph; from the `exact_segments` hint): consecutive segments of equal length are
  dense `[count, heads, length, dim]` batches, each run by SDPA with cuDNN first (under
  backend "triton", segments longer than `TRITON_OVER_DENSE_SEQLEN` at a head dim not a
  multiple of 16 take the Triton kernel instead, and outside a CUDA graph shorter ones do too:
  `TRITON_OUTSIDE_GRAPHS`). On an H100
  (torch 2.11, cuDNN 9.19, Qwen3-VL's 16 x 72 heads) cuDNN runs one 12544-patch image at 388
  TFLOP/s where the FlashAttention-2 varlen kernel runs 238 (`benchmarks/results/qwen3_probe.json`)
  and cuDNN's varlen kernel 357 (`cudnn_probe.json`). Where the cuDNN varlen kernel is in use,
  a layout of several runs takes it (one call: 0.219 ms for the mixed pack, against 0.268 ms
  as three dense batches); with FlashAttention-2 it is the dense batches. The segment lengths
  come from the host (`exact_segments(...)`, set by the caller around the forward, like
  vLLM's forward context) and are read inside an opaque custom op, so torch.compile sees no
  lengths: one compile serves equal and unequal packs alike, with no guard on any length.
  Without lengths set, or with lengths that do not match the rows, it is the varlen kernel.
- CPU: scaled dot-product attention per segment, exact in float32. It reads the segment
  lengths on the host, which is free on CPU (there are no CUDA graphs to break). Exact layouts
  take the same grouped op as on CUDA (SDPA's CPU kernels), so CI covers its grouping.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "flash_varlen_encoder"
EXACT_SEGMENTS = "exact_segments"
"""Keyword (passed through the tower to attention) carrying an `ExactSegments` hint; set only by
unpadded exact-layout forwards (eager, the runner's compiled exact route, or a recurring pack's
own graph of its exact layout), never a padded budget graph."""
MAX_GROUPS = 8
"""At most this many runs of equal segments are attended to as dense batches; a pack of more
runs (sizes interleaved) keeps the one varlen kernel: outside a CUDA graph each run is a launch."""


@dataclass(frozen=True, eq=False)
class ExactSegments:
    """The rows are unpadded segments, laid out by exactly this `cu_seqlens` tensor.

    Attention uses the hint only when called with that very tensor, so layers attending over
    other segments (Qwen2.5-VL's windows) keep the varlen kernel. It carries no length (see
    `exact_segments`): nothing in it specialises a compile."""

    cu_seqlens: torch.Tensor

    def applies(self, cu_seqlens: torch.Tensor) -> bool:
        return cu_seqlens is self.cu_seqlens


@dataclass(frozen=True)
class _Segments:
    """What the attention op needs from the host: the groups, and what they must match."""

    groups: tuple[tuple[int, int], ...]
    count: int
    rows: int


_current: ContextVar[_Segments | None] = ContextVar("exact_segments", default=None)


@contextlib.contextmanager
def exact_segments(lengths: Sequence[int]) -> Iterator[None]:
    """The segment lengths (host ints, in row order) of the exact-layout forward run inside,
    grouped once here for every layer. Read at run time by the attention op, so in a CUDA graph
    they are baked at capture."""
    lengths = [int(n) for n in lengths]
    token = _current.set(_Segments(tuple(segment_groups(lengths)), len(lengths), sum(lengths)))
    try:
        yield
    finally:
        _current.reset(token)


def segment_groups(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Runs of consecutive equal lengths as `(count, length)`, in order; empty segments dropped."""
    groups: list[tuple[int, int]] = []
    for length in lengths:
        if length <= 0:
            continue
        if groups and groups[-1][1] == length:
            groups[-1] = (groups[-1][0] + 1, length)
        else:
            groups.append((1, length))
    return groups


def _groups_for(rows: int, segments: int) -> tuple[tuple[int, int], ...] | None:
    """The current groups when they describe these rows and this many segments and are few
    enough; else None (the varlen kernel)."""
    current = _current.get()
    if current is None or current.count != segments or current.rows != rows:
        return None
    return current.groups if 0 < len(current.groups) <= MAX_GROUPS else None


exact_hint_hits = 0
"""Attention calls that found their `ExactSegments` hint applicable (the grouped op, on CUDA and
CPU alike). Lets CPU tests check the hint reaches the right layers."""
BACKENDS = ("auto", "cudnn", "flash", "triton")
DEFAULT_BACKEND = "auto"
CUDNN_MIN_SEQLEN = 512
"""Layouts with a `max_seqlen` at least this take cuDNN's varlen kernel (backend "cudnn"); shorter
ones FlashAttention-2's. `cudnn_probe.json` (H100, in CUDA graphs, cuDNN vs FlashAttention-2):
32 x 256-patch images 0.074 vs 0.069 ms, 64-patch windows 0.064 vs 0.036; from 784-patch
segments up cuDNN wins (8 x 784 padded 0.135 vs 0.163, the mixed pack 0.300 vs 0.466)."""
TRITON_OVER_DENSE_SEQLEN = 4096
"""Under backend "triton", exact layouts whose longest segment is above this, at a head dim that is
not a multiple of 16, take the Triton kernel (which loads through TMA there) instead of dense
cuDNN. H100 (`triton_probe.json`): one 12544-patch segment at Qwen3-VL's 16 x 72 in 1.809 ms
against 1.901 (1.746 against 1.873 on another host); 8 x 784 at 16 x 72 stays dense cuDNN (0.103
against 0.107), and so does Qwen2.5-VL's 16 x 80 (one 16384-patch segment: 3.063 against 3.241).
Measured at 72 and 80 only."""
_use_cudnn: bool | None = None
"""Whether the cuDNN varlen kernel serves; None until `set_backend` or the first `register()`
(an encoder's construction) resolves the default."""
_use_triton = False
"""Whether our Triton kernel (`models/triton_attention.py`) serves every varlen layout."""


def triton_available(device: torch.device | None = None) -> bool:
    """Whether the Triton kernel can serve: CUDA, Triton imports, and an Ampere or newer GPU."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def cudnn_frontend_available(device: torch.device | None = None) -> bool:
    """Whether cuDNN's varlen kernel can serve: the frontend imports and the GPU is Hopper or
    newer (where it was measured against FlashAttention-2)."""
    if not torch.cuda.is_available():
        return False
    try:
        import cudnn  # noqa: F401  (nvidia-cudnn-frontend)
    except Exception:  # noqa: BLE001 - not installed, or its library does not load: FlashAttention-2 serves
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def set_backend(name: str) -> str:
    """CUDA varlen kernel: "flash" always FlashAttention-2; "cudnn" cuDNN's varlen kernel through
    `nvidia-cudnn-frontend` for layouts of `max_seqlen >= CUDNN_MIN_SEQLEN` (FlashAttention-2
    below), an error if it cannot serve; "triton" our Triton kernel for every varlen layout, an
    error if it cannot serve; "auto" (default) is "triton" on a Hopper or newer GPU with Triton
    (where it was measured), else "cudnn" where it can serve, else "flash". Exact layouts of equal
    segments run dense cuDNN SDPA under every backend (under "triton": in CUDA graphs only, and not
    long ones at a head dim not a multiple of 16, `TRITON_OVER_DENSE_SEQLEN`,
    `TRITON_OUTSIDE_GRAPHS`). Returns the backend in effect."""
    global _use_cudnn, _use_triton
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {BACKENDS}")
    if name == "auto" and triton_available() and torch.cuda.get_device_capability()[0] >= 9:
        name = "triton"
    if name == "triton":
        if not triton_available():
            raise ValueError("attention backend 'triton' needs a CUDA GPU (Ampere or newer) and triton")
        _use_cudnn, _use_triton = False, True
        return "triton"
    _use_triton = False
    available = name != "flash" and cudnn_frontend_available()
    if name == "cudnn" and not available:
        raise ValueError(
            "attention backend 'cudnn' needs a Hopper or newer GPU and nvidia-cudnn-frontend "
            "(pip install '.[cudnn]'); use 'auto' to fall back to FlashAttention-2"
        )
    _use_cudnn = available
    return "cudnn" if available else "flash"


def _takes_cudnn(max_seqlen: int) -> bool:
    return bool(_use_cudnn) and max_seqlen >= CUDNN_MIN_SEQLEN


def _flash_varlen(q, k, v, cu_seqlens, max_seqlen: int, scale: float | None) -> torch.Tensor:
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, False, scale=scale
    )
    return out[0]


def _cudnn_varlen(q, k, v, cu_seqlens, max_seqlen: int, scale: float) -> torch.Tensor:
    """cuDNN's varlen kernel: the frontend builds its graph once per (segment slots,
    max_seqlen, strides) and then only launches (the runner's warm-up builds it outside capture).
    Zero-length trailing slots are allowed; every row must be in a segment."""
    import cudnn

    return cudnn.sdpa_torch(
        q, k, v, scale=scale, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
    )  # fmt: skip


@torch.library.custom_op("vlm_encoder::cudnn_varlen_attention", mutates_args=())
def cudnn_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    """cuDNN's varlen kernel as one opaque op: torch.compile does not trace into the frontend's
    Python (its graph cache, its offset tensors), which runs at call time (at capture, in a graph)."""
    return _cudnn_varlen(q, k, v, cu_seqlens, max_seqlen, scale)


@cudnn_varlen_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q)


@torch.library.custom_op("vlm_encoder::triton_varlen_attention", mutates_args=())
def triton_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    """Our Triton kernel as one opaque op (compiled forwards call it as they call cuDNN's).
    Rows outside every segment are left uninitialised (not zeroed: a memset per call); as for
    cuDNN's, the runner's layouts put every row in a segment (`models/layout.py`)."""
    from .triton_attention import aligned, varlen_attention

    return varlen_attention(*(aligned(t) for t in (q, k, v)), cu_seqlens, max_seqlen, scale)


@triton_varlen_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q)


def _varlen_cuda(q, k, v, cu_seqlens, max_seqlen: int, scale: float | None) -> torch.Tensor:
    """The varlen kernel for this layout. `max_seqlen` is a plain int here (the caller's `int()`
    specialises it, as each graph's layout does anyway), so the choice adds no recompile; below
    the threshold the traced FlashAttention-2 call is exactly what it was without cuDNN."""
    if _use_triton and q.shape[-1] % 8 == 0:  # 16-byte rows (every head dim served so far)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return triton_varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)
    if not _takes_cudnn(max_seqlen):
        return _flash_varlen(q, k, v, cu_seqlens, max_seqlen, scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return cudnn_varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)


TRITON_OUTSIDE_GRAPHS = True
"""Under backend "triton", exact layouts of short segments (<= `TRITON_OVER_DENSE_SEQLEN`) run
outside a CUDA graph (the runner's compiled exact route, eager) take the Triton kernel, not dense
cuDNN: there the host pays every launch, and the kernel's op costs it less than SDPA's cuDNN call
(71-85 against 92-96 us at 8 x 784 on three H100 hosts, 133 against 174 on a fourth,
`launch_probe*.json`), with no cuDNN graph to build for a new
shape (~60 ms each, `cold_probe.json`). In a graph (`for_graph`, or while capturing) dense cuDNN
keeps them: there only GPU time counts."""
_in_graph: ContextVar[bool] = ContextVar("attention_for_graph", default=False)


@contextlib.contextmanager
def for_graph() -> Iterator[None]:
    """Attention inside picks its kernels as for a CUDA graph (by GPU time alone): wrap a graph's
    warm-up run with its capture, so the warm-up builds what the capture will launch."""
    token = _in_graph.set(True)
    try:
        yield
    finally:
        _in_graph.reset(token)


def _launch_bound() -> bool:
    """Whether the host pays this call's launch every time it runs (not in a graph)."""
    return TRITON_OUTSIDE_GRAPHS and not _in_graph.get() and not torch.cuda.is_current_stream_capturing()


TRITON_GRAPH_BUCKETS = (1024, 4096)
"""max_seqlen buckets of padded graphs under backend "triton" (below each budget's own rows). The
Triton kernel's grid is (query blocks of max_seqlen, heads, segment slots), but its programs past
a segment's end return at once, and on an H100 a graph's layout with one bucket per 4x costs it
what the doubling buckets did (`benchmarks/results/grid_probe.json`: 8 x 448x448 in the 1024
bucket 0.1085 against 0.1096 ms, 32 x 224x224 in 1024 instead of 256 0.0550 against 0.0538,
Qwen2.5-VL's windows 0.94-1.02x). So a bucket is kept only where it changes what runs or what the
runner assumes: 4096 is where keys and values switch to TMA loads (`TMA_MIN_SEQLEN`: slower on
shorter segments), and 1024 keeps the startup timings of packs of small images (up to 1024
patches: 448x448 for Qwen2.5-VL, 512x512 for Qwen3-VL) on segments like theirs (a graph is
timed on segments as long as its bucket allows, and the runner prices packs by those timings).
Three graphs a budget at most is what lets the ladder be fine (`GraphConfig.fine_budget_steps`)."""


def graph_seqlen_buckets() -> tuple[int, ...] | None:
    """The max_seqlen buckets of padded graphs under backend "triton" (`TRITON_GRAPH_BUCKETS`);
    None under the others (cuDNN's and FlashAttention-2's varlen kernels, not measured with few
    buckets): the runner doubles buckets from `min_seqlen_bucket` there, as it always did."""
    return TRITON_GRAPH_BUCKETS if _use_triton else None


def exact_in_one_call() -> bool:
    """Whether an exact layout of unequal segments takes one attention launch per layer (the
    Triton kernel over all its segments), not one dense call per run of equal segments."""
    return _use_triton


def _dense(q, k, v, length: int, scale: float) -> torch.Tensor:
    """`[count * length, heads, dim]` rows as one dense `[count, heads, length, dim]` batch
    (strided views, no copy in). CUDA: cuDNN first, which allocates its output in q's layout, so
    the result is a view too. CPU: SDPA's own choice, exact in float32.

    Host cost (CUDA): ~130-320 us a call on the H100 hosts for ~100 us of kernel
    (`benchmarks/results/launch_probe.json`); outside a CUDA graph that is what keeps the GPU
    fed. Calling cuDNN's op directly saved ~40% of it, but was reverted: see the results README."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch = [t.unflatten(0, (t.shape[0] // length, length)).transpose(1, 2) for t in (q, k, v)]
    if q.is_cuda:
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        with sdpa_kernel(order, set_priority=True):
            out = F.scaled_dot_product_attention(*batch, scale=scale)
    else:
        out = F.scaled_dot_product_attention(*batch, scale=scale)
    return out.transpose(1, 2).flatten(0, 1)


@torch.library.custom_op("vlm_encoder::exact_attention", mutates_args=())
def exact_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    """Attention over an exact layout's segments: each run of equal segments (lengths from
    `exact_segments`) as one dense batch (cuDNN on CUDA); where no lengths match, the varlen
    kernel (CUDA) or per-segment SDPA (CPU). Opaque to torch.compile: the lengths are read
    here, at run time (at capture, in a CUDA graph), never traced."""
    groups = _groups_for(q.shape[0], cu_seqlens.shape[0] - 1)
    if groups is not None and q.is_cuda:
        several = len(groups) > 1 and (_use_triton or _takes_cudnn(max_seqlen))
        long = max_seqlen > TRITON_OVER_DENSE_SEQLEN
        narrow = q.shape[-1] % 16 != 0
        if several or (_use_triton and (long and narrow or not long and _launch_bound())):
            # One varlen call (cuDNN's, Triton's) beats a dense call per run; Triton's kernel
            # beats dense cuDNN on long segments at a narrow head; and outside a CUDA graph its
            # launch costs the host a fraction of SDPA's.
            groups = None
    if groups is None:
        if not q.is_cuda:
            return _segmented_sdpa(q, k, v, cu_seqlens, scale)
        return _varlen_cuda(q, k, v, cu_seqlens, max_seqlen, scale)
    outs, start = [], 0
    for count, length in groups:
        end = start + count * length
        outs.append(_dense(q[start:end], k[start:end], v[start:end], length, scale))
        start = end
    # A fresh tensor either way: a custom op's output may not alias its inputs.
    return outs[0].contiguous() if len(outs) == 1 else torch.cat(outs)


@exact_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q)


def _segmented_sdpa(q, k, v, cu_seqlens, scale: float | None) -> torch.Tensor:
    """Per-segment SDPA over `[tokens, heads, dim]` inputs; rows outside every segment are 0."""
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        seg = [t[start:end].transpose(0, 1) for t in (q, k, v)]
        out[start:end] = F.scaled_dot_product_attention(*seg, scale=scale).transpose(0, 1)
    return out


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: `[1, heads, tokens, dim]` in, `[1, tokens, heads, dim]` out."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(f"{ATTN_IMPLEMENTATION} needs cu_seqlens and an integer max_seqlen")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    exact = kwargs.get(EXACT_SEGMENTS)
    use_exact = exact is not None and exact.applies(cu_seq_lens_q)
    if use_exact and not torch.compiler.is_compiling():
        # Not counted under torch.compile: dynamo guards on a global int it reads, so each
        # increment would invalidate the compiled forward and recompile it on the next call.
        global exact_hint_hits
        exact_hint_hits += 1
    if use_exact:
        scale = q.shape[-1] ** -0.5 if scaling is None else scaling
        out = exact_attention(q, k, v, cu_seq_lens_q, int(max_length_q), scale)
    elif q.is_cuda:
        out = _varlen_cuda(q, k, v, cu_seq_lens_q, int(max_length_q), scaling)
    else:
        out = _segmented_sdpa(q, k, v, cu_seq_lens_q, scaling)
    return out.unsqueeze(0), None


def register() -> str:
    """Register the function (idempotent) and return the name to put in `_attn_implementation`.
    Resolves the default backend if none was set."""
    if _use_cudnn is None:
        set_backend(DEFAULT_BACKEND)
    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention_forward)
    return ATTN_IMPLEMENTATION
