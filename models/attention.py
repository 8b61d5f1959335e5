"""Attention for packed vision sequences: an `AttentionBackend` per encoder, registered with transformers.

transformers' vision towers take their varlen branch (one kernel over all segments, driven by
`cu_seqlens` and `max_seqlen`) only when `config._attn_implementation` contains "flash", so each
backend registers itself under such a name and the encoder that owns it points its tower there.
The kernel choice lives in the backend object, never in module state: two encoders in one
process may run different kernels.

- CUDA, padded layouts: one varlen kernel over every segment, driven by `cu_seqlens` in a static
  int32 buffer, with no host sync, so it captures in a CUDA graph. Kernels: FlashAttention-2,
  cuDNN's through `nvidia-cudnn-frontend` (from `CUDNN_MIN_SEQLEN` up; it caches its built graph,
  which torch's own cuDNN varlen path rebuilds per call), ours in Triton
  (`models/triton_attention.py`: a tile as wide as the head), or FlashAttention-3 on Hopper for
  layouts past small images (the build vLLM ships, `vllm.vllm_flash_attn`: faster than ours on long
  segments), ours below. Every segment, padding included, must be <= `max_seqlen` or the result is
  silently wrong; `models/layout.py` guarantees it.
- Exact layouts (unpadded; the caller names the segment lengths with `exact_segments`): each run
  of equal segments is one dense `[count, heads, length, dim]` batch through SDPA (cuDNN first),
  unless one varlen launch serves better (several runs under cuDNN or Triton, long segments at a
  head dim that is not a multiple of 16 under Triton, any launch-bound call under Triton, any
  layout FlashAttention-3 takes). The lengths are read inside an opaque custom op at run time, so
  torch.compile never specialises on them.
- CPU: SDPA per segment (exact in float32); exact layouts take the same grouped op as on CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .protocol import segment_groups

IMPLEMENTATION_PREFIX = "flash_varlen_encoder"
EXACT_SEGMENTS = "exact_segments"
"""Keyword (passed through the tower to attention) carrying an `ExactSegments` hint; set only by
exact-layout forwards, never a padded budget graph."""
BACKENDS = ("auto", "cudnn", "fa3", "flash", "triton")
DEFAULT_BACKEND = "auto"
KERNELS = ("sdpa", "flash", "cudnn", "triton", "fa3")
"""Resolved kernels: "sdpa" on CPU, the others on CUDA."""
MAX_GROUPS = 8
"""At most this many runs of equal segments become dense batches; more keep one varlen launch."""
CUDNN_MIN_SEQLEN = 512
"""Under "cudnn", layouts whose `max_seqlen` is at least this take cuDNN's varlen kernel, shorter
ones FlashAttention-2's (faster on many short segments such as Qwen2.5-VL's windows)."""
TRITON_OVER_DENSE_SEQLEN = 4096
"""Under "triton", exact segments longer than this at a head dim that is not a multiple of 16 take
the Triton kernel (which loads keys and values by TMA there) instead of dense cuDNN."""
TRITON_GRAPH_BUCKETS = (1024, 4096)
"""`max_seqlen` buckets of padded graphs under "triton" and "fa3", below each budget's own rows. Both
kernels read each segment's length on the device (programs past its end return at once), so a bucket
is kept only where it changes what runs: 4096 is where TMA loads start, 1024 keeps small images'
graphs timed on segments like theirs (and on the Triton kernel under "fa3"). Few buckets per budget
are what allow a fine budget ladder."""
FA3_MIN_SEQLEN = TRITON_GRAPH_BUCKETS[0] + 1
"""Under "fa3", layouts past the small images' bucket take FlashAttention-3, those in it the Triton
kernel: one small image ran slower on FA3 in a graph, whose launch adds a scheduling kernel. The
boundary follows the bucket; it is not tuned between the layouts measured."""
FA3_MAX_HEAD_DIM = 256
"""The widest head FlashAttention-3 is built for; wider ones take the other kernels."""


@dataclass(frozen=True, eq=False)
class ExactSegments:
    """The rows are unpadded segments, laid out by exactly this `cu_seqlens` tensor.

    Attention uses the hint only when called with that very tensor, so layers attending over
    other segments (Qwen2.5-VL's windows) keep the varlen kernel. It carries no length: nothing
    in it specialises a compile."""

    cu_seqlens: torch.Tensor

    def applies(self, cu_seqlens: torch.Tensor) -> bool:
        return cu_seqlens is self.cu_seqlens


@dataclass(frozen=True)
class _Segments:
    """What the grouped op needs from the host: the groups, and what they must match."""

    groups: tuple[tuple[int, int], ...]
    count: int
    rows: int


_current_segments: ContextVar[_Segments | None] = ContextVar("exact_segments", default=None)
"""Per-call context (like vLLM's forward context), not backend state: set around one forward."""
_in_graph: ContextVar[bool] = ContextVar("attention_for_graph", default=False)


@contextlib.contextmanager
def exact_segments(lengths: Sequence[int]) -> Iterator[None]:
    """The segment lengths (host ints, in row order) of the exact-layout forward run inside,
    grouped once here for every layer. Read at run time by the grouped op (in a CUDA graph: at
    capture)."""
    lengths = [int(n) for n in lengths]
    token = _current_segments.set(_Segments(tuple(segment_groups(lengths)), len(lengths), sum(lengths)))
    try:
        yield
    finally:
        _current_segments.reset(token)


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
    return not _in_graph.get() and not torch.cuda.is_current_stream_capturing()


def triton_available(device: torch.device | None = None) -> bool:
    """Whether the Triton kernel can serve: CUDA, Triton imports, and an Ampere or newer GPU."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


@functools.cache
def fa3_varlen_function():
    """FlashAttention-3's varlen function from the build vLLM ships, or None where it does not
    import or cannot run FA3. Importing it runs vLLM's package init, which sets environment
    variables for vLLM's own processes (inductor's compile threads among them): they are put back."""
    saved = dict(os.environ)
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func, is_fa_version_supported
    except Exception:  # noqa: BLE001 - vLLM not installed, or a build without the extension
        return None
    finally:  # only what changed: other threads may read the environment meanwhile
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
    return flash_attn_varlen_func if is_fa_version_supported(3) else None


def fa3_available(device: torch.device | None = None) -> bool:
    """Whether FlashAttention-3 can serve: a Hopper GPU (FA3 is built for sm90 only) and vLLM's build."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return fa3_varlen_function() is not None


def cudnn_frontend_available(device: torch.device | None = None) -> bool:
    """Whether cuDNN's varlen kernel can serve: the frontend imports and the GPU is Hopper or newer."""
    if not torch.cuda.is_available():
        return False
    try:
        import cudnn  # noqa: F401  (nvidia-cudnn-frontend)
    except Exception:  # noqa: BLE001 - not installed, or its library does not load
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _flash_varlen(q, k, v, cu_seqlens, max_seqlen: int, scale: float | None) -> torch.Tensor:
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, False, scale=scale
    )
    return out[0]


@torch.library.custom_op("vlm_encoder::cudnn_varlen_attention", mutates_args=())
def cudnn_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    """cuDNN's varlen kernel as one opaque op: torch.compile does not trace into the frontend's
    Python (its graph cache, built once per layout, then only launched). Zero-length trailing
    slots are allowed; every row must be in a segment."""
    import cudnn

    return cudnn.sdpa_torch(
        q, k, v, scale=scale, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
    )  # fmt: skip


@cudnn_varlen_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q)


@torch.library.custom_op("vlm_encoder::fa3_varlen_attention", mutates_args=())
def fa3_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    """FlashAttention-3's varlen kernel as one opaque op (it captures in a CUDA graph: vLLM replays
    it in its own encoder graphs). Zero-length trailing slots are allowed."""
    from .triton_attention import aligned

    q, k, v = (aligned(t) for t in (q, k, v))
    return fa3_varlen_function()(
        q, k, v, max_seqlen_q=max_seqlen, cu_seqlens_q=cu_seqlens, max_seqlen_k=max_seqlen,
        cu_seqlens_k=cu_seqlens, softmax_scale=scale, causal=False, fa_version=3,
    )  # fmt: skip


@fa3_varlen_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q)


@torch.library.custom_op("vlm_encoder::triton_varlen_attention", mutates_args=())
def triton_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    """Our Triton kernel as one opaque op. Rows outside every segment are left uninitialised;
    the runner's layouts put every row in a segment (`models/layout.py`)."""
    from .triton_attention import aligned, varlen_attention

    return varlen_attention(*(aligned(t) for t in (q, k, v)), cu_seqlens, max_seqlen, scale)


@triton_varlen_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q)


@torch.library.custom_op("vlm_encoder::segmented_sdpa", mutates_args=())
def segmented_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Per-segment SDPA over `[tokens, heads, dim]` inputs (CPU); rows outside every segment are 0.
    One opaque op: it reads the lengths on the host, so compiled code never guards on them."""
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        seg = [t[start:end].transpose(0, 1) for t in (q, k, v)]
        out[start:end] = F.scaled_dot_product_attention(*seg, scale=scale).transpose(0, 1)
    return out


@segmented_sdpa.register_fake
def _(q, k, v, cu_seqlens, scale):
    return torch.empty_like(q)


_registered: dict[str, AttentionBackend] = {}
"""Implementation name -> backend, as transformers' own `AttentionInterface` registry: the grouped
op finds its backend by the name baked into the graph (a custom op takes no Python objects)."""


@dataclass(frozen=True)
class AttentionBackend:
    """The attention kernels one encoder runs; created from a config name by `resolve`."""

    kernel: str
    """"sdpa" (CPU), "flash" (FlashAttention-2), "cudnn" (cuDNN's varlen from `CUDNN_MIN_SEQLEN`,
    FlashAttention-2 below), "triton" (ours, every varlen layout) or "fa3" (FlashAttention-3 from
    `FA3_MIN_SEQLEN`, ours below)."""
    max_groups: int = MAX_GROUPS
    """Most runs of equal segments an exact layout attends to as dense batches."""

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"attention kernel {self.kernel!r} is not one of {KERNELS}")

    @classmethod
    def resolve(cls, name: str = DEFAULT_BACKEND, device: torch.device | str = "cpu") -> AttentionBackend:
        """The backend for a config name on `device`: CPU always runs "sdpa"; on CUDA "auto" is
        "triton" on a Hopper or newer GPU with Triton, else "cudnn" where it can serve, else
        "flash"; "cudnn", "fa3" and "triton" raise where they cannot serve."""
        if name not in BACKENDS:
            raise ValueError(f"attention backend {name!r} is not one of {BACKENDS}")
        device = torch.device(device)
        if device.type != "cuda":
            return cls("sdpa")
        if name == "auto" and triton_available(device) and torch.cuda.get_device_capability(device)[0] >= 9:
            name = "triton"
        if name == "fa3":  # FA3 for long layouts, ours for short ones: both must serve
            if not (fa3_available(device) and triton_available(device)):
                raise ValueError(
                    "attention backend 'fa3' needs a Hopper GPU, vLLM's FlashAttention-3 build "
                    "(README: E/PD with vLLM) and triton; use 'auto' for ours in Triton"
                )
            return cls("fa3")
        if name == "triton":
            if not triton_available(device):
                raise ValueError("attention backend 'triton' needs a CUDA GPU (Ampere or newer) and triton")
            return cls("triton")
        available = name != "flash" and cudnn_frontend_available(device)
        if name == "cudnn" and not available:
            raise ValueError(
                "attention backend 'cudnn' needs a Hopper or newer GPU and nvidia-cudnn-frontend "
                "(pip install '.[cudnn]'); use 'auto' to fall back to FlashAttention-2"
            )
        return cls("cudnn" if available else "flash")

    @property
    def implementation(self) -> str:
        """The name the tower's `config._attn_implementation` takes (contains "flash"); stable
        across processes, so compiled graphs that bake it in stay cacheable."""
        suffix = "" if type(self) is AttentionBackend else f"_{type(self).__name__}"
        return f"{IMPLEMENTATION_PREFIX}_{self.kernel}{suffix}"

    def register(self) -> str:
        """Register this backend with transformers (idempotent) and return its implementation name."""
        _registered[self.implementation] = self
        AttentionInterface.register(self.implementation, self.forward)
        return self.implementation

    # ---- what the graph runner asks (through the encoder) ----

    def graph_seqlen_buckets(self, budget_rows: int) -> tuple[int, ...] | None:
        """Under "triton" and "fa3" (whose scheduler reads each segment's length on the device):
        `TRITON_GRAPH_BUCKETS` below the rows, then the rows; else None (the other kernels' grids
        grow with `max_seqlen`: one bucket per doubling)."""
        if self.kernel not in ("triton", "fa3"):
            return None
        return (*(b for b in TRITON_GRAPH_BUCKETS if b < budget_rows), budget_rows)

    def exact_in_one_call(self, lengths: Sequence[int]) -> bool:
        """Whether an exact layout of these segment lengths takes one attention launch per layer."""
        return len(set(lengths)) <= 1 or self.kernel in ("triton", "fa3")

    # ---- kernel choices (pure) ----

    def varlen_kernel(self, max_seqlen: int, head_dim: int) -> str:
        """The CUDA varlen kernel for a layout: "triton", "fa3", "cudnn" or "flash"."""
        fa3_head = head_dim % 8 == 0 and head_dim <= FA3_MAX_HEAD_DIM
        if self.kernel == "fa3" and fa3_head and max_seqlen >= FA3_MIN_SEQLEN:
            return "fa3"
        if self.kernel in ("triton", "fa3") and head_dim % 8 == 0:  # 16-byte rows
            return "triton"
        if self.kernel == "cudnn" and max_seqlen >= CUDNN_MIN_SEQLEN:
            return "cudnn"
        return "flash"

    def dense_on_cuda(
        self, groups: Sequence[tuple[int, int]], max_seqlen: int, head_dim: int, launch_bound: bool
    ) -> bool:
        """Whether an exact CUDA layout of these runs attends as dense batches (else one varlen
        launch). Layouts FlashAttention-3 takes are one launch; the others go as under "triton"."""
        if self.varlen_kernel(max_seqlen, head_dim) == "fa3":
            return False
        triton = self.kernel in ("triton", "fa3")
        several = len(groups) > 1 and (triton or self.varlen_kernel(max_seqlen, head_dim) == "cudnn")
        long = max_seqlen > TRITON_OVER_DENSE_SEQLEN
        narrow = head_dim % 16 != 0
        return not (several or (triton and (long and narrow or not long and launch_bound)))

    # ---- kernels ----

    def varlen(self, q, k, v, cu_seqlens, max_seqlen: int, scale: float | None) -> torch.Tensor:
        """The CUDA varlen kernel over `[rows, heads, dim]`; `max_seqlen` a plain int (each layout
        specialises it anyway), so the choice adds no recompile."""
        kernel = self.varlen_kernel(max_seqlen, q.shape[-1])
        if kernel == "flash":
            return _flash_varlen(q, k, v, cu_seqlens, max_seqlen, scale)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        op = {"triton": triton_varlen_attention, "fa3": fa3_varlen_attention}.get(kernel, cudnn_varlen_attention)
        return op(q, k, v, cu_seqlens, max_seqlen, scale)

    def dense(self, q, k, v, length: int, scale: float) -> torch.Tensor:
        """`[count * length, heads, dim]` rows as one dense `[count, heads, length, dim]` batch
        (strided views, no copy in). CUDA: cuDNN first; CPU: SDPA's own choice."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        batch = [t.unflatten(0, (t.shape[0] // length, length)).transpose(1, 2) for t in (q, k, v)]
        if q.is_cuda:
            order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
            with sdpa_kernel(order, set_priority=True):
                out = F.scaled_dot_product_attention(*batch, scale=scale)
        else:
            out = F.scaled_dot_product_attention(*batch, scale=scale)
        return out.transpose(1, 2).flatten(0, 1)

    def exact(self, q, k, v, cu_seqlens, max_seqlen: int, scale: float) -> torch.Tensor:
        """Attention over an exact layout: each run of equal segments (from `exact_segments`) as one
        dense batch where that serves; else the varlen kernel (CUDA) or per-segment SDPA (CPU)."""
        groups = self._groups_for(q.shape[0], cu_seqlens.shape[0] - 1)
        if (
            groups is not None
            and q.is_cuda
            and not self.dense_on_cuda(groups, max_seqlen, q.shape[-1], _launch_bound())
        ):
            groups = None
        if groups is None:
            if not q.is_cuda:
                return segmented_sdpa(q, k, v, cu_seqlens, scale)
            return self.varlen(q, k, v, cu_seqlens, max_seqlen, scale)
        outs, start = [], 0
        for count, length in groups:
            end = start + count * length
            outs.append(self.dense(q[start:end], k[start:end], v[start:end], length, scale))
            start = end
        # A fresh tensor either way: a custom op's output may not alias its inputs.
        return outs[0].contiguous() if len(outs) == 1 else torch.cat(outs)

    def _groups_for(self, rows: int, segments: int) -> tuple[tuple[int, int], ...] | None:
        """The current groups when they describe these rows and segments and are few enough."""
        current = _current_segments.get()
        if current is None or current.count != segments or current.rows != rows:
            return None
        return current.groups if 0 < len(current.groups) <= self.max_groups else None

    def forward(
        self,
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
            raise ValueError(f"{self.implementation} needs cu_seqlens and an integer max_seqlen")
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        hint = kwargs.get(EXACT_SEGMENTS)
        if hint is not None and hint.applies(cu_seq_lens_q):
            scale = q.shape[-1] ** -0.5 if scaling is None else scaling
            out = exact_attention(q, k, v, cu_seq_lens_q, int(max_length_q), scale, self.implementation)
        elif q.is_cuda:
            out = self.varlen(q, k, v, cu_seq_lens_q, int(max_length_q), scaling)
        else:
            out = segmented_sdpa(q, k, v, cu_seq_lens_q, q.shape[-1] ** -0.5 if scaling is None else scaling)
        return out.unsqueeze(0), None


@torch.library.custom_op("vlm_encoder::exact_attention", mutates_args=())
def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    implementation: str,
) -> torch.Tensor:
    """`AttentionBackend.exact` of the backend registered as `implementation`, opaque to
    torch.compile: the segment lengths are read here at run time (at capture, in a CUDA graph)."""
    return _registered[implementation].exact(q, k, v, cu_seqlens, max_seqlen, scale)


@exact_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale, implementation):
    return torch.empty_like(q)
