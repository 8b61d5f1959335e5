"""Preprocessing with transformers' own image and video processors, split in two halves.

- Host half (the router): `image_spec` / `video_spec` give exact token counts from the size
  alone (the processor's own `smart_resize` rule), and `resize_image` / `resize_video` run
  the processor's own resize on uint8 pixels. What travels to a replica is uint8.
- Device half (the encoder replica): `pixel_values` runs the same processor with
  `do_resize=False` on the replica's device: rescale, normalize and patchify.

Both halves together equal one ordinary processor call, bit for bit (the torchvision
processors resize in uint8 and normalize afterwards); tests hold this.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.image_utils import SizeDict

from .protocol import ItemSpec, Modality

MAX_ASPECT_RATIO = 200
"""The Qwen processors refuse images whose long side exceeds 200x the short side."""

ImageRule = Callable[..., tuple[int, int]]
VideoRule = Callable[..., tuple[int, int]]


class InvalidItemError(ValueError):
    """An image or video the model cannot take (zero size, extreme aspect ratio, no frames)."""


@dataclass(frozen=True)
class ResizeRules:
    """The family's resize rules, as the processors' own `smart_resize` functions."""

    image: ImageRule
    """`(height, width, factor, min_pixels, max_pixels) -> (h, w)`."""
    video: VideoRule
    """`(num_frames, height, width, factor, temporal_factor, min_pixels, max_pixels) -> (h, w)`."""


def _check_geometry(height: int, width: int, what: str) -> None:
    if height <= 0 or width <= 0:
        raise InvalidItemError(f"{what} has zero size ({width}x{height})")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise InvalidItemError(
            f"{what} aspect ratio {ratio:.1f} ({width}x{height}) exceeds the model's limit of {MAX_ASPECT_RATIO}"
        )


class VisionPreprocessor:
    """A model's image and video processors plus the token arithmetic that goes with them."""

    def __init__(self, image_processor, video_processor, rules: ResizeRules):
        self.image_processor = image_processor
        self.video_processor = video_processor
        self.rules = rules
        self.patch_size = int(image_processor.patch_size)
        self.merge_size = int(image_processor.merge_size)
        self.temporal_patch_size = int(image_processor.temporal_patch_size)
        self.merge_unit = self.merge_size**2
        self.factor = self.patch_size * self.merge_size

    @property
    def min_item_tokens(self) -> int:
        """Output tokens of the smallest image the processor produces."""
        min_pixels = self.image_processor.size["shortest_edge"]
        return max(1, min_pixels // self.patch_size**2 // self.merge_unit)

    # ---- host half: sizes and token counts ----

    def resized_image_size(self, height: int, width: int) -> tuple[int, int]:
        _check_geometry(height, width, "image")
        size = self.image_processor.size
        return self.rules.image(
            height, width, factor=self.factor, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]
        )

    def resized_video_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        if num_frames < 1:
            raise InvalidItemError("video has no frames")
        _check_geometry(height, width, "video frame")
        size = self.video_processor.size
        return self.rules.video(
            num_frames,
            height,
            width,
            factor=self.factor,
            temporal_factor=self.temporal_patch_size,
            min_pixels=size["shortest_edge"],
            max_pixels=size["longest_edge"],
        )

    def spec(self, modality: Modality, num_frames: int, resized_height: int, resized_width: int) -> ItemSpec:
        """The item spec of already-resized pixels (the grid the processor will report)."""
        grid_t = 1 if modality == "image" else math.ceil(num_frames / self.temporal_patch_size)
        grid = (grid_t, resized_height // self.patch_size, resized_width // self.patch_size)
        patches = grid[0] * grid[1] * grid[2]
        return ItemSpec(modality, grid, patches, patches // self.merge_unit)

    def image_spec(self, height: int, width: int) -> ItemSpec:
        """Exact token count of an image of this size, without resizing it."""
        return self.spec("image", 1, *self.resized_image_size(height, width))

    def video_spec(self, num_frames: int, height: int, width: int) -> ItemSpec:
        """Exact token count of a video of `num_frames` frames of this size."""
        return self.spec("video", num_frames, *self.resized_video_size(num_frames, height, width))

    # ---- host half: resizing uint8 pixels ----

    def resize_image(self, image: torch.Tensor) -> torch.Tensor:
        """`[3, H, W]` uint8 RGB -> `[3, h, w]` uint8, with the processor's own resize."""
        height, width = self.resized_image_size(*image.shape[-2:])
        proc = self.image_processor
        if (height, width) == tuple(image.shape[-2:]):
            return image
        return proc.resize(image[None], size=SizeDict(**dict(proc.size)), resample=proc.resample, factor=self.factor)[0]

    def resize_video(self, frames: torch.Tensor) -> torch.Tensor:
        """`[T, 3, H, W]` uint8 RGB -> `[T, 3, h, w]` uint8, with the processor's own resize."""
        height, width = self.resized_video_size(*frames.shape[:1], *frames.shape[-2:])
        if (height, width) == tuple(frames.shape[-2:]):
            return frames
        proc = self.video_processor
        return proc.resize(
            frames[None],
            size=SizeDict(**dict(proc.size)),
            resample=proc.resample,
            factor=self.factor,
            temporal_factor=self.temporal_patch_size,
            cap_pixels_per_frame=False,
        )[0]

    # ---- device half ----

    def pixel_values(
        self, resized: Sequence[torch.Tensor], modality: Modality, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Rescale, normalize and patchify resized uint8 items on `device`: `[patches, patch_dim]` float32,
        items concatenated in order (the processor's own layout)."""
        if modality == "image":
            out = self.image_processor(
                images=list(resized),
                do_resize=False,
                return_tensors="pt",
                device=device,
                input_data_format="channels_first",
            )
            return out["pixel_values"]
        out = self.video_processor(
            videos=list(resized),
            do_resize=False,
            do_sample_frames=False,
            cap_pixels_per_frame=False,
            return_tensors="pt",
            device=device,
            input_data_format="channels_first",
        )
        return out["pixel_values_videos"]
