"""Varlen attention in Triton with a tile as wide as the head, not a power of two (backend "triton").

cuDNN and FlashAttention-2 run a head dim of 72 (Qwen3-VL) or 80 (Qwen2.5-VL) in a kernel
built for 96 or 128 columns: the extra columns are zeros they multiply anyway. Here the head is
split into a 64-column part and a 16-column part (80 = 64 + 16 exactly; 72 = 64 + 8, padded to
16), so a 72-wide head computes 80 columns, not 128.

Where it serves instead of cuDNN's or FlashAttention-2's kernels, and where dense cuDNN keeps
exact layouts, is `models/attention.py`'s choice; long segments load keys and values through TMA
descriptors (`TMA_MIN_SEQLEN`). Measurements: `docs/performance.md`.

Layout: `q`, `k`, `v` are `[rows, heads, dim]` (views whose row and head strides are multiples
of 8, the last dim contiguous; `aligned` copies others), segments are `cu_seqlens` (int32, on
the device, no host read), one program per (query block, head, segment); a program whose block
starts past its segment's end returns at once, so a grid sized by `max_seqlen` costs little for
short segments. Head offsets are hinted as multiples of 8 elements: Triton specialises only
integer arguments divisible by 16, so a head stride of 72 alone would leave every load
unvectorised. No host sync, so it captures in
a CUDA graph. Non-causal, no dropout. CPU tests run it under Triton's interpreter
(`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@dataclass(frozen=True)
class TileConfig:
    """Tile of one program; the default was the best of a sweep on Hopper at both head shapes,
    on long segments and mixed packs alike."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_CONFIG = TileConfig()


def head_split(dim: int) -> tuple[int, int]:
    """(columns of the wide part, columns of the narrow part) for a head of `dim`: a power of two
    >= 16, then the rest padded to a power of two >= 16 (0 when nothing is left)."""
    if dim < 16:
        raise ValueError(f"head dim {dim} < 16 is not supported by the Triton kernel")
    wide = 1 << (dim.bit_length() - 1)
    rest = dim - wide
    return wide, (0 if rest == 0 else max(16, triton.next_power_of_2(rest)))


@triton.jit
def _block(
    acc_a, acc_b, m_i, l_i, qa, qb, k_desc_a, k_desc_b, v_desc_a, v_desc_b, k_rows, v_rows, da, db, col_b_ok,
    cols0, n0, length, s_kt, s_vt, scale_log2,
    NA: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """One key block at `n0`. Loads are masked to the segment (or zero-filled past it by TMA); the
    scores are masked only in a block that runs past the segment's end."""
    keep = (n0 + cols0) < length
    if TMA:
        ka = k_desc_a.load([n0, 0])
    else:
        ka = tl.load(k_rows + n0 * s_kt + da[None, :], mask=keep[:, None], other=0.0)
    s = tl.dot(qa, tl.trans(ka))
    if HAS_B:
        if TMA:
            kb = k_desc_b.load([n0, NA])
        else:
            kb = tl.load(k_rows + n0 * s_kt + db[None, :], mask=keep[:, None] & col_b_ok[None, :], other=0.0)
        s = tl.dot(qb, tl.trans(kb), s)
    if n0 + BLOCK_N > length:
        s = tl.where(keep[None, :], s, float("-inf"))
    # The scale folded into one FMA per score: the maximum is taken on the raw scores (scale > 0).
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    p = tl.math.exp2(s * scale_log2 - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if TMA:
        va = v_desc_a.load([n0, 0])
    else:
        va = tl.load(v_rows + n0 * s_vt + da[None, :], mask=keep[:, None], other=0.0)
    p = p.to(va.dtype)
    acc_a = tl.dot(p, va, acc_a * alpha[:, None])
    if HAS_B:
        if TMA:
            vb = v_desc_b.load([n0, NA])
        else:
            vb = tl.load(v_rows + n0 * s_vt + db[None, :], mask=keep[:, None] & col_b_ok[None, :], other=0.0)
        acc_b = tl.dot(p, vb, acc_b * alpha[:, None])
    return acc_a, acc_b, m_new, l_i


@triton.jit
def _varlen_forward(
    Q, K, V, Out, CU, scale_log2,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh,
    DIM: tl.constexpr, NA: tl.constexpr, NB: tl.constexpr, HAS_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seg = tl.program_id(2)
    start = tl.load(CU + seg)
    length = tl.load(CU + seg + 1) - start
    if pid_m * BLOCK_M >= length:
        return
    start = start.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    cols0 = tl.arange(0, BLOCK_N)
    da = tl.arange(0, NA)
    db = NA + tl.arange(0, NB)
    col_b_ok = db < DIM

    q_rows = Q + start * s_qt + tl.multiple_of(head * s_qh, 8) + rows[:, None] * s_qt
    qa = tl.load(q_rows + da[None, :], mask=row_ok[:, None], other=0.0)
    qb = tl.load(q_rows + db[None, :], mask=row_ok[:, None] & col_b_ok[None, :], other=0.0)
    k_base = K + start * s_kt + tl.multiple_of(head * s_kh, 8)
    v_base = V + start * s_vt + tl.multiple_of(head * s_vh, 8)
    if TMA:  # the segment's rows of this head as [length, DIM]: TMA zero-fills past both ends
        k_desc_a = tl.make_tensor_descriptor(k_base, [length, DIM], [s_kt, 1], [BLOCK_N, NA])
        k_desc_b = tl.make_tensor_descriptor(k_base, [length, DIM], [s_kt, 1], [BLOCK_N, NB])
        v_desc_a = tl.make_tensor_descriptor(v_base, [length, DIM], [s_vt, 1], [BLOCK_N, NA])
        v_desc_b = tl.make_tensor_descriptor(v_base, [length, DIM], [s_vt, 1], [BLOCK_N, NB])
    else:
        k_desc_a = 0
        k_desc_b = 0
        v_desc_a = 0
        v_desc_b = 0
    k_rows = k_base + cols0[:, None] * s_kt
    v_rows = v_base + cols0[:, None] * s_vt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, NA], tl.float32)
    acc_b = tl.zeros([BLOCK_M, NB], tl.float32)
    # One loop; only the block past the segment's end masks its scores (a uniform branch), which
    # masking every block would cost on long segments. A masked tail peeled off after the loop
    # faulted on Triton 3.6 (illegal address).
    for n0 in range(0, length, BLOCK_N):
        acc_a, acc_b, m_i, l_i = _block(
            acc_a, acc_b, m_i, l_i, qa, qb, k_desc_a, k_desc_b, v_desc_a, v_desc_b, k_rows, v_rows, da, db,
            col_b_ok, cols0, n0, length, s_kt, s_vt, scale_log2, NA, HAS_B, BLOCK_N, TMA,
        )  # fmt: skip

    inv = 1.0 / l_i
    o_rows = Out + start * s_ot + tl.multiple_of(head * s_oh, 8) + rows[:, None] * s_ot
    tl.store(o_rows + da[None, :], (acc_a * inv[:, None]).to(Out.dtype.element_ty), mask=row_ok[:, None])
    if HAS_B:
        tl.store(
            o_rows + db[None, :],
            (acc_b * inv[:, None]).to(Out.dtype.element_ty),
            mask=row_ok[:, None] & col_b_ok[None, :],
        )


TMA_MIN_SEQLEN = 4096
"""Above this `max_seqlen`, keys and values load through TMA descriptors: faster on long segments,
slower on short ones, where the per-program descriptor setup is not paid back."""


def tma_capable(*tensors: torch.Tensor) -> bool:
    """Device-side TMA descriptors: a Hopper or newer GPU and 16-byte aligned base addresses."""
    t = tensors[0]
    return (
        t.is_cuda
        and torch.cuda.get_device_capability(t.device)[0] >= 9
        and all(x.data_ptr() % 16 == 0 for x in tensors)
    )


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when the kernel can read it (contiguous last dim, row and head strides multiples
    of 8 elements), else a contiguous copy."""
    if t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0:
        return t
    return t.contiguous()


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    config: TileConfig = DEFAULT_CONFIG,
    tma: bool | None = None,
) -> torch.Tensor:
    """Attention within each segment of `cu_seqlens` over `[rows, heads, dim]` q/k/v; every
    segment must be <= `max_seqlen` (it sizes the grid). Returns `[rows, heads, dim]`; rows past
    `cu_seqlens[-1]` are left as they were in `out` (uninitialised when `out` is None).

    `tma`: keys and values through TMA descriptors (None: when `max_seqlen` > `TMA_MIN_SEQLEN`,
    on a Hopper or newer GPU, with 16-byte aligned k and v)."""
    rows, heads, dim = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("q, k, v need a contiguous last dim")
    if any(t.stride(i) % 8 for t in (q, k, v) for i in (0, 1)):
        raise ValueError("q, k, v row and head strides must be multiples of 8 (16-byte aligned rows)")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    wide, narrow = head_split(dim)
    scale = dim**-0.5 if scale is None else scale
    if not scale > 0:
        raise ValueError(f"scale must be positive (the kernel takes the row maximum before scaling), got {scale}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if tma is None:
        tma = max_seqlen > TMA_MIN_SEQLEN and tma_capable(k, v)
    if tma:  # per-program descriptors live in a scratch buffer the launch asks for (a ContextVar)
        device = q.device
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))
    segments = cu_seqlens.numel() - 1
    grid = (triton.cdiv(max(max_seqlen, 1), config.block_m), heads, segments)
    _varlen_forward[grid](
        q, k, v, out, cu_seqlens, scale * LOG2_E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        DIM=dim, NA=wide, NB=max(narrow, 16), HAS_B=narrow > 0, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        TMA=bool(tma), num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
