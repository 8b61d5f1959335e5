"""GPU: a real-size tower in one CUDA graph is as accurate as transformers' own bf16 path."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from encoder_graphs.selfcheck import back_to_back_ms
from models import attention, from_preset, transformers_tower
from tests.helpers import random_image, random_video, relative_error

DEVICE = torch.device("cuda")
pytestmark = pytest.mark.gpu

TOKEN_BUDGET = 4096
MAX_SEQLEN = 4096  # the longest frame of the packs below (896x896)
RESULTS_DIR = Path(os.environ.get("RESULTS_DIR", "/tmp/vlm-encoder-results"))  # not the checkout


def packs(encoder, rng):
    """Three packs: many small images, one video, mixed sizes."""
    pre = encoder.preprocessor

    def images(sizes):
        resized = [pre.resize_image(random_image(rng, h, w)) for h, w in sizes]
        return "image", resized, [pre.spec("image", 1, *r.shape[-2:]) for r in resized]

    clip = pre.resize_video(random_video(rng, 16, 448, 448))
    return {
        "32 x 224x224": images([(224, 224)] * 32),
        "video 16 x 448x448": ("video", [clip], [pre.spec("video", 16, *clip.shape[-2:])]),
        "mixed 896 + 2x448 + 3x300x500": images([(896, 896), (448, 448), (448, 448)] + [(300, 500)] * 3),
    }


@pytest.mark.parametrize("backend", ["flash", "cudnn", "triton", "fa3"])
@pytest.mark.parametrize("preset", ["qwen2.5-vl-7b", "qwen3-vl-8b"])
def test_graph_error_is_within_1_5x_of_transformers_bf16(preset, backend):
    """Every varlen kernel: FlashAttention-2, cuDNN's where the frontend is installed, ours (Triton),
    FlashAttention-3 where vLLM's build is."""
    if backend == "cudnn" and not attention.cudnn_frontend_available():
        pytest.skip("needs nvidia-cudnn-frontend on Hopper+")
    if backend == "triton" and not attention.triton_available():
        pytest.skip("needs triton on an Ampere or newer GPU")
    if backend == "fa3" and not attention.fa3_available():
        pytest.skip("needs vLLM's FlashAttention-3 build on a Hopper GPU")
    encoder = from_preset(preset, dtype=torch.bfloat16, device="cuda", seed=0, attention=backend)
    assert encoder.attention.kernel == backend
    fp32 = transformers_tower(encoder, dtype=torch.float32)
    bf16_sdpa = transformers_tower(encoder, dtype=torch.bfloat16)

    rows = TOKEN_BUDGET * encoder.merge_unit
    layout = encoder.pack_layout(TOKEN_BUDGET, MAX_SEQLEN, 64)
    pixels = torch.zeros(rows, encoder.patch_dim, dtype=encoder.dtype, device="cuda")
    metadata = {
        name: torch.zeros(spec.shape, dtype=spec.dtype, device="cuda")
        for name, spec in encoder.metadata_specs(layout).items()
    }
    for name, host in encoder.pack_metadata([], layout).items():
        metadata[name].copy_(host)
    encoder.forward_padded(pixels, metadata, layout)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = encoder.forward_padded(pixels, metadata, layout)

    results = []
    for name, (modality, resized, specs) in packs(encoder, np.random.default_rng(0)).items():
        assert sum(s.output_tokens for s in specs) <= TOKEN_BUDGET
        assert max(s.frame_patches for s in specs) <= MAX_SEQLEN
        values = encoder.preprocessor.pixel_values(resized, modality, device="cuda")
        pixels.zero_()
        pixels[: values.shape[0]].copy_(values)
        for key, host in encoder.pack_metadata(specs, layout).items():
            metadata[key].copy_(host)
        graph.replay()
        graph_error = reference_error = 0.0
        row = token = 0
        for spec in specs:
            item = values[row : row + spec.input_patches]
            grid = torch.tensor([list(spec.grid_thw)], device="cuda")
            with torch.inference_mode():
                exact = fp32(item.float(), grid_thw=grid).pooler_output
                bf16 = bf16_sdpa(item, grid_thw=grid).pooler_output
            got = static_out.tokens[token : token + spec.output_tokens]
            graph_error = max(graph_error, relative_error(got, exact))
            reference_error = max(reference_error, relative_error(bf16, exact))
            row += spec.input_patches
            token += spec.output_tokens
        grids = torch.tensor([list(s.grid_thw) for s in specs], device="cuda")
        with torch.inference_mode():
            reference_ms = back_to_back_ms(lambda: bf16_sdpa(values, grid_thw=grids), DEVICE, repeats=5, warmup=1)
        replay_ms = back_to_back_ms(graph.replay, DEVICE, repeats=5, warmup=1)
        results.append(
            {
                "pack": name,
                "items": len(specs),
                "tokens": token,
                "graph_error": graph_error,
                "transformers_bf16_error": reference_error,
                "graph_replay_ms": round(replay_ms, 3),
                "transformers_sdpa_ms": round(reference_ms, 3),
            }
        )
        assert graph_error <= 1.5 * reference_error, results[-1]

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    record = {
        "test": "tests/models/test_gpu_graph_parity.py",
        "preset": preset,
        "attention": backend,
        "token_budget": TOKEN_BUDGET,
        "max_seqlen": MAX_SEQLEN,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "packs": results,
    }
    (RESULTS_DIR / f"models_graph_parity_{preset}_{backend}.json").write_text(json.dumps(record, indent=2))
