"""GPU: InternVL3-8B's vision tower in CUDA graphs is as accurate as transformers' own bf16 path."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from encoder_graphs.config import GraphConfig
from encoder_graphs.selfcheck import back_to_back_ms
from models import from_preset, transformers_tower
from tests.helpers import random_image, relative_error, warmed

DEVICE = torch.device("cuda")
pytestmark = pytest.mark.gpu

PRESET = "internvl3-8b"
TOKEN_BUDGET = 2048  # 8 tiles: the largest pack below
RESULTS_DIR = Path(os.environ.get("RESULTS_DIR", "/tmp/vlm-encoder-results"))  # not the checkout
PACKS = {
    "1 tile": [(448, 448)],
    "7 tiles + thumbnail": [(300, 2100)],
    "8 images of 1 tile": [(448, 448)] * 8,
}
"""(height, width) of each pack's images."""


@pytest.fixture(scope="module")
def models():
    """(our bf16 encoder, transformers fp32, transformers bf16) on the same random weights."""
    encoder = from_preset(PRESET, dtype=torch.bfloat16, device="cuda", seed=0)
    return encoder, transformers_tower(encoder, dtype=torch.float32), transformers_tower(encoder, dtype=torch.bfloat16)


def packs(encoder, rng):
    """{name: (original uint8 images, resized tiles, specs)}."""
    pre = encoder.preprocessor
    out = {}
    for name, sizes in PACKS.items():
        images = [random_image(rng, h, w) for h, w in sizes]
        out[name] = (images, [pre.resize_image(i) for i in images], [pre.image_spec(*i.shape[-2:]) for i in images])
    assert [s.grid_thw[0] for s in out["7 tiles + thumbnail"][2]] == [8]
    return out


def processor_tiles(encoder, image: torch.Tensor) -> torch.Tensor:
    """`[tiles, 3, 448, 448]` float32 on the GPU: the image processor's own tiles, cut on the CPU as
    the router cuts them (bicubic resizing on the GPU rounds differently)."""
    processor = encoder.preprocessor.image_processor
    return processor(images=[image], crop_to_patches=True, return_tensors="pt")["pixel_values"].to(DEVICE)


def errors(encoder, fp32, bf16, images, tokens: list[torch.Tensor]) -> tuple[float, float]:
    """(our worst relative error, transformers bf16's) against transformers fp32, item by item; the
    references take the image processor's own tiles."""
    ours = reference = 0.0
    for image, got in zip(images, tokens):
        pixels = processor_tiles(encoder, image)
        with torch.inference_mode():
            exact = fp32.get_image_features(pixels.float()).pooler_output.flatten(0, 1)
            approx = bf16.get_image_features(pixels.to(torch.bfloat16)).pooler_output.flatten(0, 1)
        ours = max(ours, relative_error(got, exact))
        reference = max(reference, relative_error(approx, exact))
    return ours, reference


def test_graph_error_is_within_1_5x_of_transformers_bf16(models):
    encoder, fp32, bf16 = models
    layout = encoder.pack_layout(TOKEN_BUDGET, 1024, 64)
    pixels = torch.zeros(TOKEN_BUDGET * encoder.merge_unit, encoder.patch_dim, dtype=encoder.dtype, device="cuda")
    encoder.forward_padded(pixels, {}, layout)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = encoder.forward_padded(pixels, {}, layout)

    results = []
    for name, (images, resized, specs) in packs(encoder, np.random.default_rng(0)).items():
        values = encoder.preprocessor.pixel_values(resized, "image", device="cuda")
        pixels.zero_()
        pixels[: values.shape[0]].copy_(values)
        graph.replay()
        bounds = np.cumsum([0] + [s.output_tokens for s in specs]).tolist()
        tokens = [static_out.tokens[a:b] for a, b in zip(bounds, bounds[1:])]
        graph_error, reference_error = errors(encoder, fp32, bf16, images, tokens)
        tiles = torch.cat([processor_tiles(encoder, image) for image in images])
        with torch.inference_mode():
            hf_ms = back_to_back_ms(lambda: bf16.get_image_features(tiles.to(torch.bfloat16)), DEVICE, 5, 1)
        row = {
            "pack": name,
            "tiles": sum(s.grid_thw[0] for s in specs),
            "graph_error": graph_error,
            "transformers_bf16_error": reference_error,
            "graph_replay_ms": round(back_to_back_ms(graph.replay, DEVICE, repeats=5, warmup=1), 3),
            "transformers_sdpa_ms": round(hf_ms, 3),
        }
        results.append(row)
        assert graph_error <= 1.5 * reference_error, row

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    record = {
        "test": "tests/models/test_gpu_internvl.py",
        "preset": PRESET,
        "token_budget": TOKEN_BUDGET,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "packs": results,
    }
    (RESULTS_DIR / f"models_graph_parity_{PRESET}.json").write_text(json.dumps(record, indent=2))


def test_runner_captures_checks_and_serves_tile_packs(models):
    """The runner's own capture and self-check (synthetic packs) keep every graph; its packs are as
    accurate as transformers' bf16."""
    encoder, fp32, bf16 = models
    runner = warmed(encoder, GraphConfig(budgets=(256, 512, 1024, 2048), min_seqlen_bucket=1024))
    assert all(entry.live for entry in runner.entries.values()), {
        key: entry.self_check_error for key, entry in runner.entries.items()
    }
    for name, (images, resized, specs) in packs(encoder, np.random.default_rng(1)).items():
        values = encoder.preprocessor.pixel_values(resized, "image", device="cuda").to(encoder.dtype)
        outputs = runner.run(values, specs)
        graph_error, reference_error = errors(encoder, fp32, bf16, images, [o.tokens for o in outputs])
        assert graph_error <= 1.5 * reference_error, (name, graph_error, reference_error)
    assert runner.stats.snapshot()["disabled_graphs"] == 0
