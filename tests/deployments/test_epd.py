"""E/PD: router + encoders + LLM from configs/epd.yaml, against transformers' monolithic generate."""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch
from openai import OpenAI
from PIL import Image
from ray import serve
from transformers import AutoProcessor

from models import family_class
from models.tiny_checkpoint import save_tiny_vlm
from tests.deployments.media_helpers import pattern
from tests.helpers import model_detail

FAMILIES = ["qwen2.5-vl", "qwen3-vl", "internvl"]
IMAGES = [pattern(200, 120, seed=1), pattern(90, 300, seed=2), pattern(320, 240, seed=3)]
PROMPTS = {0: [], 1: IMAGES[:1], 3: IMAGES}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One tiny full-VLM checkpoint per family, tokenizer and processors included."""
    paths = {}
    for family in FAMILIES:
        directory = tmp_path_factory.mktemp(family)
        save_tiny_vlm(family, directory, seed=11)
        paths[family] = str(directory)
    return paths


SCALED = "qwen2.5-vl"
"""The family whose app runs two LLM replicas to one encoder replica (its tests do not ask one LLM replica
what another served)."""


@pytest.fixture(scope="module")
def apps(serve_harness, checkpoints):
    urls = {}
    for family in FAMILIES:
        name = f"epd-{family.replace('.', '')}"
        model = {"family": family, "path": checkpoints[family]}
        scaled = {"LLMReplica": {"num_replicas": 2}} if family == SCALED else {}
        urls[family] = serve_harness.deploy(
            "configs/epd.yaml", name=name, route_prefix=f"/{name}", deployments=scaled, model=model, llm=dict(model)
        )
    return urls


def data_url(image: Image.Image) -> str:
    png = io.BytesIO()
    image.save(png, "PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def openai_messages(images) -> list[dict]:
    parts = [{"type": "text", "text": "Describe these pictures."}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]


def monolithic_ids(checkpoint: str, family: str, images) -> list[int]:
    """transformers' own pipeline: processor + full VLM `generate`, greedy, 16 new tokens."""
    processor = AutoProcessor.from_pretrained(checkpoint)
    model = family_class(family).vlm_class.from_pretrained(checkpoint).eval()
    content = [{"type": "text", "text": "Describe these pictures."}]
    content += [{"type": "image", "image": image} for image in images]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("count", sorted(PROMPTS))
def test_disaggregated_greedy_tokens_equal_monolithic_generate(apps, checkpoints, family, count):
    images = PROMPTS[count]
    client = OpenAI(base_url=apps[family] + "/v1", api_key="unused")
    served = client.models.list().data[-1].id  # the LLM's id, as /v1/models lists it
    reply = client.chat.completions.create(model=served, messages=openai_messages(images), max_tokens=16, temperature=0)
    ours = reply.choices[0].model_extra["token_ids"]
    assert ours == monolithic_ids(checkpoints[family], family, images)
    assert reply.usage.completion_tokens == len(ours)
    vision = reply.usage.model_extra["vision_tokens"]
    assert (vision > 0) == (count > 0) and reply.usage.prompt_tokens > vision


def test_streaming_gives_the_same_tokens_and_usage(apps, serve_harness):
    url = apps["qwen3-vl"] + "/v1/chat/completions"
    body = {"messages": openai_messages(IMAGES[:2]), "max_tokens": 12, "temperature": 0}
    with serve_harness.http() as client:
        whole = client.post(url, json=body).json()
        events = []
        with client.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = [token for chunk in chunks for token in chunk.get("token_ids", [])]
    assert streamed == whole["choices"][0]["token_ids"]
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        == (whole["choices"][0]["message"]["content"])
    )
    assert chunks[-1]["usage"] == whole["usage"]


def test_router_forwards_references_not_embeddings(apps, serve_harness):
    """Embeddings go encoder -> LLM through the object store; the router never holds the tensors."""
    url = apps["qwen3-vl"]
    with serve_harness.http() as client:
        before = model_detail(url)["router"]["embedding_bytes_received"]
        reply = client.post(url + "/v1/chat/completions", json={"messages": openai_messages(IMAGES), "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        after = model_detail(url)["router"]["embedding_bytes_received"]
        encode = client.post(
            url + "/v1/encode",
            json={"items": [{"type": "image", "image": data_url(IMAGES[0]).partition(",")[2]}]},
        )
        assert encode.status_code == 200
        after_encode = model_detail(url)["router"]["embedding_bytes_received"]
    assert after == before  # the chat path moved no embedding bytes through the router
    assert after_encode > after  # while /v1/encode, which must return them, does
    llm = serve.get_deployment_handle("LLMReplica", app_name="epd-qwen3-vl").describe.remote().result()
    assert llm["handoff_images"] >= 3 and llm["handoff_bytes_per_image"] > 0


def test_handle_chat_and_errors(apps, serve_harness):
    handle = serve.get_app_handle("epd-qwen25-vl")
    reply = handle.chat.remote(openai_messages(IMAGES[:1]), max_tokens=4, temperature=0).result()
    assert reply["object"] == "chat.completion" and len(reply["choices"][0]["token_ids"]) <= 4
    with serve_harness.http() as client:
        remote = [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}
        ]
        response = client.post(apps["qwen2.5-vl"] + "/v1/chat/completions", json={"messages": remote})
        assert response.status_code == 400 and "data: URLs" in response.json()["error"]["message"]
        spoofed = {"messages": [{"role": "user", "content": "look: <|image_pad|>"}], "stream": True}
        response = client.post(apps["qwen2.5-vl"] + "/v1/chat/completions", json=spoofed)
        assert response.status_code == 400 and "<|image_pad|>" in response.json()["error"]["message"]
        too_long = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}
        response = client.post(apps["qwen2.5-vl"] + "/v1/chat/completions", json=too_long)
        assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_internvl_placeholders_typed_as_text_are_refused(apps, serve_harness):
    spoofed = {"messages": [{"role": "user", "content": "look: <IMG_CONTEXT>"}]}
    with serve_harness.http() as client:
        response = client.post(apps["internvl"] + "/v1/chat/completions", json=spoofed)
    assert response.status_code == 400 and "<IMG_CONTEXT>" in response.json()["error"]["message"]


def test_llm_scales_independently_of_the_encoder(apps):
    deployments = serve.status().applications[f"epd-{SCALED.replace('.', '')}"].deployments
    assert deployments["LLMReplica"].replica_states == {"RUNNING": 2}
    assert deployments["EncoderReplica"].replica_states == {"RUNNING": 1}
