"""Varlen attention for packed vision sequences, registered with transformers.

transformers' vision towers take the varlen branch (one kernel over all segments, driven by
`cu_seqlens` and `max_seqlen`) only when `config._attn_implementation` contains "flash".
We register our own function under such a name:

- CUDA: `torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 / cuDNN). No host sync,
  capturable in a CUDA graph with `cu_seqlens` in a static int32 buffer. Every segment,
  padding included, must be <= `max_seqlen` or the result is silently wrong; callers
  guarantee it (see `models/layout.py`).
- CPU: scaled dot-product attention per segment, exact in float32. It reads the segment
  lengths on the host, which is free on CPU (there are no CUDA graphs to break).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "flash_varlen_encoder"
BACKENDS = ("auto", "flash")
_backend = "auto"


def set_backend(name: str) -> None:
    """CUDA kernel for varlen attention: "auto" lets `varlen_attn` pick (cuDNN on Hopper with a
    recent cuDNN, else FlashAttention-2); "flash" always calls FlashAttention-2 directly."""
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
    if q.is_cuda:
        out = _varlen_cuda(q, k, v, cu_seq_lens_q, int(max_length_q), scaling)
    else:
        out = _segmented_sdpa(q, k, v, cu_seq_lens_q, scaling)
    return out.unsqueeze(0), None


def register() -> str:
    """Register the function (idempotent) and return the name to put in `_attn_implementation`."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention_forward)
    return ATTN_IMPLEMENTATION
