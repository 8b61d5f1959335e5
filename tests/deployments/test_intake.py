"""The intake's decode paths: a one-image request in one trip to a worker, others inspected first."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import torch
from PIL import Image

from deployments.config import AppConfig
from deployments.errors import Overloaded, RequestError
from deployments.intake import Intake, raw_from_python
from deployments.media import RawItem


def photo(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def intake():
    intake = Intake(AppConfig())
    intake.start()
    yield intake
    intake.close()


def jobs(intake: Intake) -> int:
    return intake.pool.stats.completed


def test_one_image_takes_one_trip_and_decodes_as_two_do(intake):
    raw = raw_from_python(0, photo(448, 320))
    before = jobs(intake)
    (two,) = asyncio.run(intake.decode([raw], lambda tokens: None, ""))
    assert jobs(intake) - before == 2  # inspect, then decode
    asked = []
    before = jobs(intake)
    (one,) = asyncio.run(intake.decode([raw], asked.append, "", lambda: 10**9))
    assert jobs(intake) - before == 1
    assert one.spec == two.spec and one.key == two.key and torch.equal(one.pixels, two.pixels)
    assert asked == [0]  # the service's room was asked before any work


def test_one_image_that_does_not_fit_the_room_is_refused_undecoded(intake):
    raw = raw_from_python(0, photo(448, 320, seed=1))

    def check_room(tokens: int) -> None:
        if tokens > 10:
            raise Overloaded(f"{tokens} tokens do not fit")

    before = jobs(intake)
    with pytest.raises(Overloaded, match="do not fit"):
        asyncio.run(intake.decode([raw], check_room, "", lambda: 10))
    assert jobs(intake) - before == 1  # the inspection only: nothing decoded


def test_room_made_after_the_inspection_decodes_it_then(intake):
    raw = raw_from_python(0, photo(448, 320, seed=2))
    before = jobs(intake)
    (item,) = asyncio.run(intake.decode([raw], lambda tokens: None, "", lambda: 0))
    assert jobs(intake) - before == 2 and item.pixels.numel() > 0


def test_one_image_of_more_than_small_pixels_is_decoded_in_a_second_trip(intake):
    buffer = io.BytesIO()
    Image.new("RGB", (2100, 2000), (10, 200, 30)).save(buffer, "PNG")  # 4.2 MP in a few KB
    before = jobs(intake)
    (item,) = asyncio.run(intake.decode([raw_from_python(0, buffer.getvalue())], lambda t: None, "", lambda: 10**9))
    assert jobs(intake) - before == 2 and item.pixels.numel() > 0


def test_a_bad_single_image_fails_with_its_item_error_in_one_trip(intake):
    with pytest.raises(RequestError) as error:
        asyncio.run(intake.decode([RawItem(0, "image", b"not an image")], lambda tokens: None, "", lambda: 10**9))
    assert error.value.status == 400 and "items[0]" in str(error.value)


def test_several_images_are_all_inspected_before_any_decode(intake):
    raws = [raw_from_python(i, photo(224, 224, seed=i)) for i in range(2)]
    refused = []

    def check_room(tokens: int) -> None:
        refused.append(tokens)
        raise Overloaded("full")

    before = jobs(intake)
    with pytest.raises(Overloaded):
        asyncio.run(intake.decode(raws, check_room, "", lambda: 10**9))
    assert jobs(intake) - before == 2 and refused  # two inspections, no decode
