"""Hostile media made in code: files that make a naive decoder read files, bind sockets, or work for minutes."""

from __future__ import annotations

import io
import struct
from fractions import Fraction

import av
import numpy as np
from PIL import Image

from tests.deployments.media_helpers import image_file, pattern


def ffconcat(*paths: str) -> bytes:
    """An FFmpeg concat script: a demuxer that opens each named file."""
    return ("ffconcat version 1.0\n" + "".join(f"file '{p}'\n" for p in paths)).encode()


def hls_playlist(path: str) -> bytes:
    """An HLS playlist naming one segment (the HLS demuxer opens it)."""
    return f"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1.0,\n{path}\n#EXT-X-ENDLIST\n".encode()


def sdp(port: int) -> bytes:
    """An SDP session: the SDP demuxer binds UDP `port` and waits for RTP packets."""
    return (
        "v=0\no=- 0 0 IN IP4 127.0.0.1\ns=x\nc=IN IP4 127.0.0.1\nt=0 0\n"
        f"m=video {port} RTP/AVP 96\na=rtpmap:96 H264/90000\n"
    ).encode()


def mp4(frames: int = 4, width: int = 64, height: int = 48, fps: int = 4, codec: str = "mpeg4", **options) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = options
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), (index * 37) % 256, np.uint8), "rgb24")
            frame.pts = index
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def skip_frame_h264(frames: int, fps: int) -> bytes:
    """One keyframe and `frames - 1` frames that repeat it: tiny, yet every frame must be decoded
    in order to reach the last one the sampler picks."""
    return mp4(frames, 16, 16, fps, "libx264", preset="ultrafast", keyint=str(frames + 1))


def size_changing_mjpeg(first: tuple[int, int] = (64, 64), later: tuple[int, int] = (7000, 7000)) -> bytes:
    """Matroska/MJPEG whose container and first frame say `first` while three later frames are `later`."""
    buffer = io.BytesIO()
    rate = Fraction(1, 4)
    with av.open(buffer, "w", format="matroska") as container:
        stream = container.add_stream("mjpeg", rate=4)
        stream.width, stream.height, stream.pix_fmt = first[0], first[1], "yuvj420p"
        stream.time_base = rate
        for index, size in enumerate([first, later, later, later]):
            packet = av.Packet(image_file(Image.new("RGB", size, (10, 200, 30)), "JPEG"))
            packet.stream, packet.pts, packet.dts, packet.time_base = stream, index, index, rate
            container.mux(packet)
    return buffer.getvalue()


def repeated_scan_jpeg(repeats: int) -> bytes:
    """A progressive JPEG whose last scan is repeated: each repeat is decoded again."""
    data = _progressive_jpeg()
    last_sos = data.rindex(b"\xff\xda")
    scan = data[last_sos:-2]  # up to EOI
    return data[:-2] + scan * repeats + b"\xff\xd9"


def _progressive_jpeg() -> bytes:
    buffer = io.BytesIO()
    pattern(64, 64).save(buffer, "JPEG", progressive=True, quality=90)
    return buffer.getvalue()


def dds_with_zero_flags() -> bytes:
    """A DDS header whose flags are 0 (Pillow's DDS plugin raised outside its error types)."""
    data = bytearray(image_file(Image.new("RGB", (32, 32)), "DDS"))
    data[8:12] = struct.pack("<I", 0)
    return bytes(data)


def spider() -> bytes:
    return image_file(Image.new("F", (32, 32)), "SPIDER")


def avif() -> bytes:
    return image_file(Image.new("RGB", (32, 32), (1, 2, 3)), "AVIF")


def tiff_with_float_strip_offsets() -> bytes:
    """A TIFF whose StripOffsets tag (273) has type FLOAT."""
    data = bytearray(image_file(Image.new("RGB", (8, 8), (9, 9, 9)), "TIFF"))
    ifd = struct.unpack("<I", data[4:8])[0]
    count = struct.unpack("<H", data[ifd : ifd + 2])[0]
    for entry in range(count):
        at = ifd + 2 + 12 * entry
        if struct.unpack("<H", data[at : at + 2])[0] == 273:
            data[at + 2 : at + 4] = struct.pack("<H", 11)  # FLOAT
    return bytes(data)


def avi_with_unknown_fourcc() -> bytes:
    """An AVI whose video fourcc is ZZZZ (no decoder)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="avi") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for index in range(4):
            frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), "rgb24")
            frame.pts = index
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    data = buffer.getvalue()
    for fourcc in (b"FMP4", b"fmp4", b"DIVX", b"XVID", b"mp4v"):
        data = data.replace(fourcc, b"ZZZZ")
    return data


def mp4_with_non_utf8_title() -> bytes:
    """An mp4 whose title metadata is not UTF-8 (written as a marker, then the marker's bytes replaced)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        container.metadata["title"] = "TITLEMARK"
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for index in range(4):
            frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), "rgb24")
            frame.pts = index
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    data = buffer.getvalue()
    assert b"TITLEMARK" in data
    return data.replace(b"TITLEMARK", b"\xff\xfe\xfd\xfcTITLE", 1)
