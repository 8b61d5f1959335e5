"""Bad and odd inputs over HTTP: each bad one gets its documented 4xx naming the item and the limit,
the service keeps serving right after it, and odd but valid images are encoded as transformers encodes them."""

from __future__ import annotations

import base64
import functools
import io
import itertools
import json
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import av
import httpx
import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from deployments.config import Limits
from deployments.router.schemas import ChatRequest, EncodeRequest
from models import from_preset
from tests.deployments.media_helpers import b64, decode_embedding, image_file, pattern, reference_image
from tests.helpers import model_detail, reference_tower, relative_error

TOLERANCE = 1e-4
DEFAULT_FORMATS = Limits().allowed_image_formats
# The second app: configs/local.yaml with small limits, so each limit is reached with small inputs.
LIMITED = {
    "max_request_bytes": 300_000,
    "max_item_bytes": 50_000,
    "allowed_image_formats": ["PNG"],
    "max_image_pixels": 500_000,
    "max_video_frames": 8,
    "max_tokens_per_item": 100,
    "max_tokens_per_request": 150,
}


# ---- files, made in code ----


def png(width: int, height: int, seed: int = 0) -> bytes:
    return image_file(pattern(width, height, seed), "PNG")


def jpeg(width: int, height: int, seed: int = 0, **save_args) -> bytes:
    buffer = io.BytesIO()
    pattern(width, height, seed).save(buffer, "JPEG", **save_args)
    return buffer.getvalue()


def flat_png(width: int, height: int) -> bytes:
    """A one-colour PNG: a few hundred bytes whatever its size."""
    return image_file(Image.new("RGB", (width, height), (90, 140, 200)), "PNG")


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_chunks(data: bytes) -> dict[bytes, tuple[int, int]]:
    """Chunk type -> (offset of the chunk, length of its data), first of each type."""
    chunks, offset = {}, 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        chunks.setdefault(data[offset + 4 : offset + 8], (offset, length))
        offset += 12 + length
    return chunks


def zero_bit_png(width: int, height: int) -> bytes:
    """A complete, valid 1-bit black PNG of this size: ~1/1000 of its bit count once compressed."""
    compressor, row = zlib.compressobj(9), bytes(1 + (width + 7) // 8)
    rows_per_piece = 1000
    pieces = [compressor.compress(row * min(rows_per_piece, height - y)) for y in range(0, height, rows_per_piece)]
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # bit depth 1, greyscale
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", b"".join(pieces) + compressor.flush())
        + png_chunk(b"IEND", b"")
    )


@functools.cache
def decompression_bomb() -> bytes:
    """50000x50000 pixels (2.5 gigapixels, 312 MB as bits) in ~300 kB."""
    return zero_bit_png(50_000, 50_000)


def png_declaring(width: int, height: int) -> bytes:
    """A PNG header declaring this size, with empty image data."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunks = png_chunk(b"IHDR", header) + png_chunk(b"IDAT", zlib.compress(b"")) + png_chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


def first_half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def flipped(data: bytes, offset: int, count: int) -> bytes:
    damaged = bytearray(data)
    for i in range(offset, offset + count):
        damaged[i] ^= 0xFF
    return bytes(damaged)


def corrupt_jpeg() -> bytes:
    """16 bytes inverted in the middle of the entropy-coded scan data."""
    data = jpeg(64, 64)
    scan = data.index(b"\xff\xda")
    return flipped(data, scan + (len(data) - scan) // 2, 16)


def png_with_bad_header_crc() -> bytes:
    data = png(64, 64)
    offset, length = png_chunks(data)[b"IHDR"]
    return flipped(data, offset + 8 + length, 1)


def png_with_garbage_chunk() -> bytes:
    """64 bytes of noise spliced between IHDR and IDAT."""
    data = png(64, 64)
    offset, _ = png_chunks(data)[b"IDAT"]
    return data[:offset] + np.random.default_rng(0).bytes(64) + data[offset:]


def png_with_damaged_pixels() -> bytes:
    """8 bytes inverted in the middle of IDAT's deflate stream (the CRC left as it was)."""
    data = png(64, 64)
    offset, length = png_chunks(data)[b"IDAT"]
    return flipped(data, offset + 8 + length // 2, 8)


def noise_png(size_bytes: int) -> bytes:
    """A valid PNG of exactly `size_bytes` bytes (noise pixels, then a private ancillary chunk as padding)."""
    side = 64
    data = image_file(Image.fromarray(np.random.default_rng(1).integers(0, 256, (side, side, 3), np.uint8)), "PNG")
    assert len(data) + 12 <= size_bytes, "pixels already fill the size"
    iend, _ = png_chunks(data)[b"IEND"]
    padding = png_chunk(b"prVt", bytes(size_bytes - len(data) - 12))
    return data[:iend] + padding + data[iend:]


def mp4(frames: int = 4, width: int = 64, height: int = 48, fps: int = 4) -> bytes:
    """An H.264 MP4 of moving gradients (they compress well at any size)."""
    y, x = np.mgrid[0:height, 0:width]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("h264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            rgb = np.stack([(x + 8 * i) % 256, (y + 4 * i) % 256, (x + y) % 256], axis=-1).astype(np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def mp4_parts() -> tuple[bytes, bytes]:
    """(the leading `ftyp` box, the rest of the file)."""
    data = mp4()
    (ftyp_size,) = struct.unpack(">I", data[:4])
    return data[:ftyp_size], data[ftyp_size:]


def scrambled_mp4() -> bytes:
    """An MP4 whose every byte after the `ftyp` box is XORed with 0x5A."""
    ftyp, rest = mp4_parts()
    return ftyp + bytes(b ^ 0x5A for b in rest)


def ppm() -> bytes:
    return image_file(pattern(32, 32), "PPM")


TEXT = b"hello, I am not an image nor a video\n" * 10


# ---- request bodies ----

GOOD_FILE = png(64, 64)
GOOD_ITEM = {"type": "image", "image": b64(GOOD_FILE)}
GOOD_GRID = [1, 16, 16]  # 64x64 is below min_pixels=65536: resized to 256x256, 16x16 patches of 16 pixels
GOOD_SHAPE = [64, 96]  # 16*16 patches / (2*2 merge) tokens, out_hidden_size 96
NUM_DEEPSTACK = 2  # the tiny Qwen3-VL preset's deepstack_visual_indexes=[0, 1]


def image(data: bytes) -> dict:
    return {"type": "image", "image": b64(data)}


def image_text(text: str) -> dict:
    """An image item whose `image` string is given as is."""
    return {"type": "image", "image": text}


def video(*frames: bytes) -> dict:
    return {"type": "video", "frames": [b64(f) for f in frames]}


def video_file(data: bytes) -> dict:
    return {"type": "video", "video": b64(data)}


def one(item) -> dict:
    """A request of this one item: the error is about items[0]."""
    return {"items": [item]}


def second(item) -> dict:
    """A request of a good item then this one: the error is about items[1]."""
    return {"items": [GOOD_ITEM, item]}


def mime_base64(data: bytes) -> str:
    """Base64 with a newline every 76 characters, as MIME, `base64` (coreutils) and `base64.encodebytes` write it."""
    return base64.encodebytes(data).decode("ascii")


def padded_json(body: dict, size_bytes: int) -> bytes:
    """Valid JSON of this size: the body followed by whitespace."""
    text = json.dumps(body).encode()
    return text + b" " * (size_bytes - len(text))


@dataclass(frozen=True)
class Case:
    """A bad request and the error the README documents for it."""

    body: Callable[[], dict | bytes]
    """The JSON body, or raw bytes sent as is (Content-Type: application/json)."""
    status: int
    param: str | None
    """The error's `param`: `items[i]` for an item, the field for other schema errors."""
    message: tuple[str, ...] = ()
    """Substrings of the message: for limit errors, the limit with its value and the offending value."""
    app: str = "default"
    """`default` (configs/local.yaml as is) or `limited` (with the LIMITED limits)."""


def case(id, body, status, param, *message, app="default", marks=()) -> pytest.param:
    return pytest.param(Case(body, status, param, message, app), id=id, marks=marks)


CASES = [
    # -- base64 and bytes
    case("invalid base64", lambda: one(image_text("not base64!!")), 400, "items[0]", "base64"),
    case("a URL", lambda: second(image_text("https://example.com/cat.png")), 400, "items[1]", "is a URL", "data: URL"),
    case("base64 with bad padding", lambda: second(image_text("iVBORw0KGgo")), 400, "items[1]", "base64"),
    case("zero bytes", lambda: one(image_text("")), 400, "items[0]", "empty"),
    case("data URL of zero bytes", lambda: one(image_text("data:image/png;base64,")), 400, "items[0]", "empty"),
    case("text, not an image", lambda: second(image(TEXT)), 400, "items[1]", "not a decodable image"),
    # -- damaged files
    case("truncated JPEG", lambda: second(image(first_half(jpeg(64, 64)))), 400, "items[1]", "truncated or corrupt"),
    case("truncated PNG", lambda: second(image(first_half(png(64, 64)))), 400, "items[1]", "truncated or corrupt"),
    case("corrupt JPEG scan data", lambda: one(image(corrupt_jpeg())), 400, "items[0]", "truncated or corrupt"),
    case("PNG with a bad IHDR CRC", lambda: one(image(png_with_bad_header_crc())), 400, "items[0]", "not a decodable"),
    case("PNG with a garbage chunk", lambda: one(image(png_with_garbage_chunk())), 400, "items[0]", "not a decodable"),
    case("PNG with damaged IDAT data", lambda: one(image(png_with_damaged_pixels())), 400, "items[0]", "corrupt"),
    # -- geometry and pixels
    case("1x100000 image", lambda: one(image(flat_png(1, 100_000))), 400, "items[0]", "aspect ratio", "1x100000"),
    case("201x1 image", lambda: second(image(flat_png(201, 1))), 400, "items[1]", "aspect ratio", "201x1"),
    case("PNG declaring 0x10 pixels", lambda: one(image(png_declaring(0, 10))), 400, "items[0]"),
    case(
        "10000x5000 PNG, over max_image_pixels",
        lambda: second(image(zero_bit_png(10_000, 5_000))),
        413,
        "items[1]",
        "50000000 pixels",
        "max_image_pixels=40000000",
    ),
    case(
        "decompression bomb: 50000x50000 PNG of 300 kB",
        lambda: one(image(decompression_bomb())),
        413,
        "items[0]",
        "2500000000 pixels",
        "max_image_pixels=40000000",
    ),
    # -- formats
    case("PPM", lambda: one(image(ppm())), 415, "items[0]", "PPM", f"allowed_image_formats={DEFAULT_FORMATS}"),
    case("ICO", lambda: second(image(image_file(pattern(32, 32), "ICO"))), 415, "items[1]", "ICO"),
    case("a PPM video frame", lambda: one(video(png(32, 32), ppm())), 415, "items[0]", "PPM"),
    case(
        "JPEG where only PNG is allowed",
        lambda: one(image(jpeg(64, 64))),
        415,
        "items[0]",
        "JPEG",
        "allowed_image_formats=['PNG']",
        app="limited",
    ),
    # -- schema
    case("items not a list", lambda: {"items": "abc"}, 400, "items"),
    case("items empty", lambda: {"items": []}, 400, "items"),
    case("image not a string", lambda: second({"type": "image", "image": 123}), 400, "items[1]", "image"),
    case("encoding_format float16", lambda: {**one(GOOD_ITEM), "encoding_format": "float16"}, 400, "encoding_format"),
    case("dtype with a JSON form", lambda: {**one(GOOD_ITEM), "dtype": "float16"}, 400, "dtype", "safetensors"),
    case(
        "an unknown encoding_format with a dtype",
        lambda: {**one(GOOD_ITEM), "encoding_format": "npy", "dtype": "float16"},
        400,
        "encoding_format",
    ),
    case("unknown top-level field", lambda: {"items": [GOOD_ITEM], "stream": True}, 400, "stream"),
    case("a model not served here", lambda: {**one(GOOD_ITEM), "model": "qwen3-vl-8b"}, 404, "model", "qwen3-vl-8b"),
    case("unknown field in an item", lambda: second({**GOOD_ITEM, "detail": "high"}), 400, "items[1]", "detail"),
    case("item of type audio", lambda: one({"type": "audio", "audio": b64(b"RIFF")}), 400, "items[0]"),
    case("item without type", lambda: second({"image": b64(GOOD_FILE)}), 400, "items[1]"),
    case("image item without image", lambda: one({"type": "image"}), 400, "items[0]", "items[0].image: Field required"),
    case("item that is a string", lambda: second(b64(GOOD_FILE)), 400, "items[1]"),
    case("body that is a JSON list", lambda: [GOOD_ITEM], 400, None),
    case("body that is not JSON", lambda: b'{"items": [', 400, None, "JSON"),
    # -- videos as frames
    case("frames of different sizes", lambda: second(video(png(64, 48), png(48, 64))), 400, "items[1]", "differ"),
    case("video of zero frames", lambda: one({"type": "video", "frames": []}), 400, "items[0]", "no frames"),
    case("a truncated frame", lambda: one(video(png(64, 48), png(64, 48)[:100])), 400, "items[0]", "frames[1]"),
    case("a frame that is not an image", lambda: one(video(png(64, 48), TEXT)), 400, "items[0]", "frames[1] is not"),
    case("frames and a file", lambda: one({**video(GOOD_FILE), "video": b64(mp4())}), 400, "items[0]", "exactly one"),
    case("neither frames nor a file", lambda: one({"type": "video"}), 400, "items[0]", "exactly one"),
    case(
        "video of 257 frames",
        lambda: second(video(*[flat_png(8, 8)] * 257)),
        413,
        "items[1]",
        "257 frames",
        "max_video_frames=256",
    ),
    case(
        "video of 9 frames",
        lambda: one(video(*[png(32, 32)] * 9)),
        413,
        "items[0]",
        "9 frames",
        "max_video_frames=8",
        app="limited",
    ),
    # -- videos as files
    case("video file of zero bytes", lambda: second(video_file(b"")), 400, "items[1]", "empty"),
    case("video file of its ftyp box only", lambda: one(video_file(mp4_parts()[0])), 400, "items[0]", "not a decod"),
    case("video file scrambled after ftyp", lambda: one(video_file(scrambled_mp4())), 400, "items[0]", "not a decod"),
    case("video file cut in half", lambda: one(video_file(first_half(mp4()))), 400, "items[0]", "not a decodable"),
    case("text as a video file", lambda: second(video_file(TEXT)), 400, "items[1]", "not a decodable"),
    case(
        "10 s video file: 20 sampled frames, over max_video_frames",  # the processor samples 2 frames per second
        lambda: one(video_file(mp4(frames=40, fps=4))),
        413,
        "items[0]",
        "20 sampled frames",
        "max_video_frames=8",
        app="limited",
    ),
    case(
        "800x640 video file, over max_image_pixels",
        lambda: one(video_file(mp4(frames=2, width=800, height=640))),
        413,
        "items[0]",
        "512000 pixels",
        "max_image_pixels=500000",
        app="limited",
    ),
    # -- limits
    case(
        "65 items",
        lambda: {"items": [image(flat_png(8, 8))] * 65},
        413,
        "items",
        "65 items",
        "max_items_per_request=64",
    ),
    case(
        "item over max_item_bytes",
        lambda: second(image(noise_png(60_000))),
        413,
        "items[1]",
        "60000 bytes",
        "max_item_bytes=50000",
        app="limited",
    ),
    case(
        "video frames totalling over max_item_bytes",
        lambda: one(video(*[noise_png(20_000)] * 3)),
        413,
        "items[0]",
        "max_item_bytes=50000",
        app="limited",
    ),
    case(
        "request body over max_request_bytes",
        lambda: padded_json(one(GOOD_ITEM), 400_000),
        413,
        None,
        "400000 bytes",
        "max_request_bytes=300000",
        app="limited",
    ),
    case(
        "640x480 image: 300 tokens, over max_tokens_per_item",  # 40x30 patches of 16 pixels, merged 2x2
        lambda: second(image(flat_png(640, 480))),
        413,
        "items[1]",
        "300 output tokens",
        "max_tokens_per_item=100",
        app="limited",
    ),
    case(
        "two 320x240 images: 160 tokens, over max_tokens_per_request",  # each resized to 320x256: 80 tokens
        lambda: {"items": [image(flat_png(320, 240)), image(flat_png(240, 320))]},
        413,
        "items",
        "160 output tokens",
        "max_tokens_per_request=150",
        app="limited",
    ),
]


# ---- fixtures and checks ----


@pytest.fixture(scope="module")
def urls(serve_harness) -> dict[str, str]:
    return {
        "default": serve_harness.deploy("configs/local.yaml"),
        "limited": serve_harness.deploy(
            "configs/local.yaml", name="bad-inputs-limited", route_prefix="/limited", limits=LIMITED
        ),
    }


@pytest.fixture(scope="module")
def client(serve_harness):
    with serve_harness.http() as client:
        yield client


@pytest.fixture(scope="module")
def reference():
    encoder = from_preset("qwen3-vl-tiny")
    return encoder, reference_tower(encoder)


def post(client: httpx.Client, url: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(url + "/v1/encode", content=body, headers={"Content-Type": "application/json"})
    return client.post(url + "/v1/encode", json=body)


def assert_error(response, status: int, param: str | None, message: tuple[str, ...] = ()) -> None:
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert list(body) == ["error"] and sorted(body["error"]) == ["message", "param", "type"], body
    error = body["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error", error
    assert isinstance(error["message"], str) and error["message"], error
    for part in message:
        assert part in error["message"], error


_fresh_seeds = itertools.count(1000)


def assert_still_serving(client, url: str) -> None:
    """A good request right after gets its full answer (a new image each time: no cached embedding)."""
    response = post(client, url, one(image(png(64, 64, seed=next(_fresh_seeds)))))
    assert response.status_code == 200, response.text[:500]
    (entry,) = response.json()["data"]
    assert entry["grid_thw"] == GOOD_GRID and entry["shape"] == GOOD_SHAPE
    assert list(decode_embedding(entry).shape) == GOOD_SHAPE
    assert len(entry["deepstack"]) == NUM_DEEPSTACK


def assert_matches_reference(entry: dict, expected) -> None:
    tokens, deepstack, grid = expected
    assert entry["grid_thw"] == grid
    assert entry["shape"] == list(tokens.shape)
    assert relative_error(decode_embedding(entry), tokens) <= TOLERANCE
    assert len(entry["deepstack"]) == len(deepstack)
    for layer, features in zip(entry["deepstack"], deepstack):
        assert relative_error(decode_embedding({"embedding": layer, "shape": entry["shape"]}), features) <= TOLERANCE


def encode_one(client, url: str, item: dict) -> dict:
    response = post(client, url, one(item))
    assert response.status_code == 200, response.text[:500]
    (entry,) = response.json()["data"]
    return entry


# ---- bad inputs ----


@pytest.mark.parametrize("bad", CASES)
def test_bad_input_gets_its_documented_error_and_the_next_request_succeeds(bad: Case, urls, client):
    url = urls[bad.app]
    assert_error(post(client, url, bad.body()), bad.status, bad.param, bad.message)
    assert_still_serving(client, url)


def test_a_json_body_sent_as_another_content_type_gets_415_naming_it(urls, client):
    body = json.dumps(one(image(png(64, 64, seed=5)))).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):  # curl -d's default
        response = client.post(urls["default"] + "/v1/encode", content=body, headers={"Content-Type": content_type})
        assert_error(response, 415, None, ("Content-Type: application/json", content_type))
    # a JSON body that is not an object is a 400 about the body, not about its content type
    assert_error(post(client, urls["default"], b"[1, 2]"), 400, None, ("body",))
    assert_still_serving(client, urls["default"])


def test_chunked_body_over_max_request_bytes_gets_413(urls, client):
    body = padded_json(one(GOOD_ITEM), 400_000)
    chunks = (body[i : i + 65536] for i in range(0, len(body), 65536))  # httpx sends an iterator chunked
    headers = {"Content-Type": "application/json"}
    response = client.post(urls["limited"] + "/v1/encode", content=chunks, headers=headers)
    assert_error(response, 413, None, ("max_request_bytes=300000",))
    assert_still_serving(client, urls["limited"])


# ---- limits are inclusive ----


def test_item_of_exactly_max_item_bytes_is_accepted(urls, client, reference):
    data = noise_png(LIMITED["max_item_bytes"])
    assert len(data) == LIMITED["max_item_bytes"]
    assert_matches_reference(encode_one(client, urls["limited"], image(data)), reference_image(*reference, data))


def test_image_of_exactly_max_tokens_per_item_is_accepted(urls, client, reference):
    data = flat_png(320, 320)  # 20x20 patches of 16 pixels, merged 2x2 -> 100 tokens
    entry = encode_one(client, urls["limited"], image(data))
    assert entry["shape"][0] == LIMITED["max_tokens_per_item"]
    assert_matches_reference(entry, reference_image(*reference, data))


# ---- odd but valid images: encoded as transformers encodes them ----


def exif_rotated_jpeg(orientation: int) -> bytes:
    """A 96x48 JPEG whose EXIF says to show it rotated (6: 90 degrees clockwise, 8: counter-clockwise)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return jpeg(96, 48, seed=5, exif=exif)


def palette_png_with_transparency() -> bytes:
    image = pattern(120, 90, seed=6).quantize(32)
    buffer = io.BytesIO()
    image.save(buffer, "PNG", transparency=0)
    return buffer.getvalue()


def animated_gif() -> bytes:
    """Three frames that differ everywhere (mirrored, flipped): only the first one matches the reference."""
    first = pattern(80, 60, seed=7)
    mirrored, flipped = first.transpose(Image.FLIP_LEFT_RIGHT), first.transpose(Image.FLIP_TOP_BOTTOM)
    frames = [f.quantize(64) for f in (first, mirrored, flipped)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return buffer.getvalue()


ODD_IMAGES = [
    pytest.param(lambda: flat_png(1, 1), id="1x1"),
    pytest.param(lambda: png(1, 200), id="1x200 (aspect ratio exactly 200)"),
    pytest.param(palette_png_with_transparency, id="palette PNG with transparency"),
    pytest.param(animated_gif, id="animated GIF (first frame)"),
]


@pytest.mark.parametrize("file", ODD_IMAGES)
def test_odd_but_valid_image_matches_transformers(file, urls, client, reference):
    data = file()
    assert_matches_reference(encode_one(client, urls["default"], image(data)), reference_image(*reference, data))


@pytest.mark.parametrize("orientation", [6, 8])
def test_exif_rotated_jpeg_is_encoded_upright(orientation, urls, client, reference):
    data = exif_rotated_jpeg(orientation)
    entry = encode_one(client, urls["default"], image(data))
    _, height, width = entry["grid_thw"]
    assert height > width  # stored 96 wide and 48 high, shown 48 wide and 96 high
    assert_matches_reference(entry, reference_image(*reference, data))


def test_sixteen_bit_png_is_scaled_to_eight_bits(urls, client, reference):
    """The service's documented rule (media.to_rgb_tensor): value // 257. transformers' processor would clip
    instead (Pillow's I;16 -> RGB saturates at 255), so the reference is the 8-bit image made by the rule."""
    values = (np.random.default_rng(3).integers(0, 65536, (70, 90))).astype(np.uint16)
    sixteen_bit = Image.fromarray(values)
    assert sixteen_bit.mode == "I;16"
    eight_bit = image_file(Image.fromarray((values // 257).astype(np.uint8), "L"), "PNG")
    entry = encode_one(client, urls["default"], image(image_file(sixteen_bit, "PNG")))
    assert_matches_reference(entry, reference_image(*reference, eight_bit))


def test_data_url_is_the_same_image(urls, client, reference):
    data = png(120, 80, seed=4)
    entry = encode_one(client, urls["default"], {"type": "image", "image": "data:image/png;base64," + b64(data)})
    assert_matches_reference(entry, reference_image(*reference, data))


def test_a_request_refused_while_decoding_is_counted_and_leaves_nothing_queued(urls, client):
    """The truncated item passes the header checks (so the request's tokens were counted) and fails to decode."""

    def router_stats():
        return model_detail(urls["default"])["router"]

    before = router_stats()["rejected"].get("invalid", 0)
    assert_error(post(client, urls["default"], second(image(png(64, 64)[:-100]))), 400, "items[1]")
    after = router_stats()
    assert after["rejected"]["invalid"] == before + 1
    assert after["queued_tokens"] == 0


def test_base64_with_line_breaks_is_accepted(urls, client, reference):
    """MIME-style base64 (76-column lines, as `base64.encodebytes` and coreutils write it) decodes as usual."""
    entry = encode_one(client, urls["default"], {"type": "image", "image": mime_base64(GOOD_FILE)})
    assert_matches_reference(entry, reference_image(*reference, GOOD_FILE))


def test_a_refused_request_is_one_log_line_not_a_traceback():
    """Serve logs what a replica method raises with its traceback; a `RequestError` is an answer:
    the filter the router installs turns it into one line (INFO for 4xx, WARNING for 5xx), and
    leaves real faults alone."""
    import logging

    from deployments.errors import item_error, log_refusals_in_one_line, overloaded

    log_refusals_in_one_line()
    log_refusals_in_one_line()  # once per process however often called
    serve_logger = logging.getLogger("ray.serve")
    assert sum(type(f).__name__ == "RefusalsInOneLine" for f in serve_logger.filters) == 1
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # Ray's "ray.serve" logger does not propagate to pytest's
    serve_logger.addHandler(handler)
    try:
        for error in (item_error(0, 415, "PPM is not an allowed image format"), overloaded("busy", 1), KeyError("x")):
            try:
                raise error
            except Exception:
                serve_logger.exception("Request failed.")  # what Serve's replica writes
        try:
            raise overloaded("busy", 1)
        except Exception:
            serve_logger.exception("our own line about it")  # not Serve's: kept as written
    finally:
        serve_logger.removeHandler(handler)
    refused, busy, fault, ours = records
    assert ours.levelname == "ERROR" and ours.getMessage() == "our own line about it" and ours.exc_info
    assert (refused.levelname, refused.exc_info) == ("INFO", None)
    assert refused.getMessage() == "request answered 415: items[0]: PPM is not an allowed image format"
    assert (busy.levelname, busy.getMessage()) == ("WARNING", "request answered 503: busy")
    assert fault.levelname == "ERROR" and fault.exc_info[0] is KeyError


@pytest.mark.parametrize(
    "model,body",
    [
        (EncodeRequest, {"items": [{"type": "video", "frames": [0] * 10_000}]}),
        (EncodeRequest, {"items": [{"type": "image"}] * 10_000}),
        (EncodeRequest, {"items": [{"type": "image", "image": "x", **{f"k{i}": 0 for i in range(10_000)}}]}),
        (EncodeRequest, {"items": [{"type": "image", "image": "x"}], **{f"k{i}": 0 for i in range(10_000)}}),
        (ChatRequest, {"messages": [{"role": "user", "content": [0] * 10_000}]}),
        (ChatRequest, {"messages": [{"role": "robot", "content": "x"}] * 1000}),
    ],
    ids=["int frames", "items without image", "unknown fields of an item", "unknown fields", "int parts", "roles"],
)
def test_many_bad_values_make_one_or_two_errors_not_one_each(model, body):
    """Validation stops at a list's first bad element and at the first unknown field: FastAPI builds
    every error pydantic reports (~1 KB each) before our handler reads the first."""
    with pytest.raises(ValidationError) as raised:
        model.model_validate(body)
    assert raised.value.error_count() <= 2  # a chat content's two members: a string, or a list
