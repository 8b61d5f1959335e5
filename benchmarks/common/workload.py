"""The benchmarks' request stream: fixed-seed photo-like JPEGs of common sizes and a share of
8-frame clips, and their forms on the wire (HTTP bodies, handle items, decoded pixels)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np

SIZES = [(224, 224), (448, 448), (640, 480), (800, 600), (1024, 768), (1280, 720), (1920, 1080)]
VIDEO_SHARE = 0.1
VIDEO_FRAMES, VIDEO_SIZE = 8, (448, 448)
JSON = {"Content-Type": "application/json"}


def photo(rng: np.random.Generator, width: int, height: int) -> bytes:
    """A photo-like JPEG (smooth gradients, texture, quality 90)."""
    from PIL import Image

    y = np.linspace(0, 1, height)[:, None, None]
    x = np.linspace(0, 1, width)[None, :, None]
    tint = rng.uniform(0, 255, (1, 1, 3))
    base = (x * tint + y * (255 - tint)) * 0.8 + rng.normal(0, 12, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def workload(count: int, seed: int = 0) -> list[list]:
    """Requests: lists of items, each JPEG bytes or a list of frames (a video)."""
    rng = np.random.default_rng(seed)
    pool = {size: [photo(rng, *size) for _ in range(4)] for size in SIZES}
    clips = [[photo(rng, *VIDEO_SIZE) for _ in range(VIDEO_FRAMES)] for _ in range(4)]
    requests = []
    for _ in range(count):
        items = []
        for _ in range(int(rng.integers(1, 4))):
            if rng.random() < VIDEO_SHARE:
                items.append(clips[int(rng.integers(0, len(clips)))])
            else:
                items.append(pool[SIZES[int(rng.integers(0, len(SIZES)))]][int(rng.integers(0, 4))])
        requests.append(items)
    return requests


def single_images(count: int, seed: int = 1) -> list[list]:
    """One distinct 448x448 photo per request."""
    rng = np.random.default_rng(seed)
    return [[photo(rng, 448, 448)] for _ in range(count)]


def http_body(items: list, encoding_format: str, service: bool) -> bytes:
    """A `/v1/encode` body of base64 images and videos (`service`: opting out of its embedding cache)."""

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    entries = [
        {"type": "video", "frames": [b64(f) for f in item]}
        if isinstance(item, list)
        else {"type": "image", "image": b64(item)}
        for item in items
    ]
    body = {"items": entries, "encoding_format": encoding_format}
    return json.dumps({**body, "cache": False} if service else body).encode()


def handle_items(items: list) -> list:
    """The items as the handle's `encode` takes them (a video as a dict of its frames)."""
    return [{"type": "video", "frames": item} if isinstance(item, list) else item for item in items]


def decoded_items(pre, requests: list[list]) -> list[tuple]:
    """(resized uint8 pixels, spec) of every item of the requests in order: decoded and resized by
    the preprocessor `pre`, as the router's decode workers do."""
    import torch
    from PIL import Image

    items = []
    for request in requests:
        for item in request:
            frames = item if isinstance(item, list) else [item]
            arrays = [
                torch.from_numpy(np.asarray(Image.open(io.BytesIO(f)).convert("RGB"))).permute(2, 0, 1) for f in frames
            ]
            if isinstance(item, list):
                pixels = pre.resize_video(torch.stack(arrays))
                spec = pre.spec("video", len(frames), *pixels.shape[-2:])
            else:
                pixels = pre.resize_image(arrays[0].contiguous())
                spec = pre.spec("image", 1, *pixels.shape[-2:])
            items.append((pixels, spec))
    return items
