"""Fixed-size tiles (InternVL): transformers' own tiling, split into the router's and the replica's halves.

An InternVL image becomes 1-12 tiles of the tower's input size plus a thumbnail (when there is
more than one), exactly as `InternVLProcessor` runs `GotOcr2ImageProcessor` (it always passes
`crop_to_patches=True`, the processor's `min_patches`/`max_patches`); a video frame is one tile,
resized by `InternVLVideoProcessor`. Every tile gives the same number of tokens, so an item is
`grid_thw = (tiles, rows, cols)` in patches: one attention segment per tile.

- Host half (the router): `image_spec` / `video_spec` count tiles from the size alone
  (`get_number_of_image_patches`), `resize_image` / `resize_video` run the processors' own
  cropping and resizing on uint8 pixels: `[tiles, 3, H, W]` uint8 travels to a replica.
- Device half (the replica): `pixel_values` rescales and normalizes the tiles with the same
  processors (`do_resize=False`) on the replica's device and cuts them into patch rows.

Both halves together equal one ordinary processor call, bit for bit; tests hold this.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.image_utils import SizeDict

from .processing import InvalidItemError
from .protocol import ItemSpec, Modality


def patch_rows(tiles: torch.Tensor, patch_size: int) -> torch.Tensor:
    """`[N, C, H, W]` -> `[N * (H/p) * (W/p), C * p * p]`: each tile's patches in row-major order, each
    patch flattened as the patch embedding's Conv2d weight is (channel, row, column)."""
    count, channels, height, width = tiles.shape
    grid_h, grid_w = height // patch_size, width // patch_size
    patches = tiles.view(count, channels, grid_h, patch_size, grid_w, patch_size).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(count * grid_h * grid_w, channels * patch_size * patch_size)


def _check_size(height: int, width: int, what: str) -> None:
    if height <= 0 or width <= 0:
        raise InvalidItemError(f"{what} has zero size ({width}x{height})")


class TilePreprocessor:
    """A tiling model's image and video processors plus the token arithmetic that goes with them."""

    def __init__(self, image_processor, video_processor, patch_size: int, merge_unit: int):
        self.image_processor = image_processor
        self.video_processor = video_processor
        tile = image_processor.size
        self.tile_size = (int(tile.height), int(tile.width))
        frame = video_processor.size
        if (frame.height, frame.width) != self.tile_size:
            raise ValueError(
                f"the video processor resizes frames to {frame.height}x{frame.width}, the image processor "
                f"tiles at {self.tile_size[0]}x{self.tile_size[1]}: frames must be tiles"
            )
        if self.tile_size[0] % patch_size or self.tile_size[1] % patch_size:
            raise ValueError(f"tiles of {self.tile_size} pixels are not whole {patch_size}-pixel patches")
        self.patch_size = patch_size
        self.merge_unit = merge_unit
        self.tile_grid = (self.tile_size[0] // patch_size, self.tile_size[1] // patch_size)
        self.tile_patches = self.tile_grid[0] * self.tile_grid[1]
        if self.tile_patches % merge_unit:
            raise ValueError(f"{self.tile_patches} patches per tile do not merge {merge_unit} to a token")
        self.tile_tokens = self.tile_patches // merge_unit

    @property
    def min_item_tokens(self) -> int:
        """Output tokens of the smallest item: one tile."""
        return self.tile_tokens

    # ---- host half: tile counts ----

    def image_tiles(self, height: int, width: int) -> int:
        """Tiles of an image of this size (thumbnail included), as `InternVLProcessor` cuts it."""
        _check_size(height, width, "image")
        return self.image_processor.get_number_of_image_patches(height, width, {"crop_to_patches": True})

    def spec(self, modality: Modality, tiles: int) -> ItemSpec:
        """The item spec of `tiles` tiles (an image's tiles or a video's frames)."""
        return ItemSpec(modality, (tiles, *self.tile_grid), tiles * self.tile_patches, tiles * self.tile_tokens)

    def image_spec(self, height: int, width: int) -> ItemSpec:
        """Exact token count of an image of this size, without resizing it."""
        return self.spec("image", self.image_tiles(height, width))

    def video_spec(self, num_frames: int, height: int, width: int) -> ItemSpec:
        """Exact token count of a video of `num_frames` frames of this size: one tile per frame."""
        if num_frames < 1:
            raise InvalidItemError("video has no frames")
        _check_size(height, width, "video frame")
        return self.spec("video", num_frames)

    # ---- host half: cutting uint8 pixels into tiles ----

    def _tile_size(self) -> SizeDict:
        return SizeDict(height=self.tile_size[0], width=self.tile_size[1])

    def resize_image(self, image: torch.Tensor) -> torch.Tensor:
        """`[3, H, W]` uint8 RGB -> `[tiles, 3, h, w]` uint8: the crop grid then the thumbnail, with the
        processor's own `crop_image_to_patches`."""
        self.image_tiles(*image.shape[-2:])
        proc = self.image_processor
        tiles = proc.crop_image_to_patches(
            image[None], proc.min_patches, proc.max_patches, patch_size=self._tile_size(), resample=proc.resample
        )
        return tiles[0]

    def resize_video(self, frames: torch.Tensor) -> torch.Tensor:
        """`[T, 3, H, W]` uint8 RGB -> `[T, 3, h, w]` uint8 tiles, with the video processor's own resize."""
        self.video_spec(*frames.shape[:1], *frames.shape[-2:])
        if tuple(frames.shape[-2:]) == self.tile_size:
            return frames
        proc = self.video_processor
        return proc.resize(frames[None], size=self._tile_size(), resample=proc.resample)[0]

    # ---- device half ----

    def pixel_values(
        self, resized: Sequence[torch.Tensor], modality: Modality, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Rescale and normalize tiled uint8 items on `device` and cut them into patch rows:
        `[patches, 3 * p * p]` float32, items and their tiles in order."""
        if modality == "image":
            tiles = [tile for item in resized for tile in item]
            out = self.image_processor(
                images=tiles, do_resize=False, crop_to_patches=False, device=device, input_data_format="channels_first"
            )["pixel_values"]
        else:
            out = self.video_processor(
                videos=list(resized),
                do_resize=False,
                do_sample_frames=False,
                device=device,
                input_data_format="channels_first",
            )["pixel_values_videos"]
        return patch_rows(torch.cat([t.reshape(-1, *t.shape[-3:]) for t in out]), self.patch_size)
