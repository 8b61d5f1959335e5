"""Padded `cu_seqlens` layouts: every row covered once, no segment over `max_seqlen`, padding
spread over the free slots (its attention cost is ~sum of squared segment lengths)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from models.layout import padded_cu_seqlens, padding_chunks
from models.protocol import PackCapacityError


@st.composite
def packs(draw):
    chunk = draw(st.integers(1, 64))
    lengths = draw(st.lists(st.integers(1, chunk), max_size=12))
    total = sum(lengths) + draw(st.integers(0, 400))
    capacity = draw(st.integers(len(lengths), len(lengths) + 80))
    return lengths, total, chunk, capacity


@given(packs())
def test_padded_offsets_cover_every_row_with_short_segments(pack):
    lengths, total, chunk, capacity = pack
    pad = total - sum(lengths)
    free = capacity - len(lengths)
    try:
        offsets = padded_cu_seqlens(lengths, total, chunk, capacity)
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
    # Spread: as many padding segments as free slots allow (never empty ones), nearly equal.
    assert len(padding) == (min(free, pad) if pad else 0)
    assert not padding or max(padding) - min(padding) <= 1
    # Zero-length slots only after the last segment.
    assert segments == [s for s in segments if s] + [0] * segments.count(0)


def test_padding_is_spread_so_its_attention_cost_is_small():
    # 8 images of 784 patches in an 8192-row graph, bucket 1024, 72 slots (Qwen3-VL 8 x 448x448).
    offsets = padded_cu_seqlens([784] * 8, 8192, 1024, 72)
    segments = [s for s in (offsets[1:] - offsets[:-1]).tolist() if s]
    padding = segments[8:]
    assert len(padding) == 64 and sum(padding) == 8192 - 8 * 784
    assert sum(s * s for s in padding) < 0.05 * (1024**2 + 896**2)  # vs two max_seqlen chunks


def test_padding_chunks_without_slots_uses_fewest_chunks():
    assert padding_chunks(10, 100, 40) == [30, 30, 30]
    assert padding_chunks(100, 100, 40) == []
    with pytest.raises(PackCapacityError, match="do not fit"):
        padding_chunks(101, 100, 40)
