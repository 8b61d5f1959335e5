"""Shared test helpers: the independent reference and random media."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from models import transformers_tower

FAMILY_TINY = {"qwen2-vl": "qwen2-vl-tiny", "qwen2.5-vl": "qwen2.5-vl-tiny", "qwen3-vl": "qwen3-vl-tiny"}


def reference_tower(encoder) -> torch.nn.Module:
    """A copy of the encoder's transformers tower that runs its own way (sdpa, its own metadata)."""
    return transformers_tower(encoder)


@torch.inference_mode()
def reference_item(tower, pixel_values: torch.Tensor, grid_thw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' tower on one item, as users call it: merged tokens and deepstack (stacked) or None."""
    device = next(tower.parameters()).device
    out = tower(pixel_values.to(device), grid_thw=torch.tensor([list(grid_thw)], device=device))
    deepstack = getattr(out, "deepstack_features", None)
    return out.pooler_output, (torch.stack(deepstack) if deepstack else None)


@torch.inference_mode()
def reference_tiles(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """transformers' InternVL `get_image_features` on one item's `[tiles, 3, H, W]` pixels, as users
    call it: its tokens tile after tile."""
    device = next(model.parameters()).device
    return model.get_image_features(pixel_values.to(device)).pooler_output.flatten(0, 1)


def warmed(encoder, config=None, **options):
    """An `EncoderRunner` after `prepare` and its whole warm-up, run here synchronously: every
    graph live. `options`: the runner's other arguments (`ladder`, `compiled_forward`)."""
    from encoder_graphs.config import GraphConfig
    from encoder_graphs.runner import EncoderRunner

    runner = EncoderRunner(encoder, config or GraphConfig(), **options)
    runner.prepare(progress=lambda message: None)
    runner.warm_up(progress=lambda message: None)
    return runner


class WithForward:
    """An encoder whose `forward_padded` is replaced (a fault or a delay to inject); everything
    else, `forward_eager` included, is the wrapped encoder's own."""

    def __init__(self, encoder, forward_padded):
        self._encoder, self.forward_padded = encoder, forward_padded

    def __getattr__(self, name):
        return getattr(self._encoder, name)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float32."""
    expected = expected.float()
    return ((actual.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()


def random_image(rng: np.random.Generator, height: int, width: int) -> torch.Tensor:
    """A `[3, H, W]` uint8 image with structure (gradients plus noise), not flat noise."""
    y = np.linspace(0, 1, height)[:, None]
    x = np.linspace(0, 1, width)[None, :]
    base = np.stack(np.broadcast_arrays(y * x, y, x)) * 200
    noise = rng.integers(0, 55, size=(3, height, width))
    return torch.from_numpy((base + noise).astype(np.uint8))


def random_video(rng: np.random.Generator, frames: int, height: int, width: int) -> torch.Tensor:
    """A `[T, 3, H, W]` uint8 clip."""
    return torch.stack([random_image(rng, height, width) for _ in range(frames)])


def encode_file(image: Image.Image, fmt: str = "PNG", **save_args) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save_args)
    return buffer.getvalue()


def model_detail(base_url: str, timeout: float = 30) -> dict:
    """The encoder's operator detail (the router's `detail()`, through the handle of the harness's
    application served at `base_url`): replicas, router stats, one replica's description."""
    from ray import serve

    from tests.serve_harness import ServeHarness

    harness = ServeHarness.current
    prefix = base_url.removeprefix(harness.base_url) or "/"
    name = next(name for name, app in harness.apps.items() if app.route_prefix.rstrip("/") == prefix.rstrip("/"))
    return serve.get_app_handle(name).detail.remote().result(timeout_s=timeout)["encoder"]


def assert_each_item_is_one_block(outputs) -> None:
    """Copied out of a pack, each item is one contiguous block (its tokens, then its deepstack
    levels): a reader takes it as it lies, with nothing to gather."""
    for out in outputs:
        assert out.tokens.is_contiguous()
        if out.deepstack is not None:
            assert out.deepstack.is_contiguous()
            assert out.deepstack.data_ptr() == out.tokens.data_ptr() + out.tokens.nbytes
