"""GPU: cuDNN's varlen kernel (through nvidia-cudnn-frontend), our Triton kernel and
FlashAttention-3 (vLLM's build) on the runner's padded layouts, in a CUDA graph, against
attention written out per segment in float32."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pytest
import torch

from models import attention
from models.attention import AttentionBackend
from models.layout import padded_cu_seqlens
from tests.helpers import relative_error

pytestmark = pytest.mark.gpu
needs_cudnn = pytest.mark.skipif(
    not attention.cudnn_frontend_available(), reason="needs nvidia-cudnn-frontend on Hopper+"
)


@dataclass(frozen=True)
class RecordsVarlen(AttentionBackend):
    """A backend that records (kernel, max_seqlen) of every varlen launch it makes."""

    calls: list = field(default_factory=list, compare=False)

    def varlen(self, q, k, v, cu_seqlens, max_seqlen, scale):
        self.calls.append((self.varlen_kernel(max_seqlen, q.shape[-1]), max_seqlen))
        return super().varlen(q, k, v, cu_seqlens, max_seqlen, scale)


def backend(kernel: str) -> RecordsVarlen:
    """A recording backend of `kernel`; the test skips where it cannot serve."""
    if kernel == "cudnn" and not attention.cudnn_frontend_available():
        pytest.skip("needs nvidia-cudnn-frontend on Hopper+")
    if kernel == "triton" and not attention.triton_available():
        pytest.skip("needs triton on an Ampere or newer GPU")
    if kernel == "fa3" and not attention.fa3_available():
        pytest.skip("needs vLLM's FlashAttention-3 build on a Hopper GPU")
    return RecordsVarlen(kernel)


def per_segment(q, k, v, bounds, scale):
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            qs, ks, vs = (t[start:end].float().transpose(0, 1) for t in (q, k, v))
            out[start:end] = (torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1) @ vs).transpose(0, 1)
    return out


@pytest.mark.parametrize("kernel", ["cudnn", "triton", "fa3"])
@pytest.mark.parametrize("head_dim", [72, 80])
@pytest.mark.parametrize(
    "lengths, max_seqlen",
    [([3136, 784, 784, 256, 256, 256], 4096), ([5000, 2048, 784], 8192)],  # the second: Triton loads by TMA
    ids=["mixed", "long"],
)
def test_varlen_in_a_graph_matches_per_segment_attention_on_a_padded_layout(kernel, head_dim, lengths, max_seqlen):
    """A mixed pack padded into a larger buffer: padding segments and zero-length trailing slots,
    as `models/layout.py` lays them out. The captured op, replayed on new values, must match the
    written-out attention on every row (padding rows attend among themselves) and stay finite.
    q, k and v are views of one projection, as in the towers (row stride 3 x heads x dim)."""
    chosen = backend(kernel)
    rows = 8192
    cu = padded_cu_seqlens(lengths, rows, max_seqlen, 64).cuda()
    bounds = cu.tolist()
    assert bounds[-1] == bounds[-2] == rows  # trailing zero-length slots
    q, k, v = torch.randn(rows, 3, 16, head_dim, device="cuda", dtype=torch.bfloat16).unbind(1)
    scale = head_dim**-0.5
    chosen.varlen(q, k, v, cu, max_seqlen, scale)  # builds the cuDNN graph / Triton kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chosen.varlen(q, k, v, cu, max_seqlen, scale)
    assert {name for name, _ in chosen.calls} == {kernel}
    for seed in (1, 2):
        torch.manual_seed(seed)
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert relative_error(out, per_segment(q, k, v, bounds, scale)) < 2e-2


@pytest.mark.parametrize("kernel", ["triton", "fa3"])
@pytest.mark.parametrize("head_dim", [72, 80])
def test_kernel_in_a_graph_on_a_layout_of_many_mostly_empty_slots(kernel, head_dim):
    """The runner's graphs under backends triton and fa3 have few max_seqlen buckets (1024, 4096, the
    budget's rows; `AttentionBackend.graph_seqlen_buckets`), so a graph may hold many more segment slots
    than a pack fills. Captured on one pack of 200 slots, replayed on new segment lengths (the
    next pack in the same graph): right on every row, finite."""
    chosen = backend(kernel)
    rows, slots, max_seqlen = 9216, 200, 4096
    scale = head_dim**-0.5
    q, k, v = torch.randn(rows, 3, 16, head_dim, device="cuda", dtype=torch.bfloat16).unbind(1)
    cu = padded_cu_seqlens([784] * 8, rows, max_seqlen, slots).cuda()
    chosen.varlen(q, k, v, cu, max_seqlen, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chosen.varlen(q, k, v, cu, max_seqlen, scale)
    assert {name for name, _ in chosen.calls} == {kernel}
    for lengths in ([3136, 784, 784, 256, 256, 256], [4000, 1] + [64] * 60):
        cu.copy_(padded_cu_seqlens(lengths, rows, max_seqlen, slots))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert relative_error(out, per_segment(q, k, v, cu.tolist(), scale)) < 2e-2


@needs_cudnn
def test_exact_layout_of_several_runs_takes_one_cudnn_call():
    """On an exact layout, one run of equal segments stays a dense batch; several runs take the
    cuDNN varlen kernel (one call rather than a dense call per run)."""
    cudnn = backend("cudnn")
    for lengths, expected_calls in (([784] * 4, []), ([3136, 784, 784, 256], [("cudnn", 3136)])):
        cudnn.calls.clear()
        rows = sum(lengths)
        cu = padded_cu_seqlens(lengths, rows, max(lengths), len(lengths)).cuda()
        q, k, v = (torch.randn(rows, 16, 72, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        with attention.exact_segments(lengths):
            out = cudnn.exact(q, k, v, cu, max(lengths), 72**-0.5)
        assert cudnn.calls == expected_calls
        assert relative_error(out, per_segment(q, k, v, cu.tolist(), 72**-0.5)) < 2e-2


@pytest.mark.parametrize("in_graph", [True, False], ids=["for-graph", "outside-graphs"])
def test_exact_layouts_under_backend_triton(in_graph):
    """Under backend "triton", an exact layout whose segments are longer than
    `TRITON_OVER_DENSE_SEQLEN` runs the Triton kernel (TMA loads) at head dim 72 and dense cuDNN
    at 80. Shorter equal segments run dense cuDNN for a CUDA graph (`for_graph`: a warm-up, a
    capture), the Triton kernel outside one (`TRITON_OUTSIDE_GRAPHS`: a cheaper launch), and
    unequal ones the Triton kernel either way. All match attention written out per segment."""
    triton = backend("triton")
    short = [] if in_graph else [784]
    cases = [
        ([784] * 4, 72, short),
        ([784] * 4, 80, short),
        ([1024, 784, 784, 256], 72, [1024]),
        ([5000], 72, [5000]),
        ([4608, 4608], 72, [4608]),
        ([5000], 80, []),
    ]
    for lengths, dim, expected_calls in cases:
        triton.calls.clear()
        rows = sum(lengths)
        cu = padded_cu_seqlens(lengths, rows, max(lengths), len(lengths)).cuda()
        q, k, v = torch.randn(rows, 3, 16, dim, device="cuda", dtype=torch.bfloat16).unbind(1)
        mode = attention.for_graph() if in_graph else contextlib.nullcontext()
        with attention.exact_segments(lengths), mode:
            out = triton.exact(q, k, v, cu, max(lengths), dim**-0.5)
        assert [n for kernel, n in triton.calls if kernel == "triton"] == expected_calls, (lengths, dim)
        assert relative_error(out, per_segment(q, k, v, cu.tolist(), dim**-0.5)) < 2e-2


def test_exact_layout_captured_without_for_graph_takes_dense_cudnn():
    """While a stream captures, short equal segments pick dense cuDNN even without `for_graph`
    (host time is not replayed); the graph replays correctly on new inputs."""
    triton = backend("triton")
    lengths = [784] * 4
    rows = sum(lengths)
    cu = padded_cu_seqlens(lengths, rows, 784, 4).cuda()
    q, k, v = torch.randn(rows, 3, 16, 72, device="cuda", dtype=torch.bfloat16).unbind(1)
    with attention.exact_segments(lengths):
        with attention.for_graph():  # build cuDNN's dense plan outside capture
            triton.exact(q, k, v, cu, 784, 72**-0.5)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = triton.exact(q, k, v, cu, 784, 72**-0.5)
    assert triton.calls == []
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, per_segment(q, k, v, cu.tolist(), 72**-0.5)) < 2e-2
