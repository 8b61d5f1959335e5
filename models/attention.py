"""Varlen attention for packed vision sequences, registered with transformers.

transformers' vision towers take the varlen branch (one kernel over all segments, driven by
`cu_seqlens` and `max_seqlen`) only when `config._attn_implementation` contains "flash".
We register our own function under such a name:

- CUDA: FlashAttention-2's varlen kernel (`aten._flash_attention_forward`) by default. No
  host sync, capturable in a CUDA graph with `cu_seqlens` in a static int32 buffer. The
  "auto" backend calls `varlen_attn` instead, which on torch 2.14+ with cuDNN >= 9.18 on
  Hopper/Blackwell picks cuDNN's varlen kernel; that kernel could not be captured on torch
  2.11 (see below), so it is opt-in until it is proven capturable. Every segment,
  padding included, must be <= `max_seqlen` or the result is silently wrong; callers
  guarantee it (see `models/layout.py`).
- CUDA, equal segments (unpadded exact layouts only: eager, compiled, or a recurring pack's own
  graph; from the `dense_segments` hint): the rows are a dense
  `[count, heads, length, dim]` batch; SDPA with cuDNN first. On an H100 (torch 2.11, cuDNN
  9.19, Qwen3-VL's 16 x 72 heads) cuDNN runs one 12544-patch image at 388 TFLOP/s where the
  FlashAttention-2 varlen kernel runs 238 (`benchmarks/results/qwen3_probe.json`). cuDNN's own
  varlen form could not be captured in a CUDA graph there.
- CPU: scaled dot-product attention per segment, exact in float32. It reads the segment
  lengths on the host, which is free on CPU (there are no CUDA graphs to break).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "flash_varlen_encoder"
DENSE_SEGMENTS = "dense_segments"
"""Keyword (passed through the tower to attention) carrying a `DenseSegments` hint; set only by
unpadded exact-layout forwards (eager, the runner's compiled exact route, or a recurring pack's
own graph of its exact layout), never a padded budget graph."""


@dataclass(frozen=True, eq=False)
class DenseSegments:
    """The rows are segments of `length` each, as laid out by exactly this `cu_seqlens` tensor.

    Attention uses the hint only when called with that very tensor, so layers attending over
    other segments (Qwen2.5-VL's windows) keep the varlen kernel. The segment count is not
    carried: it follows from the rows (`rows // length`), so the hint adds no specialisation of
    its own under torch.compile (dynamo specialises an int argument equal to 1). One image and
    several are still two compiles for Qwen2.5-VL and Qwen3-VL: their position metadata
    specialises one image (recompile logs in `benchmarks/results/README.md`)."""

    length: int
    cu_seqlens: torch.Tensor

    def applies(self, cu_seqlens: torch.Tensor) -> bool:
        return cu_seqlens is self.cu_seqlens


dense_hint_hits = 0
"""Attention calls that found their `DenseSegments` hint applicable (dense kernel on CUDA;
CPU keeps exact per-segment SDPA). Lets CPU tests check the hint reaches the right layers."""
BACKENDS = ("auto", "flash")
DEFAULT_BACKEND = "flash"
_backend = DEFAULT_BACKEND


def set_backend(name: str) -> None:
    """CUDA kernel for varlen attention: "flash" (default) always calls FlashAttention-2
    directly; "auto" lets `varlen_attn` pick (torch 2.14+: cuDNN on Hopper with cuDNN >= 9.18,
    not proven capturable; torch 2.11: FlashAttention-2, identical to "flash")."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {BACKENDS}")
    _backend = name


def _varlen_cuda(q, k, v, cu_seqlens, max_seqlen: int, scale: float | None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    if _backend == "flash":
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, False, scale=scale
        )
        return out[0]
    if scale is None or math.isclose(scale, q.shape[-1] ** -0.5):
        # The default scale; older torch releases (2.11) take no `scale` argument.
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale)


def _dense_cuda(q, k, v, length: int, scale: float | None) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    count, heads, dim = q.shape[0] // length, q.shape[1], q.shape[2]
    batch = [t.view(count, length, heads, dim).transpose(1, 2) for t in (q, k, v)]
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(order, set_priority=True):
        out = F.scaled_dot_product_attention(*batch, scale=scale)
    return out.transpose(1, 2).reshape(count * length, heads, dim)


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
    dense = kwargs.get(DENSE_SEGMENTS)
    use_dense = dense is not None and dense.applies(cu_seq_lens_q)
    if use_dense and not torch.compiler.is_compiling():
        # Not counted under torch.compile: dynamo guards on a global int it reads, so each
        # increment would invalidate the compiled forward and recompile it on the next call.
        global dense_hint_hits
        dense_hint_hits += 1
    if q.is_cuda and use_dense:
        out = _dense_cuda(q, k, v, dense.length, scaling)
    elif q.is_cuda:
        out = _varlen_cuda(q, k, v, cu_seq_lens_q, int(max_length_q), scaling)
    else:
        out = _segmented_sdpa(q, k, v, cu_seq_lens_q, scaling)
    return out.unsqueeze(0), None


def register() -> str:
    """Register the function (idempotent) and return the name to put in `_attn_implementation`."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention_forward)
    return ATTN_IMPLEMENTATION
