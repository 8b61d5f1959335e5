"""Token counts and preprocessing agree with transformers' own processors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import InvalidItemError, from_preset
from tests.helpers import FAMILY_TINY, random_image, random_video

# (height, width): square, landscape, portrait, extreme aspect ratios (up to 200:1),
# tiny (below min_pixels), odd sizes, and huge (above max_pixels).
IMAGE_SIZES = [
    (1, 1),
    (1, 2),
    (2, 1),
    (3, 7),
    (13, 17),
    (27, 29),
    (28, 28),
    (31, 33),
    (56, 56),
    (64, 64),
    (100, 100),
    (224, 224),
    (299, 301),
    (448, 448),
    (480, 640),
    (640, 480),
    (720, 1280),
    (1080, 1920),
    (1024, 1024),
    (1023, 1025),
    (5, 1000),
    (1000, 5),
    (10, 2000),
    (2000, 10),
    (20, 4000),
    (4000, 20),
    (14, 2800),
    (50, 10000),
    (3000, 4000),
    (4100, 4100),
    (6000, 8000),
    (333, 77),
    (77, 333),
    (16, 3200),
    (3200, 16),
]
VIDEO_SHAPES = [(1, 64, 64), (2, 120, 160), (3, 200, 100), (4, 56, 56), (5, 360, 640), (8, 100, 700), (9, 33, 47)]


@pytest.fixture(scope="module", params=sorted(FAMILY_TINY))
def encoder(request):
    return from_preset(FAMILY_TINY[request.param])


@pytest.mark.parametrize("height,width", IMAGE_SIZES)
def test_image_token_count_equals_processor_grid(encoder, height, width):
    pre = encoder.preprocessor
    image = torch.zeros(3, height, width, dtype=torch.uint8)
    grid = pre.image_processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    spec = pre.image_spec(height, width)
    assert list(spec.grid_thw) == grid
    assert spec.input_patches == grid[0] * grid[1] * grid[2]
    assert spec.output_tokens * encoder.merge_unit == spec.input_patches


@pytest.mark.parametrize("frames,height,width", VIDEO_SHAPES)
def test_video_token_count_equals_processor_grid(encoder, frames, height, width):
    pre = encoder.preprocessor
    clip = torch.zeros(frames, 3, height, width, dtype=torch.uint8)
    try:
        out = pre.video_processor(
            videos=[clip], do_sample_frames=False, return_tensors="pt", cap_pixels_per_frame=False
        )
    except ValueError as refused:  # Qwen3-VL's processor refuses 1-frame clips: so must we
        with pytest.raises(InvalidItemError, match="frame"):
            pre.video_spec(frames, height, width)
        assert "temporal_factor" in str(refused)
        return
    assert list(pre.video_spec(frames, height, width).grid_thw) == out["video_grid_thw"][0].tolist()


def test_split_preprocessing_equals_one_processor_call(encoder):
    """Resize on the host + normalize/patchify elsewhere == the processor called once, bit for bit."""
    rng = np.random.default_rng(0)
    pre = encoder.preprocessor
    images = [random_image(rng, h, w) for h, w in [(97, 203), (224, 224), (500, 80), (28, 28)]]
    whole = pre.image_processor(images=images, return_tensors="pt")["pixel_values"]
    split = pre.pixel_values([pre.resize_image(image) for image in images], "image")
    assert torch.equal(whole, split)

    clip = random_video(rng, 5, 90, 130)
    whole = pre.video_processor(videos=[clip], do_sample_frames=False, return_tensors="pt", cap_pixels_per_frame=False)
    split = pre.pixel_values([pre.resize_video(clip)], "video")
    assert torch.equal(whole["pixel_values_videos"], split)


@pytest.mark.parametrize(
    "height,width,message",
    [(0, 100, "zero size"), (100, 0, "zero size"), (1, 201, "aspect ratio"), (30000, 100, "aspect ratio")],
)
def test_bad_geometry_is_a_clear_error(encoder, height, width, message):
    with pytest.raises(InvalidItemError, match=message):
        encoder.preprocessor.image_spec(height, width)
    with pytest.raises(InvalidItemError, match=message):
        encoder.preprocessor.video_spec(4, height, width)


def test_video_without_frames_is_a_clear_error(encoder):
    with pytest.raises(InvalidItemError, match="no frames"):
        encoder.preprocessor.video_spec(0, 64, 64)
