"""Video files from untrusted bytes, with PyAV: only the request's buffer is ever read.

FFmpeg demuxers can open other inputs by name (concat scripts, playlists, SDP sessions that
bind sockets, image sequences). So probing tries only the allowed containers' demuxers
(`format_whitelist`) and no protocol at all (`protocol_whitelist`), which refuses any
nested open. Every frame's size is bounded in the decoder itself (`max_pixels`: the frame
size the container declares, checked before a frame buffer is allocated), and what decoding
will cost (frames and pixels up to the last sampled frame) is checked before decoding starts.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from ..config import Limits
from ..errors import RequestError, item_error

DEMUXERS = {
    "mp4": "mov,mp4,m4a,3gp,3g2,mj2",
    "matroska": "matroska,webm",
    "avi": "avi",
}
"""FFmpeg demuxer names behind each `limits.allowed_video_containers` entry."""
PIXEL_SLACK = 1 << 16
"""Pixels a decoder may check beyond the declared frame size (MPEG-4 Part 2 checks a padded
buffer of ~54k pixels for a 64x48 frame): a frame larger than that is refused."""
NO_PROTOCOL = "none"
"""A protocol whitelist naming no real protocol: nested opens are refused."""


@dataclass(frozen=True)
class VideoProbe:
    """What the container says before any frame is decoded."""

    frames: int
    fps: float
    width: int
    height: int


def open_options(limits: Limits) -> dict[str, str]:
    demuxers = ",".join(DEMUXERS[name] for name in limits.allowed_video_containers)
    return {"format_whitelist": demuxers, "protocol_whitelist": NO_PROTOCOL}


def _open(data: bytes, limits: Limits):
    import av  # only video files need PyAV

    return av.open(io.BytesIO(data), options=open_options(limits), metadata_errors="ignore")


def probe(data: bytes, index: int, limits: Limits) -> VideoProbe:
    """Frame count (packets, no decoding), frame rate and declared frame size."""
    try:
        with _open(data, limits) as container:
            if not container.streams.video:
                raise item_error(index, 400, "video file has no video stream")
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0) or 1.0
            width, height = stream.codec_context.width, stream.codec_context.height
            frames = sum(1 for packet in container.demux(stream) if packet.size)
    except RequestError:
        raise
    except (MemoryError, RecursionError):
        raise item_error(index, 413, "video file needs more resources to read than the service allows") from None
    except Exception:  # FFmpeg and PyAV raise many types on malformed input: the file's fault
        raise item_error(index, 400, f"is not a decodable video file (allowed containers: {allowed(limits)})") from None
    if frames == 0:
        raise item_error(index, 400, "video file has no frames")
    return VideoProbe(frames, fps, width, height)


def allowed(limits: Limits) -> str:
    return ", ".join(limits.allowed_video_containers)


def check_decode_cost(video: VideoProbe, last_frame: int, index: int, limits: Limits) -> None:
    """Frames are decoded in order up to the last sampled one: bound that work before starting."""
    decoded = last_frame + 1
    if decoded > limits.max_video_decode_frames:
        raise item_error(
            index,
            413,
            f"reaching the last sampled frame means decoding {decoded} frames, "
            f"over max_video_decode_frames={limits.max_video_decode_frames}",
        )
    pixels = decoded * video.width * video.height
    if pixels > limits.max_video_decode_pixels:
        raise item_error(
            index,
            413,
            f"decoding {decoded} frames of {video.width}x{video.height} is {pixels} pixels, "
            f"over max_video_decode_pixels={limits.max_video_decode_pixels}",
        )


def decode_frames(data: bytes, video: VideoProbe, frame_indices: list[int], index: int, limits: Limits):
    """The sampled frames as `[H, W, 3]` uint8 arrays, decoding no further than the last one.
    A frame larger than the declared size fails inside the decoder, before it is allocated."""
    wanted, frames = set(frame_indices), []
    try:
        with _open(data, limits) as container:
            stream = container.streams.video[0]
            context = stream.codec_context
            context.options = {"max_pixels": str(video.width * video.height + PIXEL_SLACK)}
            context.thread_count = 1  # a decode worker owns one core's worth of work
            for number, frame in enumerate(container.decode(stream)):
                if number in wanted:
                    if (frame.width, frame.height) != (video.width, video.height):
                        raise item_error(
                            index,
                            400,
                            f"video frame {number} is {frame.width}x{frame.height}, "
                            f"the container declares {video.width}x{video.height}",
                        )
                    frames.append(np.ascontiguousarray(frame.to_ndarray(format="rgb24")))
                if number >= frame_indices[-1]:
                    break
    except RequestError:
        raise
    except MemoryError:
        raise item_error(index, 413, "video needs more memory to decode than the service allows") from None
    except Exception:  # see probe
        raise item_error(
            index, 400, "video is truncated or corrupt, or a frame exceeds the declared size, and cannot be decoded"
        ) from None
    if len(frames) != len(wanted):
        raise item_error(index, 400, f"video has {len(frames)} decodable frames of the {len(wanted)} sampled")
    return frames
