"""Our Triton varlen kernel (`models/triton_attention.py`) on CPU, under Triton's interpreter,
against SDPA per segment in float32. The GPU tests run it compiled, in CUDA graphs, in the towers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHECK = r"""
import itertools

import torch
from models.triton_attention import TileConfig, aligned, head_split, varlen_attention

assert head_split(72) == (64, 16) and head_split(80) == (64, 16) and head_split(64) == (64, 0)
torch.manual_seed(0)
worst = {}
# Segments shorter than, equal to and longer than a block, whole blocks with and without a
# partial last one (both tiles), an empty one, rows past the last segment (left alone), and q/k/v
# as views of one projection (row stride 3 x heads x dim).
lengths = [37, 16, 0, 100, 5, 64, 128, 129]
rows = sum(lengths) + 7
# Both load paths: pointers, and TMA descriptors (which zero-fill past a segment's last row).
for dim, tile, tma in itertools.product((72, 80, 64), (TileConfig(32, 16, 4, 2), TileConfig()), (False, True)):
    q, k, v = torch.randn(rows, 3, 2, dim).unbind(1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.full_like(q, 7.0)
    varlen_attention(q, k, v, cu, max(lengths), dim**-0.5, out, tile, tma=tma)
    start, error = 0, 0.0
    for n in lengths:
        if n:
            seg = [t[start : start + n].transpose(0, 1) for t in (q, k, v)]
            ref = torch.nn.functional.scaled_dot_product_attention(*seg).transpose(0, 1)
            error = max(error, (out[start : start + n] - ref).abs().max().item())
        start += n
    assert (out[start:] == 7.0).all(), "rows past the last segment were written"
    worst[(dim, tile.block_m, tma)] = error
# Many slots, the last 20 empty (cu_seqlens repeating its last offset), as the runner's layouts
# have: one program per (query block, head, slot), empty slots returning at once.
many = [int(n) for n in torch.randint(1, 9, (150,))]
cu = torch.tensor([0, *torch.tensor(many).cumsum(0).tolist()] + [sum(many)] * 20, dtype=torch.int32)
q, k, v = torch.randn(sum(many) + 3, 3, 2, 72).unbind(1)
out = varlen_attention(q, k, v, cu, max(many), config=TileConfig(32, 16, 4, 2))
start, error = 0, 0.0
for n in many:
    seg = [t[start : start + n].transpose(0, 1) for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*seg).transpose(0, 1)
    error = max(error, (out[start : start + n] - ref).abs().max().item())
    start += n
worst["170 slots"] = error
# A view the kernel cannot read (head stride 76, not a multiple of 8) goes through `aligned`'s copy.
q, k, v = (torch.randn(rows, 2, 76)[..., :72] for _ in range(3))
cu = torch.tensor([0, 50, rows], dtype=torch.int32)
out = varlen_attention(*(aligned(t) for t in (q, k, v)), cu, rows - 50)
ref = torch.nn.functional.scaled_dot_product_attention(*(t[50:].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
worst["misaligned view"] = (out[50:] - ref).abs().max().item()
print(worst)
assert max(worst.values()) < 1e-5, worst
"""


def test_kernel_matches_per_segment_sdpa_under_the_interpreter():
    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_inputs_the_kernel_cannot_take_are_refused_before_launch():
    """Checked on the host, before any launch: each error names what is wrong."""
    import torch

    from models.triton_attention import aligned, head_split, varlen_attention

    q = torch.randn(10, 2, 72)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="shapes differ"):
        varlen_attention(q, q[:, :1], q, cu, 10)
    with pytest.raises(ValueError, match="contiguous last dim"):
        varlen_attention(q[..., ::2], q[..., ::2], q[..., ::2], cu, 10)
    misaligned = torch.randn(10, 2, 76)[..., :72]
    with pytest.raises(ValueError, match="multiples of 8"):
        varlen_attention(misaligned, misaligned, misaligned, cu, 10)
    assert aligned(misaligned).stride() == (144, 72, 1) and aligned(q) is q  # a copy only when needed
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(q, q, q, cu.long(), 10)
    with pytest.raises(ValueError, match="head dim 8 < 16"):
        head_split(8)
    with pytest.raises(ValueError, match="scale must be positive"):
        varlen_attention(q, q, q, cu, 10, scale=-1.0)
