"""The residual add fused with the layer norm after it (`models/triton_norm.py`, and the Qwen3-VL
tower's own block loop that uses it), against the two ops as transformers runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers.models.qwen3_vl import modeling_qwen3_vl

from models import from_preset, qwen3_vl
from tests.helpers import random_image, reference_item, reference_tower, relative_error

CHECK = r"""
import torch
from models.triton_norm import MAX_COLUMNS, launch, supports

torch.manual_seed(0)
worst = {}
# A power-of-two width, Qwen3-VL's 1152 (masked past it), a narrow odd one; 0 and 1 rows too.
# The last case's eps is of the order of its rows' variance: an eps left out would show.
for rows, n, eps in [(5, 64, 1e-6), (3, 1152, 1e-6), (7, 40, 1e-6), (1, 1152, 1e-6), (0, 64, 1e-6), (4, 96, 0.5)]:
    x, d = torch.randn(2, rows, n).unbind(0)
    x, d = x * 3 + 1, d * 0.5
    if eps > 0.1:
        x, d = x / 3, d
    norm = torch.nn.LayerNorm(n, eps=eps)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
        norm.bias.normal_(0, 0.1)
    assert supports(x, d, norm.weight, norm.bias)
    residual, normed = launch(x, d, norm.weight.detach(), norm.bias.detach(), norm.eps)
    want = x + d
    assert torch.equal(residual, want), (rows, n)
    worst[(rows, n)] = (normed - norm(want)).abs().max().item() if rows else 0.0
assert not supports(torch.zeros(2, 4), torch.zeros(2, 4), None, None)
assert not supports(torch.zeros(4, 2).t(), torch.zeros(2, 4), torch.zeros(4), torch.zeros(4))
assert not supports(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(3), torch.zeros(3))
wide = [torch.zeros(2, 4, dtype=torch.float64)] * 2 + [torch.zeros(4, dtype=torch.float64)] * 2
assert not supports(*wide)
n = MAX_COLUMNS + 1  # a row wider than the registers hold: the plain ops serve it
assert not supports(torch.zeros(1, n), torch.zeros(1, n), torch.zeros(n), torch.zeros(n))
assert supports(torch.zeros(1, n - 1), torch.zeros(1, n - 1), torch.zeros(n - 1), torch.zeros(n - 1))
print(worst)
assert max(worst.values()) < 1e-5, worst
"""


def test_kernel_matches_add_then_layer_norm_under_the_interpreter():
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_qwen3_tower_runs_its_own_block_loop_and_matches_transformers(monkeypatch):
    """The encoder's Qwen3-VL forward never calls transformers' block forward (its own loop fuses
    the adds with the norms), and still gives what transformers' tower gives, deepstack included;
    the loop switched off gives the same. (That the exact-segments hint still reaches every layer
    is `test_padded_forward.py`'s hint test; that `max_seqlen` does, the GPU runner tests: without
    it transformers reads it from the device in every layer, which breaks graph capture.)"""
    encoder = from_preset("qwen3-vl-tiny", seed=3)
    with torch.no_grad():  # every norm its own (initialised, they are all the identity)
        for module in encoder.tower.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1, 0.2)
                module.bias.normal_(0, 0.2)
    reference = reference_tower(encoder)
    pre = encoder.preprocessor
    rng = np.random.default_rng(3)
    resized = pre.resize_image(random_image(rng, 150, 230))
    spec = pre.spec("image", 1, *resized.shape[-2:])
    pixels = pre.pixel_values([resized], "image")
    expected, expected_deepstack = reference_item(reference, pixels, spec.grid_thw)

    def refuse(*args, **kwargs):
        raise AssertionError("transformers' block forward ran")

    with monkeypatch.context() as patch:
        patch.setattr(modeling_qwen3_vl.Qwen3VLVisionBlock, "forward", refuse)
        fused = encoder.forward_eager(pixels, [spec])
    encoder.fused_residual_norms = False
    plain = encoder.forward_eager(pixels, [spec])
    for out in (fused, plain):
        assert relative_error(out.tokens, expected) < 1e-5
        assert relative_error(out.deepstack, expected_deepstack) < 1e-5
    assert fused.deepstack.shape[0] == len(encoder.tower.deepstack_visual_indexes) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_fused_op_in_a_cuda_graph_matches_the_plain_ops(compiled):
    """bf16 at Qwen3-VL's width and an odd row count, eagerly and compiled (inductor launches the
    kernel itself), captured in a CUDA graph, against the plain ops in float32."""
    from encoder_graphs.selfcheck import captured

    torch.manual_seed(0)
    cuda = torch.device("cuda")
    norm = torch.nn.LayerNorm(1152, eps=1e-6, device=cuda, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
        norm.bias.normal_(0, 0.1)
    x, d = (torch.randn(6271, 1152, device=cuda, dtype=torch.bfloat16) for _ in range(2))
    # The kernel serves this (else the check below would only test the plain ops).
    assert qwen3_vl.add_layer_norm is not None and qwen3_vl.triton_norm.supports(x, d, norm.weight, norm.bias)
    fn = qwen3_vl.residual_layer_norm
    if compiled:
        fn = torch.compile(fn, dynamic=True, fullgraph=True)
    outputs = {}

    def run():
        outputs["residual"], outputs["normed"] = fn(x, d, norm)

    with torch.no_grad():
        captured(run).replay()
        torch.cuda.synchronize()
        want = x.float() + d.float()
        reference = torch.nn.functional.layer_norm(want, (1152,), norm.weight.float(), norm.bias.float(), 1e-6)
    assert relative_error(outputs["residual"], want) < 1e-2
    assert relative_error(outputs["normed"], reference) < 2e-2
    assert torch.equal(outputs["residual"], x + d)  # rounded as the bf16 add rounds it
