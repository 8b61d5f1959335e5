"""Encode one generated image with a preset's tower: `python -m models.demo [preset]`."""

from __future__ import annotations

import sys

import numpy as np
import torch

from .loading import from_preset


def main(preset: str = "qwen3-vl-tiny") -> None:
    encoder = from_preset(preset)
    pre = encoder.preprocessor
    gradient = np.linspace(0, 255, 320 * 240 * 3).reshape(3, 240, 320).astype(np.uint8)
    resized = pre.resize_image(torch.from_numpy(gradient))
    spec = pre.spec("image", 1, *resized.shape[-2:])
    out = encoder.forward_eager(pre.pixel_values([resized], "image"), [spec])
    print(f"{encoder.name}: image 320x240 -> grid {spec.grid_thw}, embeddings {tuple(out.tokens.shape)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
