"""Image files from untrusted bytes: open only allowed formats, check sizes from the header, decode.

Pillow is asked to try only the allowed formats' plugins, so an unusual or malformed file
of another format never reaches a plugin's parser on the decode path (a disallowed format is
only named, for the 415 message). A JPEG's scans are counted before decoding: a progressive
file can repeat a scan thousands of times and take minutes to decode within every size limit.
Decoding follows what transformers' `load_image` does: EXIF orientation applied,
transparency composited on white.
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np
from PIL import Image, ImageOps

from ..config import Limits
from ..errors import item_error

# Our pixel limit (`max_image_pixels`) is checked from the header right after `Image.open`,
# which reads only the header; Pillow's own check would fire first with a less useful error.
Image.MAX_IMAGE_PIXELS = None
Image.init()  # register every plugin now: `Image.open(formats=...)` looks formats up in the registry

JPEG_FORMATS = ("JPEG", "MPO")
OPENED_AS = {"MPO": "JPEG"}
"""Formats Pillow opens through another format's plugin (which then reports the real one)."""
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I")


def decode_base64(data: str, index: int, limits: Limits) -> bytes:
    """Bytes of a base64 string (a `data:` URL prefix and line breaks are accepted), size checked first."""
    if data.startswith("data:"):
        data = data.partition(",")[2]
    elif data[:8].strip().lower().startswith(("http://", "https://", "file:")):
        raise item_error(index, 400, "is a URL: nothing is fetched; send the file's bytes in base64 or as a data: URL")
    if any(c in data for c in " \r\n\t"):
        data = "".join(data.split())
    size = len(data) * 3 // 4 - (len(data) - len(data.rstrip("=")))
    if size > limits.max_item_bytes:
        raise item_error(index, 413, f"decoded size {size} bytes exceeds max_item_bytes={limits.max_item_bytes}")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise item_error(index, 400, "is not valid base64") from None


def check_item_bytes(data: bytes, index: int, limits: Limits) -> None:
    if not data:
        raise item_error(index, 400, "is empty (0 bytes)")
    if len(data) > limits.max_item_bytes:
        raise item_error(index, 413, f"{len(data)} bytes exceeds max_item_bytes={limits.max_item_bytes}")


def check_pixels(width: int, height: int, index: int, limits: Limits, what: str = "") -> None:
    if width * height > limits.max_image_pixels:
        raise item_error(
            index,
            413,
            f"{what}{width}x{height} = {width * height} pixels exceeds max_image_pixels={limits.max_image_pixels}",
        )
    if width == 0 or height == 0:
        raise item_error(index, 400, f"has zero size ({width}x{height})")


def _format_of(data: bytes) -> str | None:
    """The format Pillow would read `data` as, trying every plugin (header only, never decoded)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.format
    except Exception:  # a plugin of a format we refuse anyway may raise anything on a malformed header
        return None


def open_image(data: bytes, index: int, limits: Limits) -> Image.Image:
    """A lazily opened image whose bytes, format, header pixels and (JPEG) scans are within limits."""
    check_item_bytes(data, index, limits)
    allowed = limits.allowed_image_formats
    try:
        image = Image.open(io.BytesIO(data), formats=sorted({OPENED_AS.get(f, f) for f in allowed} & set(Image.OPEN)))
    except Exception:  # refused or malformed: name a disallowed format, else the file is not an image
        image = None
    found = _format_of(data) if image is None else image.format
    if found is not None and found not in allowed:
        raise item_error(index, 415, f"format {found} is not in allowed_image_formats={allowed}")
    if image is None:
        raise item_error(index, 400, "is not a decodable image")
    check_pixels(*image.size, index, limits)
    if image.format in JPEG_FORMATS:
        scans = data.count(b"\xff\xda")  # SOS markers; byte stuffing keeps them out of scan data
        if scans > limits.max_jpeg_scans:
            raise item_error(index, 413, f"JPEG has {scans} scans, over max_jpeg_scans={limits.max_jpeg_scans}")
    return image


def draft_for(image: Image.Image, target: tuple[int, int]) -> None:
    """Let a JPEG decode at 1/2, 1/4 or 1/8 scale when the model downscales to `target` (h, w)
    anyway: the DCT-domain reduction never goes below the target size."""
    if image.format in JPEG_FORMATS:
        image.draft("RGB", (target[1], target[0]))


def to_rgb_array(image: Image.Image, index: int) -> np.ndarray:
    """Decode to `[H, W, 3]` uint8 RGB: first frame, EXIF-rotated, alpha on white, 16-bit scaled to 8."""
    try:
        if getattr(image, "fp", None) is not None:  # a file still open: its first frame
            image.seek(0)  # (one unpickled from a handle call holds only its pixels, no file to seek)
        image = ImageOps.exif_transpose(image)
        if image.mode in SIXTEEN_BIT_MODES:
            array = np.asarray(image, dtype=np.uint32)
            scale = 257 if image.mode != "I" or array.max() > 255 else 1
            image = Image.fromarray((array // scale).clip(0, 255).astype(np.uint8), mode="L")
        if "A" in image.getbands() or "transparency" in image.info:
            rgba = image.convert("RGBA")
            image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        return np.asarray(image.convert("RGB"))
    except MemoryError:
        raise item_error(index, 413, "needs more memory to decode than the service allows") from None
    except Exception:  # any failure inside a codec on untrusted bytes is the file's fault
        raise item_error(index, 400, "is truncated or corrupt and cannot be decoded") from None
