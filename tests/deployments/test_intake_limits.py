"""Intake limits, third round: a frame list's decoded pixels are bounded before any frame is decoded,
the handle refuses an `items` that is not a list and an item that cannot reach a decode worker
(the worker stays up), decode workers run without the router's credentials, and a local
checkpoint is served by its directory's name, not its path on the server."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest
from PIL import Image
from ray import serve

from deployments.config import Limits
from deployments.errors import RequestError
from models.tiny_checkpoint import save_tiny_vlm
from tests.deployments.media_helpers import b64, image_file, pattern
from tests.helpers import model_detail

SECRETS = {"HF_TOKEN": "hf_intake_test", "AWS_SECRET_ACCESS_KEY": "intake-test", "VLM_TEST_SECRET": "intake-test"}
"""Set in the router's environment only; none may reach a decode process."""
SMALL_FRAME_LIST_PIXELS = 100_000
CHECKPOINT_NAME = "tiny-qwen3-vl"
ANSWER_WITHIN_S = 5.0
"""A refusal at inspection comes back in well under `decode_timeout_s` (5 s), which a decode would run into."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A tiny Qwen3-VL checkpoint in a directory whose path the server must not show."""
    directory = tmp_path_factory.mktemp("private-server-path") / CHECKPOINT_NAME
    save_tiny_vlm("qwen3-vl", directory, seed=5)
    return str(directory)


@pytest.fixture(scope="module")
def urls(serve_harness, checkpoint) -> dict[str, str]:
    router_options = {"ray_actor_options": {"num_cpus": 0, "runtime_env": {"env_vars": SECRETS}}}
    return {
        "default": serve_harness.deploy("configs/local.yaml"),
        "small": serve_harness.deploy(
            "configs/local.yaml",
            name="intake-limits",
            route_prefix="/intake-limits",
            deployments={"EncoderRouter": router_options},
            model={"path": checkpoint, "preset": None},
            router={"decode_workers": 1},
            limits={"max_frame_list_pixels": SMALL_FRAME_LIST_PIXELS},
        ),
    }


def frames_item(frames: list[bytes]) -> dict:
    return {"items": [{"type": "video", "frames": [b64(f) for f in frames]}]}


def decode_pool(client, url: str) -> dict:
    return model_detail(url)["router"]["decode_pool"]


def assert_error(response, status: int, param: str | None, *message: str) -> None:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param, error
    for part in message:
        assert part in error["message"], error


# ---- a frame list's decoded pixels ----


def test_256_frames_of_40_megapixels_are_refused_before_any_is_decoded(urls, serve_harness):
    """The issue's case: each 6324x6324 1-bit frame is within max_image_pixels and the clip within the
    token limit, but decoding all 10.2 gigapixels would hold a worker and gigabytes."""
    frame = image_file(Image.new("1", (6324, 6324)), "PNG")
    body = frames_item([frame] * 256)
    url = urls["default"]
    with serve_harness.http() as client:
        before = decode_pool(client, url)
        start = time.perf_counter()
        response = client.post(url + "/v1/encode", json=body)
        elapsed = time.perf_counter() - start
        after = decode_pool(client, url)
    limit = Limits().max_frame_list_pixels
    assert_error(response, 413, "items[0]", f"{256 * 6324 * 6324} pixels", f"max_frame_list_pixels={limit}")
    assert elapsed < ANSWER_WITHIN_S
    assert after["completed"] - before["completed"] == 1  # its inspection; no decode job ran
    assert after["timeouts"] == before["timeouts"] and after["crashes"] == before["crashes"]


def test_frame_pixels_are_summed_over_the_frames(urls, serve_harness):
    """160x120 frames (19,200 pixels each): 5 are within 100,000 pixels, 6 are not."""
    frames = [image_file(pattern(160, 120, seed=n), "PNG") for n in range(6)]
    with serve_harness.http() as client:
        within = client.post(urls["small"] + "/v1/encode", json=frames_item(frames[:5]))
        over = client.post(urls["small"] + "/v1/encode", json=frames_item(frames))
    assert within.status_code == 200, within.text[:300]
    assert_error(over, 413, "items[0]", "6 frames of 115200 pixels", f"max_frame_list_pixels={SMALL_FRAME_LIST_PIXELS}")


def test_the_handle_refuses_a_frame_list_over_the_pixel_limit(urls):
    handle = serve.get_app_handle("intake-limits")
    frames = [pattern(160, 120, seed=n) for n in range(6)]
    with pytest.raises(RequestError) as refused:
        handle.encode.remote([{"type": "video", "frames": frames}]).result()
    assert refused.value.status == 413 and refused.value.param == "items[0]"
    assert f"max_frame_list_pixels={SMALL_FRAME_LIST_PIXELS}" in refused.value.message


# ---- the handle's `items` ----


@pytest.mark.parametrize(
    "items,shown",
    [(None, "NoneType"), ({"type": "image", "image": b"\x89PNG"}, "dict"), ("an image", "str"), (b"\x89PNG", "bytes")],
    ids=["None", "one item's dict", "a string", "one item's bytes"],
)
def test_the_handle_refuses_items_that_are_not_a_list(items, shown, urls):
    handle = serve.get_app_handle("encoder")
    with pytest.raises(RequestError) as refused:
        handle.encode.remote(items).result()
    assert refused.value.status == 400 and refused.value.param == "items"
    assert f"items must be a list of items, not {shown}" in refused.value.message


def decode_processes(template_pid: int) -> list[psutil.Process]:
    """The decode template and the workers forked from it."""
    template = psutil.Process(template_pid)
    return [template, *template.children()]


def test_an_item_that_cannot_be_pickled_to_a_decode_worker_is_a_400_and_the_worker_stays(urls, serve_harness):
    """A PIL image of a class defined in a function: Ray's cloudpickle carries it to the router by
    value, plain pickle cannot send it on to a worker."""

    class Marked(Image.Image):
        pass

    image = pattern(64, 48, seed=7)
    image.__class__ = Marked
    url = urls["default"]
    handle = serve.get_app_handle("encoder")
    with serve_harness.http() as client:
        before = decode_pool(client, url)
        workers = {p.pid for p in decode_processes(before["template_pid"])}
        with pytest.raises(RequestError) as refused:
            handle.encode.remote([pattern(64, 48, seed=8), image]).result()
        after = decode_pool(client, url)
        assert {p.pid for p in decode_processes(after["template_pid"])} == workers
    assert refused.value.status == 400 and refused.value.param == "items[1]"
    assert "does not pickle" in refused.value.message
    assert after["crashes"] == before["crashes"] and after["alive"] == before["alive"] == before["workers"]
    assert handle.encode.remote([pattern(64, 48, seed=9)]).result()[0].tokens > 0


# ---- the decode workers' environment ----


def test_decode_workers_get_no_credentials_and_still_decode(urls, serve_harness):
    url = urls["small"]
    with serve_harness.http() as client:
        response = client.post(
            url + "/v1/encode", json=frames_item([image_file(pattern(64, 48, seed=n), "PNG") for n in range(2)])
        )
        assert response.status_code == 200, response.text[:300]
        detail = model_detail(url)["router"]
    router = psutil.Process(detail["pid"]).environ()
    assert all(router.get(name) == value for name, value in SECRETS.items())  # the test's premise
    processes = decode_processes(detail["decode_pool"]["template_pid"])
    assert len(processes) == detail["decode_pool"]["workers"] + 1
    for process in processes:
        environment = process.environ()
        assert not set(SECRETS) & set(environment), process.pid
        assert not any(name.startswith("RAY_") for name in environment), sorted(environment)
        assert environment["OMP_NUM_THREADS"] == "1" and environment["PATH"] == router["PATH"]


# ---- the served model's name ----


def test_a_local_checkpoint_is_served_by_its_directorys_name(urls, checkpoint, serve_harness):
    url = urls["small"]
    item = {"type": "image", "image": b64(image_file(pattern(64, 48, seed=3), "PNG"))}
    with serve_harness.http() as client:
        listed = client.get(url + "/v1/models")
        detail = client.get(f"{url}/v1/models/{CHECKPOINT_NAME}")
        encoded = client.post(url + "/v1/encode", json={"items": [item], "model": CHECKPOINT_NAME})
    assert [model["id"] for model in listed.json()["data"]] == [CHECKPOINT_NAME]
    assert detail.status_code == 200 and "encoder" in detail.json(), detail.text[:300]
    assert encoded.status_code == 200 and encoded.json()["model"] == CHECKPOINT_NAME, encoded.text[:300]
    private = str(Path(checkpoint).parent)
    assert all(private not in response.text for response in (listed, detail, encoded))
