"""The apps of configs/local.yaml (Qwen3-VL) and configs/internvl.yaml, over HTTP and through the
handle, against transformers per item."""

from __future__ import annotations

import io
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from ray import serve

from deployments.wire import PackRequest, item_from_wire
from models import from_preset
from tests.deployments.media_helpers import (
    b64,
    decode_embedding,
    image_file,
    pattern,
    reference_image,
    reference_video,
)
from tests.helpers import model_detail, reference_tower, relative_error
from tests.serve_harness import ROOT

TOLERANCE = 1e-4
CONFIGS = {"configs/local.yaml": "encoder", "configs/internvl.yaml": "internvl"}
"""YAML -> the application name it is deployed under (side by side: the InternVL one at /internvl)."""


@dataclass(frozen=True)
class App:
    name: str
    """Serve application name."""
    url: str
    args: dict
    """The YAML's `args`."""

    @property
    def model_id(self) -> str:
        return f"{self.args['model']['family']}-{self.args['model']['preset']}"


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def app(request, serve_harness) -> App:
    name = CONFIGS[request.param]
    args = yaml.safe_load((ROOT / request.param).read_text())["applications"][0]["args"]
    prefix = None if name == "encoder" else f"/{name}"
    return App(name, serve_harness.deploy(request.param, name=name, route_prefix=prefix), args)


@pytest.fixture(scope="module")
def url(app) -> str:
    return app.url


@pytest.fixture(scope="module")
def reference(app):
    encoder = from_preset(app.model_id)
    return encoder, reference_tower(encoder)


def images_in_many_formats() -> list[tuple[str, bytes]]:
    """(description, file bytes): PNG/JPEG/WebP/TIFF, modes RGB/RGBA/L/P/CMYK, many sizes."""
    cases = []
    for i, (width, height) in enumerate([(320, 240), (64, 64), (17, 900), (1000, 333), (250, 250)]):
        rgb = pattern(width, height, seed=i)
        cases.append((f"png rgb {width}x{height}", image_file(rgb, "PNG")))
        cases.append((f"jpeg rgb {width}x{height}", image_file(rgb, "JPEG")))
    rgba = pattern(200, 150, seed=7).convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize((200, 150)))
    cases += [
        ("png rgba", image_file(rgba, "PNG")),
        ("webp rgba", image_file(rgba, "WEBP")),
        ("webp rgb", image_file(pattern(300, 200, seed=8), "WEBP")),
        ("png L", image_file(pattern(128, 96, seed=9).convert("L"), "PNG")),
        ("jpeg L", image_file(pattern(96, 128, seed=10).convert("L"), "JPEG")),
        ("png P", image_file(pattern(160, 120, seed=11).convert("P"), "PNG")),
        ("jpeg CMYK", image_file(pattern(180, 140, seed=12).convert("CMYK"), "JPEG")),
        ("tiff rgb", image_file(pattern(90, 70, seed=13), "TIFF")),
    ]
    return cases


def check_item(entry, expected_tokens, expected_deepstack, grid):
    assert entry["grid_thw"] == grid
    got = decode_embedding(entry)
    assert list(got.shape) == list(expected_tokens.shape) == entry["shape"]
    assert relative_error(got, expected_tokens) <= TOLERANCE
    assert ("deepstack" in entry) == (expected_deepstack is not None)
    for layer, features in zip(entry.get("deepstack", []), [] if expected_deepstack is None else expected_deepstack):
        assert relative_error(decode_embedding({"embedding": layer, "shape": entry["shape"]}), features) <= TOLERANCE


def test_images_of_many_formats_and_modes_match_transformers(app, url, reference, serve_harness):
    encoder, tower = reference
    cases = images_in_many_formats()
    with serve_harness.http() as client:
        items = [{"type": "image", "image": b64(d)} for _, d in cases]  # the served model named, as OpenAI clients do
        response = client.post(url + "/v1/encode", json={"items": items, "cache": False, "model": app.model_id})
    assert response.status_code == 200, response.text
    stages = dict(part.strip().split(";dur=") for part in response.headers["Server-Timing"].split(","))
    assert set(stages) == {"decode", "encode", "replica_queue", "forward", "fetch", "serialize"}, stages
    assert float(stages["forward"]) > 0 and float(stages["encode"]) >= float(stages["forward"]), stages
    body = response.json()
    assert body["model"] == app.model_id
    assert [entry["index"] for entry in body["data"]] == list(range(len(cases)))
    for (name, data), entry in zip(cases, body["data"]):
        tokens, deepstack, grid = reference_image(encoder, tower, data)
        assert entry["modality"] == "image", name
        check_item(entry, tokens, deepstack, grid)
    assert body["usage"]["vision_tokens"] == sum(entry["shape"][0] for entry in body["data"])


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_safetensors_responses_match_transformers(app, url, reference, serve_harness, dtype):
    """`encoding_format: safetensors` through the deployment, read by the safetensors library:
    one tensor per output in the model's dtype (or the one asked), metadata in the header."""
    from safetensors.torch import load

    encoder, tower = reference
    cases = images_in_many_formats()[:4]
    body = {"items": [{"type": "image", "image": b64(d)} for _, d in cases], "cache": False}
    body |= {"encoding_format": "safetensors"} | ({"dtype": dtype} if dtype else {})
    with serve_harness.http() as client:
        response = client.post(url + "/v1/encode", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    assert int(response.headers["content-length"]) == len(response.content)
    tensors = load(response.content)
    for index, (name, data) in enumerate(cases):
        tokens, deepstack, grid = reference_image(encoder, tower, data)
        got = tensors[f"{index}.embedding"]
        assert got.dtype == (torch.float32 if dtype else encoder.dtype), name
        assert relative_error(got.float(), tokens) <= TOLERANCE, name
        for level, features in enumerate([] if deepstack is None else deepstack):
            assert relative_error(tensors[f"{index}.deepstack.{level}"].float(), features) <= TOLERANCE, name
        assert (f"{index}.deepstack.0" in tensors) == (deepstack is not None)


def test_video_given_as_frames_matches_transformers(url, reference, serve_harness):
    encoder, tower = reference
    frames = [image_file(pattern(160, 120, seed=s), "PNG") for s in range(6)]
    with serve_harness.http() as client:
        response = client.post(
            url + "/v1/encode",
            json={"items": [{"type": "video", "frames": [b64(f) for f in frames]}], "encoding_format": "float"},
        )
    assert response.status_code == 200, response.text
    entry = response.json()["data"][0]
    assert entry["modality"] == "video"
    check_item(entry, *reference_video(encoder, tower, frames))


def test_64_concurrent_requests_get_their_own_items(url, reference, serve_harness):
    """Packing across concurrent requests never mixes or reorders items."""
    encoder, tower = reference
    rng = np.random.default_rng(0)
    requests = []
    for r in range(64):
        sizes = [(int(rng.integers(40, 500)), int(rng.integers(40, 500))) for _ in range(int(rng.integers(1, 4)))]
        requests.append([image_file(pattern(w, h, seed=1000 * r + i), "PNG") for i, (w, h) in enumerate(sizes)])
    with serve_harness.http() as client:

        def send(files):
            return client.post(url + "/v1/encode", json={"items": [{"type": "image", "image": b64(f)} for f in files]})

        with ThreadPoolExecutor(64) as pool:
            responses = list(pool.map(send, requests))
        router = model_detail(url)["router"]
    stats = router["packs"]
    for files, response in zip(requests, responses):
        assert response.status_code == 200, response.text
        for data, entry in zip(files, response.json()["data"]):
            check_item(entry, *reference_image(encoder, tower, data))
    assert stats["max_requests_in_a_pack"] >= 2
    assert stats["mean_requests_per_pack"] > 1.0, stats
    # one router, one replica taking 8 at once (Serve's default here): 2 packs in flight, as configured
    assert router["max_packs_in_flight"] == 2


def test_lone_request_is_served_within_max_wait_plus_compute(app, url, serve_harness):
    max_wait_s = app.args["router"]["max_wait_ms"] / 1e3
    item = {"type": "image", "image": b64(image_file(pattern(300, 300), "PNG"))}
    handle = serve.get_deployment_handle("EncoderReplica", app_name=app.name)
    with serve_harness.http() as client:
        client.post(url + "/v1/encode", json={"items": [item]}).raise_for_status()  # warm
        start = time.perf_counter()
        client.post(url + "/v1/encode", json={"items": [item]}).raise_for_status()
        latency = time.perf_counter() - start
    describe = handle.describe.remote().result()
    assert describe["stats"]["packs"] >= 2
    # compute: the same pack straight on the replica, bypassing the router
    encoder = from_preset(app.model_id)
    pixels = encoder.preprocessor.resize_image(
        torch.from_numpy(np.asarray(pattern(300, 300)).transpose(2, 0, 1).copy())
    )
    spec = encoder.preprocessor.image_spec(300, 300)
    start = time.perf_counter()
    handle.encode_pack.remote(PackRequest(0, "image", [pixels], [spec])).result()
    compute = time.perf_counter() - start
    assert latency < max_wait_s + compute + 0.5, (latency, compute)


def test_python_handle_takes_pil_bytes_and_video_frames(app, url, reference):
    encoder, tower = reference
    pil = pattern(200, 100, seed=3)
    png = image_file(pattern(120, 260, seed=4), "PNG")
    frames = [image_file(pattern(96, 96, seed=s), "PNG") for s in range(4)]
    opened_png = image_file(pattern(150, 90, seed=5), "PNG")  # as a caller opens a file: lazily, pickled unread
    opened = Image.open(io.BytesIO(opened_png))
    handle = serve.get_app_handle(app.name)
    results = handle.encode.remote([pil, png, {"type": "video", "frames": frames}, opened]).result()
    assert [r.modality for r in results] == ["image", "image", "video", "image"]
    expected = [
        reference_image(encoder, tower, image_file(pil, "PNG")),
        reference_image(encoder, tower, png),
        reference_video(encoder, tower, frames),
        reference_image(encoder, tower, opened_png),
    ]
    for result, (tokens, deepstack, grid) in zip(results, expected):
        assert list(result.grid_thw) == grid
        assert relative_error(result.embedding, tokens) <= TOLERANCE
        if deepstack is None:
            assert result.deepstack is None
        else:
            assert relative_error(result.deepstack, deepstack) <= TOLERANCE


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"items": [{"type": "image", "image": "not base64!!"}]}, 400, "items[0]"),
        ({"items": [{"type": "image", "image": b64(b"hello")}]}, 400, "items[0]"),
        ({"items": [{"type": "image", "image": "", "extra": 1}]}, 400, "items[0]"),
        ({"items": [{"type": "audio", "audio": "x"}]}, 400, "items[0]"),
        ({"items": []}, 400, "items"),
        ({"items": [{"type": "image", "image": b64(image_file(pattern(10, 10), "PNG"))}] * 65}, 413, "items"),
    ],
)
def test_bad_requests_get_4xx_naming_the_item_and_good_ones_still_work(url, serve_harness, body, status, param):
    good = {"items": [{"type": "image", "image": b64(image_file(pattern(64, 64), "PNG"))}]}
    with serve_harness.http() as client:
        response = client.post(url + "/v1/encode", json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["message"]
        assert client.post(url + "/v1/encode", json=good).status_code == 200


def test_health_models_and_docs(app, url, serve_harness):
    with serve_harness.http() as client:
        assert client.get(url + "/health").json() == {"status": "ok", "encoder_replicas": 1}
        models = client.get(url + "/v1/models").json()
        assert models == {
            "object": "list",
            "data": [{"id": app.model_id, "object": "model", "owned_by": "vlm-encoder-serve"}],
        }
        detail = model_detail(url)
        assert detail["family"] == app.args["model"]["family"] and detail["replicas"] == {"RUNNING": 1}
        assert detail["budgets"][-1] == app.args["graphs"].get("max_budget_tokens", detail["budgets"][-1])
        # every replica's warm-up, from the routing reports Serve collects each second
        deadline = time.monotonic() + 30
        while not detail["replica_warmup"] and time.monotonic() < deadline:
            time.sleep(0.5)
            detail = model_detail(url)
        [warmup] = detail["replica_warmup"].values()
        assert warmup["pid"] == detail["replica"]["pid"] and warmup["graphs_total"] == detail["replica"]["graphs"]
        assert 0 <= warmup["graphs_live"] <= warmup["graphs_total"] and warmup["ready_s"] > 0
        before = warmup["before_constructor"]  # the process started, imported us, then built the replica
        assert before["imports_s"] > 0 and before["setup_s"] >= 0
        assert before["process_s"] + 0.05 >= before["imports_s"] + before["setup_s"]
        # and what each replica did, stamped with its clock, for rates between two readings
        [work] = detail["replica_work"].values()
        assert work["pid"] == detail["replica"]["pid"] and work["at"] > 0
        assert 0 <= work["forwards"] <= work["merged_packs"] and work["tokens"] >= 0 and "store" in work["step_seconds"]
        assert {"first_pack_checks", "recurring_captures", "between"} <= work["step_seconds"].keys()
        assert work["step_seconds"]["first_pack_checks"] <= work["step_seconds"]["run"]  # a part of it
        public = client.get(f"{url}/v1/models/{app.model_id}").json()  # for any client: no counters
        assert public["encoder"].keys() == {"family", "budgets", "replicas", "replica_warmup"}
        assert public["encoder"]["budgets"] == detail["budgets"]
        unknown = client.get(url + "/v1/models/gpt-4o")
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
        assert unknown.json()["error"]["type"] == "invalid_request_error"  # as /v1/encode's unknown model
        assert client.get(url + "/docs").status_code == 200
        assert "/v1/encode" in client.get(url + "/openapi.json").json()["paths"]


def test_models_does_not_wait_on_a_saturated_encoder(url, serve_harness):
    """Under saturation the encoder's `describe` queues behind packs for a replica slot;
    `/v1/models` answers after `DESCRIBE_TIMEOUT_S` with the last description, marked stale (or
    busy before any). The slot is held here by a stand-in handle whose call never completes:
    a real queue's length depends on the machine. The answer path is the router's own code."""
    import asyncio

    from deployments.router.ingress import DESCRIBE_TIMEOUT_S, EncoderRouter

    fresh = model_detail(url)["replica"]
    assert "stale_s" not in fresh and fresh["stats"]["packs"] >= 0

    class Queued:  # what `handle.describe.remote()` returns while every replica slot is taken
        cancelled = False

        def __await__(self):
            return asyncio.get_running_loop().create_future().__await__()

        def cancel(self):
            Queued.cancelled = True

    class Saturated:
        deployment_name = "EncoderReplica"

        class describe:  # noqa: N801 - the handle's method name
            remote = staticmethod(Queued)

    router = object.__new__(EncoderRouter)
    router._described = {}

    async def ask() -> tuple[dict, float]:
        start = time.perf_counter()
        return await router._describe(Saturated), time.perf_counter() - start

    busy, waited = asyncio.run(ask())
    assert busy["status"] == "busy" and Queued.cancelled and waited < DESCRIBE_TIMEOUT_S + 1
    router._described, Queued.cancelled = {"EncoderReplica": (time.monotonic() - 5, fresh)}, False
    stale, _ = asyncio.run(ask())
    assert stale["stale_s"] >= 5 and stale["stats"] == fresh["stats"] and Queued.cancelled


def test_handle_results_come_from_the_encoder_replica_not_through_the_router(app, url, reference, serve_harness):
    """The handle's results reference the encoder replica's object store: the router reads no
    embedding bytes, the caller reads them on first use, and they outlive the response."""
    import gc

    import ray

    from deployments.results import EncodeResult, ItemRef

    encoder, tower = reference
    files = [image_file(pattern(140, 100, seed=s), "PNG") for s in (61, 62)]
    handle = serve.get_app_handle(app.name)
    before = model_detail(url)["router"]["embedding_bytes_received"]
    response = handle.encode.remote([files[0]])
    results = response.result()
    refs = handle.encode.remote([files[1]], as_refs=True).result()
    router = model_detail(url)["router"]
    assert router["embedding_bytes_received"] == before
    # the test cluster started in this process, with Ray's ingress flag as this environment sets it
    haproxy = os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"
    assert router["http_ingress"] == ("haproxy" if haproxy else "serve-proxy")
    assert router["handle_refs_held"] >= 2  # the router still references both results (ray-project/ray#58080)
    assert isinstance(results[0], EncodeResult) and type(refs[0]) is ItemRef and not hasattr(refs[0], "embedding")
    assert set(results[0].timing_ms) == {"decode", "encode", "replica_queue", "forward"}, results[0].timing_ms
    del response
    gc.collect()
    expected = [reference_image(encoder, tower, f) for f in files]
    for result, (tokens, deepstack, _) in zip([results[0], item_from_wire(ray.get(refs[0].ref))], expected):
        embedding = result.embedding if isinstance(result, EncodeResult) else result.tokens
        assert relative_error(embedding, tokens) <= TOLERANCE
        assert (result.deepstack is None) == (deepstack is None)
        if deepstack is not None:
            assert relative_error(result.deepstack, deepstack) <= TOLERANCE
    assert list(results[0].grid_thw) == expected[0][2] and list(refs[0].grid_thw) == expected[1][2]


def test_a_caller_writing_into_its_result_changes_nobody_elses(app, url, reference):
    """The caller's tensors are its own, and the stored arrays (`as_refs`) are read-only: the object
    store's pages are shared by every reader of the object, and the router's cache answers later
    requests from the same object."""
    import ray

    encoder, tower = reference
    data = image_file(pattern(120, 90, seed=63), "PNG")
    handle = serve.get_app_handle(app.name)
    first = handle.encode.remote([data]).result()[0]  # cached by the router
    stored = ray.get(handle.encode.remote([data], as_refs=True).result()[0].ref)
    with pytest.raises(ValueError, match="read-only"):
        stored["tokens"].fill(7)
    first.embedding.fill_(7.0)
    if first.deepstack is not None:
        first.deepstack.fill_(7.0)
    again = handle.encode.remote([data]).result()[0]
    assert again.ref == first.ref  # the same object, from the cache
    tokens, deepstack, _ = reference_image(encoder, tower, data)
    assert relative_error(again.embedding, tokens) <= TOLERANCE
    if deepstack is not None:
        assert relative_error(again.deepstack, deepstack) <= TOLERANCE


def resized_item(pre, data: bytes):
    """(uint8 pixels as the router sends them, spec) of an image file, for packs sent to a replica."""
    pixels = torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)
    return pre.resize_image(pixels.contiguous()), pre.image_spec(*pixels.shape[-2:])


def test_packs_waiting_at_a_replica_run_merged_and_each_gets_its_own_items(app, reference):
    """Packs that reach a replica while it computes (from any router) run as one forward where
    they fit; each pack's results are its own items', equal to transformers item by item."""
    import ray

    encoder, tower = reference
    pre = encoder.preprocessor
    files = [image_file(pattern(96 + 16 * i, 80, seed=70 + i), "PNG") for i in range(7)]

    groups = [files[:2]] + [[f] for f in files[2:]]  # the first pack holds two items
    packs = []
    for pack_id, group in enumerate(groups):
        pixels, specs = zip(*(resized_item(pre, data) for data in group))
        packs.append(PackRequest(10_000 + pack_id, "image", list(pixels), list(specs), requests=len(group)))
    replica = serve.get_deployment_handle("EncoderReplica", app_name=app.name)
    before = replica.describe.remote().result()
    results = [r.result() for r in [replica.encode_pack.remote(pack) for pack in packs]]
    after = replica.describe.remote().result()
    forwards = after["forwards"] - before["forwards"]
    assert forwards < len(packs) and max(r.merged for r in results) > 1, (forwards, [r.merged for r in results])
    requests = after["requests_per_forward"] * after["forwards"] - before["requests_per_forward"] * before["forwards"]
    assert abs(requests - len(files)) < 0.01 * after["forwards"] + 1e-6  # requests counted across merged packs
    for group, result in zip(groups, results):
        assert len(result.outputs) == len(group)
        for data, ref in zip(group, result.outputs):
            tokens, deepstack, _ = reference_image(encoder, tower, data)
            output = item_from_wire(ray.get(ref))
            assert relative_error(output.tokens, tokens) <= TOLERANCE
            if deepstack is not None:
                assert relative_error(output.deepstack, deepstack) <= TOLERANCE


def test_the_trip_between_forwards_is_counted_while_packs_wait(app, reference):
    """A large pack's forward with small packs arriving meanwhile: the time from its end to the
    next forward's start (back through the event loop) is counted as the replica's `between` step."""
    encoder, _ = reference
    pre = encoder.preprocessor
    large = [image_file(pattern(2048, 2048, seed=90), "PNG")]
    small = [[image_file(pattern(64 + 16 * i, 64, seed=91 + i), "PNG")] for i in range(3)]
    packs = []
    for pack_id, group in enumerate([large, *small]):
        pixels, specs = zip(*(resized_item(pre, data) for data in group))
        packs.append(PackRequest(20_000 + pack_id, "image", list(pixels), list(specs)))
    replica = serve.get_deployment_handle("EncoderReplica", app_name=app.name)
    before = replica.describe.remote().result()
    first = replica.encode_pack.remote(packs[0])
    deadline = time.monotonic() + 30
    while replica.describe.remote().result()["inflight_tokens"] == 0:  # until its forward has begun
        assert time.monotonic() < deadline, "the large pack's forward did not begin"
        time.sleep(0.005)
    results = [r.result() for r in [replica.encode_pack.remote(pack) for pack in packs[1:]]] + [first.result()]
    after = replica.describe.remote().result()
    assert after["forwards"] - before["forwards"] >= 2 and all(r.outputs for r in results)
    seen = {k: (before[k], after[k]) for k in ("forwards", "step_seconds", "merged_packs")}
    assert after["step_seconds"]["between"] > before["step_seconds"]["between"], seen


def test_a_pack_that_fails_in_a_merged_forward_fails_alone(app, reference):
    """A pack whose pixels do not match its specs fails with its own error; the packs merged with
    it are rerun on their own and come back right."""
    import ray

    encoder, tower = reference
    pre = encoder.preprocessor
    files = [image_file(pattern(96 + 16 * i, 80, seed=80 + i), "PNG") for i in range(5)]

    items = [resized_item(pre, data) for data in files]
    packs = [PackRequest(20_000 + i, "image", [pixels], [spec]) for i, (pixels, spec) in enumerate(items)]
    packs[2] = PackRequest(20_002, "image", [items[2][0]], [pre.image_spec(448, 448)])  # not its size
    replica = serve.get_deployment_handle("EncoderReplica", app_name=app.name)
    responses = [replica.encode_pack.remote(pack) for pack in packs]
    with pytest.raises(ValueError, match="patches, its specs say"):
        responses[2].result()
    for index, data in enumerate(files):
        if index == 2:
            continue
        tokens, _, _ = reference_image(encoder, tower, data)
        assert relative_error(item_from_wire(ray.get(responses[index].result().outputs[0])).tokens, tokens) <= TOLERANCE


def test_handle_refuses_unsupported_items_with_a_clear_error(app, url):
    """The caller gets the error naming the item; the router logs each refusal as one line, not
    Serve's "Request failed." with a traceback (which the caller's driver would echo too)."""
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path()) / "serve"

    def router_log() -> str:
        return "".join(p.read_text(errors="replace") for p in logs.glob(f"replica_{app.name}_EncoderRouter_*.log"))

    before = router_log()
    handle = serve.get_app_handle(app.name)
    bad_items = (12345, "a string", {"type": "video", "frames": [1, 2]}, {"type": "audio"})
    for bad in bad_items:
        with pytest.raises(Exception, match=r"items\[0\]: unsupported item"):
            handle.encode.remote([bad]).result()
    answered = "request answered 400: items[0]: unsupported item"
    deadline = time.monotonic() + 10  # log lines reach the file a moment after the answer
    while router_log().count(answered) - before.count(answered) < len(bad_items) and time.monotonic() < deadline:
        time.sleep(0.2)
    after = router_log()
    assert after.count(answered) - before.count(answered) == len(bad_items)
    assert after.count("Request failed.") == before.count("Request failed.")


def test_chat_on_a_deployment_without_an_llm_is_404(url, serve_harness):
    body = {"messages": [{"role": "user", "content": "hello"}]}
    with serve_harness.http() as client:
        response = client.post(url + "/v1/chat/completions", json=body)
    assert response.status_code == 404 and "no LLM" in response.json()["error"]["message"]
