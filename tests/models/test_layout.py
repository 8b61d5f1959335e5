"""Padded `cu_seqlens` layouts: every row covered once, no segment over `max_seqlen`, padding
spread over the free slots (its attention cost is ~sum of squared segment lengths)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from models.layout import padded_cu_seqlens, padded_rows, padding_chunks
from models.protocol import PackCapacityError


@st.composite
def packs(draw):
    chunk = draw(st.integers(1, 64))
    lengths = draw(st.lists(st.integers(1, chunk), max_size=12))
    total = sum(lengths) + draw(st.integers(0, 400))
    capacity = draw(st.integers(len(lengths), len(lengths) + 80))
    block = draw(st.integers(1, 2 * chunk))
    return lengths, total, chunk, capacity, block


@given(packs())
def test_padded_offsets_cover_every_row_with_short_segments(pack):
    lengths, total, chunk, capacity, block = pack
    pad = total - sum(lengths)
    free = capacity - len(lengths)
    try:
        offsets = padded_cu_seqlens(lengths, total, chunk, capacity, block)
    except PackCapacityError:
        assert -(-pad // chunk) > free  # only when even max_seqlen chunks need more slots
        return
    assert offsets.dtype == torch.int32 and offsets.shape == (capacity + 1,)
    assert offsets[0] == 0 and offsets[-1] == total
    segments = (offsets[1:] - offsets[:-1]).tolist()
    assert all(0 <= s <= chunk for s in segments)
    assert segments[: len(lengths)] == lengths
    padding = [s for s in segments[len(lengths) :] if s]
    assert sum(padding) == pad
    # Spread: segments of <= block rows as far as free slots allow, never empty, nearly equal.
    fewest = -(-pad // chunk)
    assert len(padding) == (max(fewest, min(free, -(-pad // block))) if pad else 0)
    assert not padding or max(padding) - min(padding) <= 1
    if pad and free * block >= pad:
        assert max(padding) <= block
    # Zero-length slots only after the last segment.
    assert segments == [s for s in segments if s] + [0] * segments.count(0)


def test_padding_is_spread_so_its_attention_cost_is_small():
    # 8 images of 784 patches in an 8192-row graph, bucket 1024, 72 slots (Qwen3-VL 8 x 448x448).
    offsets = padded_cu_seqlens([784] * 8, 8192, 1024, 72)
    segments = [s for s in (offsets[1:] - offsets[:-1]).tolist() if s]
    padding = segments[8:]
    assert len(padding) == 15 and sum(padding) == 8192 - 8 * 784 and max(padding) <= 128
    assert sum(s * s for s in padding) < 0.15 * (1024**2 + 896**2)  # vs two max_seqlen chunks
    # One 448x448 image in a 1024-row graph: two padding segments, not eight tiny ones.
    offsets = padded_cu_seqlens([784], 1024, 1024, 9)
    assert [s for s in (offsets[1:] - offsets[:-1]).tolist() if s] == [784, 120, 120]


def test_padding_chunks_without_slots_uses_fewest_chunks():
    assert padding_chunks(10, 100, 40) == [30, 30, 30]
    assert padding_chunks(10, 100, 40, slots=10, block=20) == [18] * 5
    assert padding_chunks(100, 100, 40) == []
    with pytest.raises(PackCapacityError, match="do not fit"):
        padding_chunks(101, 100, 40)


def test_padded_rows_copies_its_pieces_and_fills_the_rest():
    pieces = [torch.arange(12, dtype=torch.int64).reshape(3, 4), torch.arange(8, dtype=torch.int64).reshape(4, 2).T]
    padded = padded_rows(pieces, 9, (4,), torch.int64, fill=-1)  # the second piece is a strided view
    assert torch.equal(padded, torch.cat([*pieces, torch.full((4, 4), -1)]))
    padded[0, 0] = 99  # a fresh buffer: the (cached) pieces stay as they were
    assert pieces[0][0, 0] == 0
    assert padded_rows([], 0, (4,), torch.float32).shape == (0, 4)
    same = np.arange(6).reshape(3, 2)  # a run of one cached piece: one broadcast write
    grouped = padded_rows([same, same, np.zeros((1, 2), np.int64), same], 11, (2,), torch.int64, fill=-1)
    assert grouped.tolist() == [*same.tolist() * 2, [0, 0], *same.tolist(), [-1, -1]]
    exact = padded_rows([same], 3, (2,), torch.int64)  # fills the buffer exactly: still a copy
    exact[0, 0] = grouped[0, 0] = 99
    assert same[0, 0] == 0
    with pytest.raises(ValueError, match="rows of shape"):
        padded_rows([np.zeros((3, 1))], 4, (2,), torch.float32)  # would broadcast into both columns
    vector = padded_rows([torch.tensor([3, 1]), torch.tensor([2])], 5, (), torch.int64, fill=7)
    assert vector.tolist() == [3, 1, 2, 7, 7]
    with pytest.raises(PackCapacityError, match="do not fit"):
        padded_rows(pieces, 4, (4,), torch.int64)


def test_padded_cu_seqlens_without_padding_or_segments():
    assert padded_cu_seqlens([3, 5], 8, 8, 4).tolist() == [0, 3, 8, 8, 8]
    assert padded_cu_seqlens([], 0, 8, 2).tolist() == [0, 0, 0]
    assert padded_cu_seqlens([], 6, 4, 2).tolist() == [0, 3, 6]
    assert padded_cu_seqlens([2], 2, 4, 1).dtype == torch.int32
