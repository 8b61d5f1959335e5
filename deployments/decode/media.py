"""One item's way from request bytes to resized uint8 pixels, in two steps run by decode workers.

`inspect` reads headers only and checks every per-item limit (bytes, format, pixels, frames,
decode cost, output tokens); the router then checks the request as a whole (tokens, queue
room) before `decode` allocates any pixels. Both run in the decode pool's worker processes
(`decode_pool.py`), never in the router: a parser is the part of the service that untrusted
bytes reach, and a worker that hangs or runs away can be killed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image
from transformers.video_utils import VideoMetadata

from models.processing import InvalidItemError, VisionPreprocessor
from models.protocol import ItemSpec

from ..config import Limits
from ..errors import RequestError, item_error
from . import images, video

ROTATING_ORIENTATIONS = (5, 6, 7, 8)
"""EXIF orientations that swap width and height."""

EXIF_IN_HEADER = ("JPEG", "MPO", "TIFF", "WEBP")

Kind = Literal["image", "frames", "video"]


@dataclass
class RawItem:
    """An item as the request carried it: base64 text (HTTP), bytes, or a PIL image (handle)."""

    index: int
    kind: Kind
    data: Any
    """str | bytes | PIL.Image for "image" and "video"; a list of those for "frames"."""


@dataclass
class Inspection:
    """What the headers said, with every per-item limit checked; no pixels allocated yet."""

    spec: ItemSpec
    data: Any
    """The item's bytes (base64 decoded) or PIL images, handed back to `decode`."""
    source_pixels: int = 0
    """Pixels decoding will produce (the decode pool schedules by it)."""
    probe: video.VideoProbe | None = None
    frame_indices: list[int] | None = None
    """A video file's frames to keep (the model's own sampling)."""


@dataclass
class DecodedItem:
    """One item after decoding and resizing: what travels to an encoder replica."""

    pixels: torch.Tensor
    """uint8 `[3, h, w]` (image) or `[T, 3, h, w]` (video), resized by the processor's rule;
    InternVL: `[tiles, 3, h, w]` for both (an image's tiles, a video's frames)."""
    spec: ItemSpec
    key: bytes | None = field(default=None)
    """Content hash for the cache and in-flight dedup (None: the request opted out)."""


def _bytes(data: Any, index: int, limits: Limits) -> Any:
    if isinstance(data, str):
        data = images.decode_base64(data, index, limits)
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        images.check_item_bytes(data, index, limits)
    return data


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


def _upright_size(image: Image.Image) -> tuple[int, int]:
    """(height, width) after EXIF rotation, from the header. Only formats whose EXIF sits in the
    header are asked (a PNG's may follow its pixels, and reading it would decode them); the spec
    is recomputed after decoding anyway, and the token count is the same either way round."""
    width, height = image.size
    try:
        orientation = image.getexif().get(0x0112) if image.format in EXIF_IN_HEADER else None
    except Exception:  # a malformed EXIF block: decoding will say so
        orientation = None
    return (width, height) if orientation in ROTATING_ORIENTATIONS else (height, width)


def _opened(data: Any, index: int, limits: Limits) -> Image.Image:
    if isinstance(data, Image.Image):
        images.check_pixels(*data.size, index, limits)
        return data
    return images.open_image(data, index, limits)


def _each_frame(frames: list, index: int, step: Callable[[Any], Any]) -> list:
    """`step` of each of an item's frames; an error about one names it (`items[0]: frames[3] ...`)."""
    done = []
    for at, frame in enumerate(frames):
        try:
            done.append(step(frame))
        except RequestError as error:
            message = f"items[{index}]: frames[{at}] " + error.message.removeprefix(f"items[{index}]: ")
            raise type(error)(error.status, message, error.param, error.error_type, error.headers) from None
    return done


def _inspect_frames(frames: list, index: int, limits: Limits, pre: VisionPreprocessor) -> Inspection:
    if not frames:
        raise item_error(index, 400, "video has no frames")
    if len(frames) > limits.max_video_frames:
        raise item_error(index, 413, f"{len(frames)} frames exceeds max_video_frames={limits.max_video_frames}")
    frames = _each_frame(frames, index, lambda f: _bytes(f, index, limits))
    if sum(len(f) for f in frames if isinstance(f, bytes)) > limits.max_item_bytes:
        raise item_error(index, 413, f"frames total more than max_item_bytes={limits.max_item_bytes}")
    sizes = _each_frame(frames, index, lambda f: _upright_size(_opened(f, index, limits)))
    check_frame_list_pixels(sizes, index, limits)
    if len(set(sizes)) != 1:
        raise item_error(index, 400, f"video frames differ in size: {sorted({(w, h) for h, w in sizes})}")
    height, width = sizes[0]
    spec = check_spec(lambda: pre.video_spec(len(frames), height, width), index, limits)
    return Inspection(spec, frames, source_pixels=len(frames) * height * width)


def check_frame_list_pixels(sizes: list[tuple[int, int]], index: int, limits: Limits) -> None:
    """Every frame of a frame list is decoded and kept: bound their pixels, summed from the headers,
    as a video file's decode is bounded (`video.check_decode_cost`)."""
    pixels = sum(height * width for height, width in sizes)
    if pixels > limits.max_frame_list_pixels:
        raise item_error(
            index,
            413,
            f"{len(sizes)} frames of {pixels} pixels in all exceed "
            f"max_frame_list_pixels={limits.max_frame_list_pixels}",
        )


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


def _inspect_video(data: bytes, index: int, limits: Limits, pre: VisionPreprocessor) -> Inspection:
    found = video.probe(data, index, limits)
    images.check_pixels(found.width, found.height, index, limits, what="frames of ")
    indices = sample_frame_indices(pre, found.frames, found.fps)
    if len(indices) > limits.max_video_frames:
        raise item_error(
            index, 413, f"{len(indices)} sampled frames exceeds max_video_frames={limits.max_video_frames}"
        )
    video.check_decode_cost(found, indices[-1], index, limits)
    spec = check_spec(lambda: pre.video_spec(len(indices), found.height, found.width), index, limits)
    pixels = (indices[-1] + 1) * found.width * found.height
    return Inspection(spec, data, pixels, found, indices)


def inspect(raw: RawItem, limits: Limits, pre: VisionPreprocessor) -> Inspection:
    """Headers only: every per-item limit, in order (bytes, format, pixels, frames, cost, tokens)."""
    if raw.kind == "frames":
        return _inspect_frames(raw.data, raw.index, limits, pre)
    data = _bytes(raw.data, raw.index, limits)
    if raw.kind == "video":
        return _inspect_video(data, raw.index, limits, pre)
    height, width = _upright_size(_opened(data, raw.index, limits))
    spec = check_spec(lambda: pre.image_spec(height, width), raw.index, limits)
    return Inspection(spec, data, source_pixels=height * width)


def _image_array(data: Any, index: int, limits: Limits, pre: VisionPreprocessor) -> np.ndarray:
    image = _opened(data, index, limits)
    if limits.jpeg_draft and hasattr(pre, "resized_image_size"):  # a tiling processor keeps full size
        upright = _upright_size(image)
        target = pre.resized_image_size(*upright)
        if upright != image.size[::-1]:  # EXIF rotation swaps the sides; the draft is taken before it
            target = target[::-1]
        images.draft_for(image, target)
    return images.to_rgb_array(image, index)


def decode(raw: RawItem, found: Inspection, limits: Limits, pre: VisionPreprocessor) -> DecodedItem:
    """Decode and resize an inspected item (the processor's own resize); the spec is recomputed
    from the decoded size, which a JPEG draft or EXIF rotation may change."""
    index = raw.index
    if found.probe is not None:
        arrays = video.decode_frames(found.data, found.probe, found.frame_indices, index, limits)
    elif raw.kind == "frames":
        arrays = _each_frame(found.data, index, lambda f: images.to_rgb_array(_opened(f, index, limits), index))
    else:
        arrays = [_image_array(found.data, index, limits, pre)]
    if len({a.shape for a in arrays}) != 1:
        raise item_error(index, 400, "video frames differ in size after EXIF rotation")
    tensors = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)
    height, width = tensors.shape[-2:]
    try:
        if found.spec.modality == "image":
            spec = check_spec(lambda: pre.image_spec(height, width), index, limits)
            return DecodedItem(pre.resize_image(tensors[0].contiguous()).contiguous(), spec)
        spec = check_spec(lambda: pre.video_spec(len(arrays), height, width), index, limits)
        return DecodedItem(pre.resize_video(tensors.contiguous()).contiguous(), spec)
    except RequestError:
        raise
    except (RuntimeError, ValueError) as error:  # resizing a degenerate decode result
        raise item_error(index, 400, f"cannot be resized for the model: {error}") from None


def check_request_tokens(specs: list[ItemSpec], limits: Limits) -> None:
    tokens = sum(spec.output_tokens for spec in specs)
    if tokens > limits.max_tokens_per_request:
        raise RequestError(
            413,
            f"request needs {tokens} output tokens, over max_tokens_per_request={limits.max_tokens_per_request}",
            param="items",
        )
