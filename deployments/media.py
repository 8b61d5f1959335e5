"""Decoding images and videos on the router, with limits checked before anything large is allocated.

Order of checks for each item: encoded bytes, then (from the header, before decoding)
format and pixels, then frames, then output tokens (from the processor's resize rule).
Pixels are decoded only after all of them pass. Decoding follows what transformers'
`load_image` does: EXIF orientation applied, transparency composited on white.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from transformers.video_utils import VideoMetadata

from models.processing import InvalidItemError, VisionPreprocessor
from models.protocol import ItemSpec

from .config import Limits
from .errors import RequestError, item_error

# Our own pixel limit (`max_image_pixels`) is checked from the header right after `Image.open`,
# which reads only the header; Pillow's check would fire first with a less useful error.
Image.MAX_IMAGE_PIXELS = None


@dataclass
class DecodedItem:
    """One item after decoding and resizing: what travels to an encoder replica."""

    pixels: torch.Tensor
    """uint8 `[3, h, w]` (image) or `[T, 3, h, w]` (video), already resized by the processor's rule;
    InternVL: `[tiles, 3, h, w]` for both (an image's tiles, a video's frames)."""
    spec: ItemSpec
    key: bytes | None = None
    """Content hash for the cache and in-flight dedup (None: the request opted out)."""


def decode_base64(data: str, index: int, limits: Limits) -> bytes:
    """Bytes of a base64 string (a `data:` URL prefix and line breaks are accepted), size checked first."""
    if data.startswith("data:"):
        data = data.partition(",")[2]
    if any(c in data for c in " \r\n\t"):
        data = "".join(data.split())
    size = len(data) * 3 // 4 - (len(data) - len(data.rstrip("=")))
    if size > limits.max_item_bytes:
        raise item_error(index, 413, f"decoded size {size} bytes exceeds max_item_bytes={limits.max_item_bytes}")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise item_error(index, 400, "is not valid base64") from None


def open_image(data: bytes, index: int, limits: Limits) -> Image.Image:
    """A lazily opened image whose bytes, format and header pixels are within limits."""
    if not data:
        raise item_error(index, 400, "is empty (0 bytes)")
    if len(data) > limits.max_item_bytes:
        raise item_error(index, 413, f"{len(data)} bytes exceeds max_item_bytes={limits.max_item_bytes}")
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError):
        raise item_error(index, 400, "is not a decodable image") from None
    if image.format not in limits.allowed_image_formats:
        raise item_error(
            index, 415, f"format {image.format} is not in allowed_image_formats={limits.allowed_image_formats}"
        )
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise item_error(
            index, 413, f"{width}x{height} = {width * height} pixels exceeds max_image_pixels={limits.max_image_pixels}"
        )
    if width == 0 or height == 0:
        raise item_error(index, 400, f"has zero size ({width}x{height})")
    return image


def to_rgb_tensor(image: Image.Image, index: int) -> torch.Tensor:
    """Decode to `[3, H, W]` uint8 RGB: EXIF-rotated, alpha on white, 16-bit scaled to 8."""
    try:
        image.seek(0)  # animated images: the first frame
        image = ImageOps.exif_transpose(image)
        if image.mode in ("I;16", "I;16B", "I;16L", "I"):
            array = np.asarray(image, dtype=np.uint32)
            scale = 257 if image.mode != "I" or array.max() > 255 else 1
            image = Image.fromarray((array // scale).clip(0, 255).astype(np.uint8), mode="L")
        if "A" in image.getbands() or "transparency" in image.info:
            rgba = image.convert("RGBA")
            image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        array = np.asarray(image.convert("RGB"))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise item_error(index, 400, "is truncated or corrupt and cannot be decoded") from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def check_spec(spec_fn, index: int, limits: Limits) -> ItemSpec:
    """The item's spec from the processor's rule; refuses bad geometry and too many tokens."""
    try:
        spec = spec_fn()
    except InvalidItemError as exc:
        raise item_error(index, 400, str(exc)) from None
    if spec.output_tokens > limits.max_tokens_per_item:
        raise item_error(
            index, 413, f"{spec.output_tokens} output tokens exceeds max_tokens_per_item={limits.max_tokens_per_item}"
        )
    return spec


@dataclass
class InspectedItem:
    """An item whose limits were checked from headers alone; `decode` allocates its pixels."""

    index: int
    modality: str
    images: list[Image.Image]
    spec: ItemSpec
    video: bytes | None = None
    """An encoded video file (decoded with PyAV); `frame_indices` are the frames to keep."""
    frame_indices: list[int] | None = None


def inspect_image(data: bytes, index: int, limits: Limits, pre: VisionPreprocessor) -> InspectedItem:
    image = open_image(data, index, limits)
    width, height = image.size
    spec = check_spec(lambda: pre.image_spec(height, width), index, limits)
    return InspectedItem(index, "image", [image], spec)


def check_pil_pixels(image: Image.Image, index: int, limits: Limits) -> None:
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise item_error(
            index, 413, f"{width}x{height} = {width * height} pixels exceeds max_image_pixels={limits.max_image_pixels}"
        )


def inspect_pil(image: Image.Image, index: int, limits: Limits, pre: VisionPreprocessor) -> InspectedItem:
    """An already decoded PIL image (from the Python handle): pixel and token limits only."""
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise item_error(
            index, 413, f"{width}x{height} = {width * height} pixels exceeds max_image_pixels={limits.max_image_pixels}"
        )
    spec = check_spec(lambda: pre.image_spec(height, width), index, limits)
    return InspectedItem(index, "image", [image], spec)


def inspect_frames(frames: list[bytes], index: int, limits: Limits, pre: VisionPreprocessor) -> InspectedItem:
    """A video given as encoded frames (all the same size)."""
    if not frames:
        raise item_error(index, 400, "video has no frames")
    if len(frames) > limits.max_video_frames:
        raise item_error(index, 413, f"{len(frames)} frames exceeds max_video_frames={limits.max_video_frames}")
    if sum(len(f) for f in frames if isinstance(f, (bytes, bytearray))) > limits.max_item_bytes:
        raise item_error(index, 413, f"frames total more than max_item_bytes={limits.max_item_bytes}")
    images = [f if isinstance(f, Image.Image) else open_image(bytes(f), index, limits) for f in frames]
    for image in images:
        check_pil_pixels(image, index, limits)
    sizes = {image.size for image in images}
    if len(sizes) != 1:
        raise item_error(index, 400, f"video frames differ in size: {sorted(sizes)}")
    width, height = images[0].size
    spec = check_spec(lambda: pre.video_spec(len(images), height, width), index, limits)
    return InspectedItem(index, "video", images, spec)


def _video_frame_count(data: bytes, index: int) -> tuple[int, float, int, int]:
    """(frames, fps, width, height) from the container, counting packets (no decoding)."""
    import av  # only video files need PyAV

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise item_error(index, 400, "video file has no video stream")
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0) or 1.0
            width, height = stream.codec_context.width, stream.codec_context.height
            frames = sum(1 for packet in container.demux(stream) if packet.size)
    except av.FFmpegError:
        raise item_error(index, 400, "is not a decodable video file") from None
    if frames == 0:
        raise item_error(index, 400, "video file has no frames")
    return frames, fps, width, height


def sample_frame_indices(pre: VisionPreprocessor, frames: int, fps: float) -> list[int]:
    """The model's own frame sampling (its video processor's `sample_frames`, at its fps or 2)."""
    processor = pre.video_processor
    target_fps = getattr(processor, "fps", None) or 2.0
    metadata = VideoMetadata(total_num_frames=frames, fps=fps, duration=frames / fps)
    try:
        indices = processor.sample_frames(metadata=metadata, fps=target_fps)
    except (ValueError, ZeroDivisionError):  # clips shorter than the sampler's minimum: keep them whole
        return list(range(frames))
    return sorted({int(i) for i in indices}) or list(range(frames))


def inspect_video(data: bytes, index: int, limits: Limits, pre: VisionPreprocessor) -> InspectedItem:
    """An encoded video file: container header and packet count only; frames sampled as the model does."""
    if not data:
        raise item_error(index, 400, "is empty (0 bytes)")
    if len(data) > limits.max_item_bytes:
        raise item_error(index, 413, f"{len(data)} bytes exceeds max_item_bytes={limits.max_item_bytes}")
    frames, fps, width, height = _video_frame_count(data, index)
    if width * height > limits.max_image_pixels:
        raise item_error(
            index,
            413,
            f"frames of {width}x{height} = {width * height} pixels exceed max_image_pixels={limits.max_image_pixels}",
        )
    indices = sample_frame_indices(pre, frames, fps)
    if len(indices) > limits.max_video_frames:
        raise item_error(
            index, 413, f"{len(indices)} sampled frames exceeds max_video_frames={limits.max_video_frames}"
        )
    spec = check_spec(lambda: pre.video_spec(len(indices), height, width), index, limits)
    return InspectedItem(index, "video", [], spec, video=data, frame_indices=indices)


def decode_video_frames(item: InspectedItem) -> list[torch.Tensor]:
    """The sampled frames as `[3, H, W]` uint8 tensors, decoding no further than the last one."""
    import av

    wanted, frames = set(item.frame_indices), []
    try:
        with av.open(io.BytesIO(item.video)) as container:
            for number, frame in enumerate(container.decode(video=0)):
                if number in wanted:
                    frames.append(torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1).contiguous())
                if number >= item.frame_indices[-1]:
                    break
    except av.FFmpegError:
        raise item_error(item.index, 400, "video is truncated or corrupt and cannot be decoded") from None
    if len(frames) != len(wanted):
        raise item_error(item.index, 400, f"video has {len(frames)} decodable frames of the {len(wanted)} sampled")
    return frames


def check_request_tokens(items: list[InspectedItem], limits: Limits) -> None:
    tokens = sum(item.spec.output_tokens for item in items)
    if tokens > limits.max_tokens_per_request:
        raise RequestError(
            413,
            f"request needs {tokens} output tokens, over max_tokens_per_request={limits.max_tokens_per_request}",
            param="items",
        )


def decode(item: InspectedItem, limits: Limits, pre: VisionPreprocessor) -> DecodedItem:
    """Decode and resize an inspected item (CPU work: run it off the event loop)."""
    if item.video is not None:
        tensors = decode_video_frames(item)
    else:
        tensors = [to_rgb_tensor(image, item.index) for image in item.images]
    if len({tuple(t.shape) for t in tensors}) != 1:
        raise item_error(item.index, 400, "video frames differ in size after EXIF rotation")
    height, width = tensors[0].shape[-2:]
    if item.modality == "image":  # EXIF rotation may swap the sides
        spec = check_spec(lambda: pre.image_spec(height, width), item.index, limits)
        return DecodedItem(pre.resize_image(tensors[0]), spec)
    spec = check_spec(lambda: pre.video_spec(len(tensors), height, width), item.index, limits)
    return DecodedItem(pre.resize_video(torch.stack(tensors)), spec)
