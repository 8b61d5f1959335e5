"""E/PD with vLLM: vLLM fed with our encoders' embeddings generates what vLLM generates from the pixels.

The reference is vLLM run its own way, offline (`vllm.LLM`), encoding the same images with its
own processor and vision tower; the service under test is configs/epd-vllm.yaml on CPU with a
tiny checkpoint in the shape vLLM's CPU backend serves. Skipped without vLLM (the main CI env);
`REQUIRE_VLLM=1` (the vLLM CI step, .ci/vllm) turns the skip into a failure.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

if os.environ.get("REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (an ImportError here fails the vLLM CI step instead of skipping)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed; the vLLM CI step (.ci/vllm) installs it")

import numpy as np
import ray
from openai import OpenAI
from ray import serve
from transformers import AutoProcessor

from deployments.errors import RequestError
from deployments.router.chat import result_within
from deployments.wire import GenerateRequest, item_to_wire
from models.protocol import ItemOutput
from models.tiny_checkpoint import save_tiny_vlm
from tests.deployments.media_helpers import pattern
from tests.deployments.test_epd import openai_messages
from tests.serve_harness import REMOVE, UNCOMPILED

FAMILIES = ["qwen2.5-vl", "qwen3-vl"]
IMAGES = [pattern(200, 120, seed=1), pattern(90, 300, seed=2), pattern(320, 240, seed=3)]
PROMPTS = {0: [], 1: IMAGES[:1], 3: IMAGES}
VIDEO_FRAMES = [pattern(128, 96, seed=10 + index) for index in range(4)]
VIDEO_FPS = {"qwen2.5-vl": 2.0, "qwen3-vl": 4.0}
"""vLLM's Qwen2.5-VL places video embeddings at 2 frames a second; Qwen3-VL's prompt names the frame times."""
MAX_TOKENS = 16
ENGINE_KWARGS = {
    "enforce_eager": True,
    "max_model_len": 4096,
    "kv_cache_memory_bytes": 256 << 20,  # on CPU the default is a share of host RAM
    "limit_mm_per_prompt": {"image": 3, "video": 1},
}
SEED = 5
"""Weights seed of the tiny checkpoints: their greedy continuations differ from image set to image set."""


def app_name(family: str) -> str:
    return f"epd-vllm-{family.replace('.', '')}"


def greedy(max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0)


def vllm_pil_messages(images) -> list[dict]:
    """`openai_messages(images)` with the images as PIL parts, for vLLM's own chat path."""
    parts = [{"type": "text", "text": "Describe these pictures."}]
    parts += [{"type": "image_pil", "image_pil": image} for image in images]
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]


def video_messages() -> list[dict]:
    return [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]


def video_reference(llm, checkpoint: str, fps: float):
    """vLLM from the frames: (new ids, prompt length)."""
    frames = np.stack([np.asarray(frame) for frame in VIDEO_FRAMES])
    count = len(VIDEO_FRAMES)
    metadata = {
        "fps": fps,
        "frames_indices": list(range(count)),
        "total_num_frames": count,
        "duration": count / fps,
        "do_sample_frames": False,
    }
    processor = AutoProcessor.from_pretrained(checkpoint)
    text = processor.apply_chat_template(video_messages(), tokenize=False, add_generation_prompt=True)
    (out,) = llm.generate({"prompt": text, "multi_modal_data": {"video": (frames, metadata)}}, greedy())
    return list(out.outputs[0].token_ids), len(out.prompt_token_ids)


def only_for(*families: str):
    """Runs a test for these families only (the serving behaviour does not depend on the family)."""

    def mark(test):
        test.families = list(families)
        return test

    return mark


def pytest_generate_tests(metafunc):
    """Each family's tests run together, on one app (one vLLM engine alive at a time)."""
    if "family" in metafunc.fixturenames:
        metafunc.parametrize("family", getattr(metafunc.function, "families", FAMILIES), scope="module")


CHECKPOINTS: dict[str, str] = {}
REFERENCES: dict[str, dict] = {}
"""For the session: each family's tiny checkpoint, and vLLM's own outputs per checkpoint, made once and shared
by the modules that test the same engine settings (test_vllm_colocated.py): an engine start on CPU is
most of a minute."""


def tiny_checkpoint(family: str, tmp_path_factory) -> str:
    if family not in CHECKPOINTS:
        directory = tmp_path_factory.mktemp(family)
        save_tiny_vlm(family, directory, seed=SEED, for_vllm=True)
        CHECKPOINTS[family] = str(directory)
    return CHECKPOINTS[family]


def own_outputs(family: str, checkpoint: str) -> dict:
    """vLLM's own generation from pixels, offline: {prompt image count or "video": (ids, prompt tokens)}."""
    from vllm import LLM

    if checkpoint in REFERENCES:
        return REFERENCES[checkpoint]
    llm = LLM(model=checkpoint, dtype="float32", seed=0, **ENGINE_KWARGS)
    found = {}
    for count, images in PROMPTS.items():
        (out,) = llm.chat(vllm_pil_messages(images), greedy())
        found[count] = (list(out.outputs[0].token_ids), len(out.prompt_token_ids))
    found["video"] = video_reference(llm, checkpoint, VIDEO_FPS[family])
    del llm  # its engine process ends here, before the service's starts
    gc.collect()
    REFERENCES[checkpoint] = found
    return found


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory):
    return tiny_checkpoint(family, tmp_path_factory)


@pytest.fixture(scope="module")
def reference(family, checkpoint):
    return own_outputs(family, checkpoint)


@pytest.fixture(scope="module")
def app(family, checkpoint, reference, serve_harness):
    """configs/epd-vllm.yaml on CPU for this family; deleted afterwards (one vLLM engine at a time)."""
    name = app_name(family)
    cpu = {"num_cpus": 0, "num_gpus": 0}
    url = serve_harness.deploy(
        "configs/epd-vllm.yaml",
        name=name,
        route_prefix=f"/{name}",
        deployments={
            "EncoderRouter": {"num_replicas": 1, "ray_actor_options": cpu},
            "EncoderReplica": {"ray_actor_options": cpu},
            "VLLMReplica": {"ray_actor_options": cpu},
        },
        model={"family": family, "path": checkpoint, "device": "cpu", "dtype": "float32"},
        graphs=UNCOMPILED,
        limits={"max_items_per_request": 3},
        llm={
            "family": family,
            "path": checkpoint,
            "device": "cpu",
            "dtype": "float32",
            "max_tokens": 512,
            "max_prompt_tokens": 8192,  # over the engine's context: its own refusal (a 400) stays reachable
            # without configs/epd-vllm.yaml's GPU share, which the build refuses on CPU
            "engine_kwargs": {**ENGINE_KWARGS, "gpu_memory_utilization": REMOVE},
        },
    )
    yield url
    serve.delete(name)
    serve_harness.apps.pop(name)


def chat(url: str, images, max_tokens: int = MAX_TOKENS, text: str | None = None) -> dict:
    messages = openai_messages(images)
    if text is not None:
        messages[1]["content"][0]["text"] = text
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    served = client.models.list().data[-1].id  # the LLM's id (its checkpoint path), as /v1/models lists it
    reply = client.chat.completions.create(model=served, messages=messages, max_tokens=max_tokens, temperature=0)
    return reply.model_dump()


@pytest.mark.parametrize("count", sorted(PROMPTS))
def test_chat_greedy_ids_equal_vllm_from_pixels(app, reference, count):
    reply = chat(app, PROMPTS[count])
    ids, prompt_tokens = reference[count]
    assert reply["choices"][0]["token_ids"] == ids
    assert reply["usage"]["prompt_tokens"] == prompt_tokens  # the same prompt, placeholders expanded alike
    assert reply["usage"]["completion_tokens"] == len(ids)
    assert (reply["usage"]["vision_tokens"] > 0) == (count > 0)


def test_references_depend_on_the_images(reference):
    """Parity above means something only if the model's continuation changes with its images."""
    assert len({tuple(reference[count][0]) for count in PROMPTS}) == len(PROMPTS)


def test_video_embeddings_from_our_encoder_equal_vllm_from_frames(app, reference, family):
    """The router's chat path takes images only; a video goes to the replica with its frame times."""
    router = serve.get_app_handle(app_name(family))
    (encoded,) = router.encode.remote([{"type": "video", "frames": VIDEO_FRAMES}]).result()
    fps = VIDEO_FPS[family]
    request = GenerateRequest(
        messages=video_messages(),
        embeddings=[ray.put(item_to_wire(ItemOutput(encoded.embedding, encoded.deepstack)))],
        grids=[encoded.grid_thw],
        max_tokens=MAX_TOKENS,
        frame_seconds=[[index / fps for index in range(len(VIDEO_FRAMES))]],
    )
    result = serve.get_deployment_handle("VLLMReplica", app_name(family)).generate.remote(request).result()
    ids, prompt_tokens = reference["video"]
    assert (result.token_ids, result.prompt_tokens) == (ids, prompt_tokens)


@only_for("qwen3-vl")
def test_concurrent_chats_complete_and_equal_their_solo_runs(app):
    prompts = [(IMAGES[i % 3 : i % 3 + 1 + i % 2], f"Picture {i}: what is in it?") for i in range(16)]
    solo = [chat(app, images, 12, text)["choices"][0]["token_ids"] for images, text in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda prompt: chat(app, prompt[0], 12, prompt[1]), prompts))
    assert [reply["choices"][0]["token_ids"] for reply in together] == solo


@only_for("qwen3-vl")
def test_streaming_gives_the_same_tokens_text_and_usage(app, serve_harness):
    url = app + "/v1/chat/completions"
    body = {"messages": openai_messages(IMAGES[:2]), "max_tokens": 12, "temperature": 0}
    with serve_harness.http() as client:
        whole = client.post(url, json=body).json()
        with client.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert [t for chunk in chunks for t in chunk.get("token_ids", [])] == whole["choices"][0]["token_ids"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"] == whole["usage"]


@only_for("qwen3-vl")
def test_a_client_that_goes_away_aborts_its_request(app, family):
    """Closing the stream cancels the replica's generator, which aborts the request in vLLM."""
    handle = serve.get_deployment_handle("VLLMReplica", app_name(family))
    before = handle.describe.remote().result()["aborted_requests"]

    async def read_two_chunks():
        import httpx

        body = {"messages": openai_messages(IMAGES[:1]), "max_tokens": 500, "temperature": 0, "stream": True}
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", app + "/v1/chat/completions", json=body) as response:
                lines = response.aiter_lines()
                for _ in range(4):  # the role chunk, then generated tokens
                    await anext(lines)

    asyncio.run(read_two_chunks())
    described = poll(lambda: handle.describe.remote().result(), lambda d: d["aborted_requests"] > before)
    assert described["unfinished_requests"] == 0


@only_for("qwen3-vl")
def test_the_routers_timeout_aborts_the_request(app, family):
    """At `request_timeout_s` the router gives up on the replica's response, which must abort it."""
    handle = serve.get_deployment_handle("VLLMReplica", app_name(family))
    before = handle.describe.remote().result()["aborted_requests"]
    story = [{"role": "user", "content": "Tell a long story about the harbor."}]

    async def give_up():
        with pytest.raises(RequestError) as raised:
            await result_within(handle.generate.remote(GenerateRequest(story, [], [], max_tokens=500)), 0.5)
        assert raised.value.status == 504

    asyncio.run(give_up())
    described = poll(lambda: handle.describe.remote().result(), lambda d: d["aborted_requests"] > before)
    assert described["unfinished_requests"] == 0


def poll(read, done, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not done(value := read()):
        assert time.monotonic() < deadline, f"not done within {timeout_s} s: {value}"
        time.sleep(0.1)
    return value


@only_for("qwen3-vl")
def test_a_prompt_longer_than_the_engine_takes_is_a_400(app, serve_harness):
    long_text = "The harbor wakes before the town does. " * 600  # past max_model_len=4096 tokens
    body = {"messages": [{"role": "user", "content": long_text}], "max_tokens": 4}
    with serve_harness.http() as client:
        response = client.post(app + "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


@only_for("qwen3-vl")
def test_describe_names_the_engine_and_counts_the_handoff(app, family):
    chat(app, IMAGES[:1], 2)
    described = serve.get_deployment_handle("VLLMReplica", app_name(family)).describe.remote().result()
    assert described["engine"] == "vllm" and described["family"] == family.replace(".", "_").replace("-", "_")
    assert described["handoff_images"] >= 1 and described["handoff_bytes_per_image"] > 0


def test_ignore_eos_reaches_vllms_sampling_params():
    """Chat's `ignore_eos` (vLLM's own extension, which benchmarks use to fix the answer length)
    becomes vLLM's `SamplingParams.ignore_eos`; off unless asked."""
    from dataclasses import replace

    from deployments.llm.vllm_engine import sampling_params

    request = GenerateRequest(messages=[], embeddings=[], grids=[], max_tokens=8)
    assert sampling_params(request, {}).ignore_eos is False
    assert sampling_params(replace(request, ignore_eos=True), {}).ignore_eos is True
