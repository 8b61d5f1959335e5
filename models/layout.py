"""Host-side helpers that lay items out in fixed-size padded buffers.

Invariants every padded pack keeps (the varlen kernel is silently wrong otherwise):
- real items occupy rows `[0, used)` in pack order; rows `[used, total)` are padding;
- padding is split into segments no longer than the layout's `max_seqlen`, so every
  segment, real or padding, is <= `max_seqlen`; where free segment slots allow, into
  segments of <= `PADDING_BLOCK` rows: a padding segment of c rows costs attention ~c^2, so
  one 1024-row chunk costs as much as 64 of 128 rows, and a segment of <= 128 rows is one
  FlashAttention query block per head, the least a non-empty segment costs (the kernel grid
  is fixed by the slot count anyway);
- unused `cu_seqlens` slots repeat the last offset (zero-length trailing segments).
Padding rows never attend to real rows, so real outputs do not depend on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .protocol import ItemSpec, PackCapacityError, PackLayout, segment_lengths

__all__ = [
    "PADDING_BLOCK",
    "exact_layout",
    "pack_rows",
    "padded_cu_seqlens",
    "padded_rows",
    "padding_chunks",
    "segment_lengths",
]

PADDING_BLOCK = 128
"""Padding segments are cut to this many rows where slots allow: FlashAttention's query block."""


def padding_chunks(used: int, total: int, chunk: int, slots: int = 0, block: int = PADDING_BLOCK) -> list[int]:
    """Nearly equal lengths that cover `[used, total)`, each <= `chunk` rows: as few as that
    takes, or more, up to `slots` of them, so that each is <= `block` rows where possible."""
    if used > total:
        raise PackCapacityError(f"{used} rows do not fit a buffer of {total}")
    rows = total - used
    if rows == 0:
        return []
    count = max(-(-rows // chunk), min(slots, -(-rows // block)))
    size, extra = divmod(rows, count)
    return [size + 1] * extra + [size] * (count - extra)


def padded_cu_seqlens(
    lengths: Sequence[int], total: int, chunk: int, capacity: int, block: int = PADDING_BLOCK
) -> torch.Tensor:
    """int32 `[capacity + 1]` offsets: `lengths`, then padding segments up to `total` (see
    `padding_chunks`), then repeats. Built through numpy (see `padded_rows`)."""
    if lengths and max(lengths) > chunk:
        raise PackCapacityError(f"segment of {max(lengths)} rows exceeds max_seqlen {chunk}")
    free = capacity - len(lengths)
    segments = list(lengths) + padding_chunks(sum(lengths), total, chunk, free, block)
    if len(segments) > capacity:
        raise PackCapacityError(f"{len(segments)} attention segments exceed the buffer's {capacity}")
    offsets = torch.zeros(capacity + 1, dtype=torch.int32)  # a few hundred elements: no thread pool
    array = offsets.numpy()
    if segments:
        np.cumsum(segments, out=array[1 : len(segments) + 1])
    array[len(segments) + 1 :] = total
    return offsets


def padded_rows(
    pieces: Sequence[np.ndarray | torch.Tensor],
    total: int,
    row_shape: tuple[int, ...],
    dtype: torch.dtype,
    fill: float | int = 0,
) -> torch.Tensor:
    """Per-item row blocks (numpy arrays or CPU tensors of `row_shape` rows) one after another in
    one fresh `[total, *row_shape]` tensor, `fill` rows after them. The pieces are never aliased
    (they are the per-grid caches); a run of the same piece object (equal items, which a pack's
    canonical order puts side by side) is written in one broadcast assignment.

    Copied and filled through numpy, not torch: torch runs an op over more than 32768 elements on
    its intra-op thread pool, whose threads sleep while the replica waits on the GPU and take
    milliseconds to wake, on the host path of every pack."""
    used = sum(piece.shape[0] for piece in pieces)
    if used > total:
        raise PackCapacityError(f"{used} rows do not fit a buffer of {total}")
    out = torch.empty((total, *row_shape), dtype=dtype)
    array = out.numpy()
    start = index = 0
    while index < len(pieces):
        piece, run = pieces[index], 1
        while index + run < len(pieces) and pieces[index + run] is piece:
            run += 1
        rows = piece.shape[0]
        values = piece.numpy() if isinstance(piece, torch.Tensor) else piece
        if tuple(values.shape[1:]) != tuple(row_shape):  # broadcasting would hide a wrong piece
            raise ValueError(f"a piece of shape {tuple(values.shape)} does not have rows of shape {row_shape}")
        array[start : start + run * rows].reshape(run, rows, *row_shape)[:] = values
        start += run * rows
        index += run
    array[start:] = fill
    return out


def exact_layout(specs: Sequence[ItemSpec]) -> PackLayout:
    """The unpadded layout of exactly these items: their tokens, longest frame and frames."""
    tokens = sum(s.output_tokens for s in specs)
    segments = sum(s.segments for s in specs)
    return PackLayout(tokens, max((s.frame_patches for s in specs), default=1), segments)


def pack_rows(specs: Sequence[ItemSpec], layout: PackLayout, merge_unit: int) -> int:
    """The layout's input rows; PackCapacityError when the items' patches exceed them."""
    rows = layout.token_budget * merge_unit
    used = sum(s.input_patches for s in specs)
    if used > rows:
        raise PackCapacityError(f"{used} patches exceed the layout's {rows}")
    return rows
