"""Images and videos as files, and the reference encoding of them (transformers, item by item)."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
from PIL import Image, ImageOps

from tests.helpers import reference_item, reference_tiles


def pattern(width: int, height: int, seed: int = 0) -> Image.Image:
    """An RGB test image with gradients and noise."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height)[:, None]
    x = np.linspace(0, 1, width)[None, :]
    base = np.stack(np.broadcast_arrays(x * 255, y * 255, (x * y) * 255), axis=-1)
    noise = rng.integers(0, 40, size=(height, width, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


def image_file(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode_embedding(entry: dict) -> torch.Tensor:
    """An embedding from a /v1/encode response entry (either encoding_format)."""
    if isinstance(entry["embedding"], list):
        return torch.tensor(entry["embedding"], dtype=torch.float32)
    array = np.frombuffer(base64.b64decode(entry["embedding"]), dtype="<f4").reshape(entry["shape"])
    return torch.from_numpy(array.copy())


def reference_image(encoder, tower, data: bytes) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """transformers' processor and tower on the decoded file, as a user would run them (InternVL:
    its image processor tiling as InternVLProcessor asks it to, then `get_image_features`)."""
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    if encoder.family == "internvl":
        pixels = encoder.preprocessor.image_processor(images=[image], crop_to_patches=True, return_tensors="pt")
        return internvl_reference(encoder, tower, pixels["pixel_values"])
    inputs = encoder.preprocessor.image_processor(images=[image], return_tensors="pt")
    grid = inputs["image_grid_thw"][0].tolist()
    tokens, deepstack = reference_item(tower, inputs["pixel_values"], grid)
    return tokens, deepstack, grid


def reference_video(encoder, tower, frames: list[bytes]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    clip = np.stack([np.asarray(Image.open(io.BytesIO(f)).convert("RGB")) for f in frames])
    if encoder.family == "internvl":
        video = torch.from_numpy(clip).permute(0, 3, 1, 2)
        pixels = encoder.preprocessor.video_processor(videos=[video], return_tensors="pt")["pixel_values_videos"]
        return internvl_reference(encoder, tower, pixels[0])
    inputs = encoder.preprocessor.video_processor(
        videos=[torch.from_numpy(clip).permute(0, 3, 1, 2)], do_sample_frames=False, return_tensors="pt"
    )
    grid = inputs["video_grid_thw"][0].tolist()
    tokens, deepstack = reference_item(tower, inputs["pixel_values_videos"], grid)
    return tokens, deepstack, grid


def internvl_reference(encoder, model, pixels: torch.Tensor) -> tuple[torch.Tensor, None, list[int]]:
    """(tokens, no deepstack, grid) of one InternVL item's `[tiles, 3, H, W]` pixels."""
    return reference_tiles(model, pixels), None, [pixels.shape[0], *encoder.preprocessor.tile_grid]
