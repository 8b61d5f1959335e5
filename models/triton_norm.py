"""The residual add and the layer norm after it as one Triton kernel (one pass over each row).

A pre-norm block ends `h = h + delta` and the next step is `norm(h)`. inductor fuses the two,
but at Qwen3-VL's 1152 columns (over its 1024-column limit for one-pass row reductions) it
reads each row twice, and it recomputes the residual sum in later kernels instead of storing
it once. This kernel reads `x` and `delta` once and writes the residual and the normed rows:
four `[rows, n]` transfers, the least traffic the two ops need (2875 GB/s at 6272 rows, ~86%
of the H100's bandwidth). On an H100 at 6272 x 1152 bf16 it takes 20.1 us against
30.3 us for inductor's compile of the same two ops, and 34.0 us eagerly (12544 rows: 40.9 /
58.5 / 64.7; `benchmarks/results/norm_probe.json`).

The sum is rounded to the input dtype before the norm reads it, as `h + delta` then
`layer_norm(h)` round it eagerly; mean and variance are two float32 sums over the row (torch
uses Welford's update), so the normed rows differ from torch's in rounding only.

Registered as a `torch.library.triton_op`, so inductor launches the kernel from its own
generated code (no Python op dispatch per call) and CUDA graphs capture it. One program per
row; the whole row is held in registers (`n` <= 8192).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

MAX_COLUMNS = 8192


@triton.jit
def _add_layer_norm(x_ptr, d_ptr, w_ptr, b_ptr, r_ptr, y_ptr, eps, N: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    offs = row * N + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    d = tl.load(d_ptr + offs, mask=mask, other=0.0)
    r = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
    tl.store(r_ptr + offs, r, mask=mask)
    rf = r.to(tl.float32)
    mean = tl.sum(rf, axis=0) / N
    centred = tl.where(mask, rf - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (centred * rstd * w + b).to(x.dtype), mask=mask)


def supports(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """Whether the kernel serves these operands: 2-D contiguous, same shape, dtype and device, an
    affine norm over the last dim (weight and bias of that width, dtype and device), 1 to
    `MAX_COLUMNS` columns, a 16-bit or float32 dtype (it reduces in float32)."""
    return (
        weight is not None
        and bias is not None
        and x.dim() == 2
        and x.shape == delta.shape
        and 0 < x.shape[1] <= MAX_COLUMNS
        and weight.shape == bias.shape == (x.shape[1],)
        and x.dtype == delta.dtype == weight.dtype == bias.dtype
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and x.device == delta.device == weight.device == bias.device
        and x.is_contiguous()
        and delta.is_contiguous()
        and weight.is_contiguous()
        and bias.is_contiguous()
    )


def launch(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, kernel=_add_layer_norm
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x + delta, layer_norm(x + delta))` by the kernel (`kernel`: how to launch it, wrapped for
    inductor inside the op)."""
    rows, n = x.shape
    residual, normed = torch.empty_like(x), torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(n)
        kernel[(rows,)](x, delta, weight, bias, residual, normed, eps, N=n, BLOCK_N=block, num_warps=4)
    return residual, normed


@triton_op("vlm_encoder::add_layer_norm", mutates_args=())
def add_layer_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return launch(x, delta, weight, bias, eps, wrap_triton(_add_layer_norm))
