"""`llm.colocate`: configs/epd.yaml with encoder and LLM in one deployment (`ColocatedReplica`, two
replicas), against transformers: its chats' greedy ids equal the monolithic `generate`, its encodes
equal transformers' tower, and the application has no other deployment."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from openai import OpenAI
from ray import serve

from deployments.config import AppConfig
from deployments.deployment_names import deployment_names
from deployments.validation import deployment_name_problems
from models import from_checkpoint
from models.tiny_checkpoint import save_tiny_vlm
from tests.deployments.media_helpers import b64, decode_embedding, image_file, reference_image
from tests.deployments.test_epd import IMAGES, PROMPTS, monolithic_ids, openai_messages
from tests.deployments.test_metrics_and_autoscaling import peak_replicas_under_load
from tests.helpers import reference_tower, relative_error

NAME = "epd-colocated"
CPU = {"num_cpus": 0, "num_gpus": 0}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3-vl")
    save_tiny_vlm("qwen3-vl", directory, seed=11)
    return str(directory)


def deploy_colocated(serve_harness, checkpoint: str, name: str, replicas: dict) -> str:
    """configs/epd.yaml with `llm.colocate` on CPU as application `name`; `replicas`: the
    `ColocatedReplica`'s Serve options (its count or autoscaling)."""
    model = {"family": "qwen3-vl", "path": checkpoint}
    return serve_harness.deploy(
        "configs/epd.yaml",
        name=name,
        route_prefix=f"/{name}",
        deployment_entries=[
            {"name": "EncoderRouter", "num_replicas": 1, "ray_actor_options": CPU},
            {"name": "ColocatedReplica", "ray_actor_options": CPU, **replicas},
        ],
        model=model,
        llm={**model, "colocate": True},
    )


@pytest.fixture(scope="module")
def url(serve_harness, checkpoint):
    url = deploy_colocated(serve_harness, checkpoint, NAME, {"num_replicas": 2})
    yield url
    serve.delete(NAME)
    serve_harness.apps.pop(NAME)


def test_one_deployment_serves_both_sides(url):
    deployments = serve.status().applications[NAME].deployments
    assert sorted(deployments) == ["ColocatedReplica", "EncoderRouter"]
    assert all(d.status == "HEALTHY" for d in deployments.values())


@pytest.mark.parametrize("count", sorted(PROMPTS))
def test_chat_greedy_ids_equal_monolithic_generate(url, checkpoint, count):
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    served = client.models.list().data[-1].id
    for _ in range(2):  # two replicas: either may answer
        reply = client.chat.completions.create(
            model=served, messages=openai_messages(PROMPTS[count]), max_tokens=16, temperature=0
        )
        assert reply.choices[0].model_extra["token_ids"] == monolithic_ids(checkpoint, "qwen3-vl", PROMPTS[count])


def test_encodes_equal_transformers_tower(url, checkpoint):
    encoder = from_checkpoint(checkpoint, "qwen3-vl")
    tower = reference_tower(encoder)
    data = image_file(IMAGES[2], "PNG")
    response = httpx.post(url + "/v1/encode", json={"items": [{"type": "image", "image": b64(data)}]}, timeout=120)
    assert response.status_code == 200, response.text
    (entry,) = response.json()["data"]
    tokens, _, grid = reference_image(encoder, tower, data)
    assert entry["grid_thw"] == grid
    assert relative_error(decode_embedding(entry), tokens) <= 1e-4


def test_more_streaming_chats_than_llm_slots_all_finish_and_free_their_slots(url):
    """Almost four times the replicas' LLM slots (2 x 16) in streaming chats at once, twice: every stream
    ends with [DONE] and no error, and a chat after them is answered at once. Serve tells a router a
    stream ended only when it is read to its end, so a router that stopped reading at the last piece
    counted every stream as running and, its LLM slots full, routed no generation again."""
    chat = url + "/v1/chat/completions"
    served = httpx.get(url + "/v1/models", timeout=30).json()["data"][-1]["id"]
    body = {
        "model": served,
        "messages": openai_messages(PROMPTS[1]),
        "max_tokens": 16,
        "stream": True,
        "ignore_eos": True,
    }

    async def one(client: httpx.AsyncClient) -> list[str]:
        async with client.stream("POST", chat, json=body) as response:
            assert response.status_code == 200
            return [line async for line in response.aiter_lines() if line.startswith("data:")]

    async def wave() -> list[list[str]]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(120)))

    for _ in range(2):
        for events in asyncio.run(wave()):
            assert events[-1] == "data: [DONE]" and not any('"error"' in event for event in events), events
    reply = httpx.post(chat, json={**body, "stream": False}, timeout=30)
    assert reply.status_code == 200, reply.text


def running_colocated(app: str) -> int:
    return serve.status().applications[app].deployments["ColocatedReplica"].replica_states.get("RUNNING", 0)


def test_generations_scale_a_colocated_deployment_up_and_idle_scales_it_back(serve_harness, checkpoint):
    """On the token policy with `target_generations_per_replica` 2, chats whose vision tokens stay far
    under the token target add a second replica (the replicas report their generations); then one
    streamed chat at a time, under the target, lets it return to one replica, and every stream, the
    one on the replica that leaves among them, ends with [DONE] and no error."""
    name = "colocated-scale"
    quick = {"upscale_delay_s": 1, "downscale_delay_s": 6, "metrics_interval_s": 0.5, "look_back_period_s": 2}
    autoscaling = {**scaling(target_tokens_per_replica=10**6, target_generations_per_replica=2), **quick}
    url = deploy_colocated(serve_harness, checkpoint, name, {"autoscaling_config": {**autoscaling, "max_replicas": 2}})
    try:
        assert running_colocated(name) == 1
        served = httpx.get(url + "/v1/models", timeout=30).json()["data"][-1]["id"]
        body = {"model": served, "messages": openai_messages(PROMPTS[1]), "max_tokens": 32, "ignore_eos": True}

        def chat(client: httpx.Client, _: int) -> None:
            assert client.post(url + "/v1/chat/completions", json=body).status_code == 200

        peak = peak_replicas_under_load(lambda: running_colocated(name), chat, callers=8, seconds=120)
        assert peak == 2, "eight chats at once against a target of two generations did not add a replica"
        deadline, streams = time.monotonic() + 90, 0
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < deadline and (running_colocated(name) != 1 or streams < 2):
                with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as response:
                    events = [line for line in response.iter_lines() if line.startswith("data:")]
                assert response.status_code == 200 and events[-1] == "data: [DONE]", events
                assert not any('"error"' in event for event in events), events
                streams += 1
        assert running_colocated(name) == 1, "the deployment kept its second replica under one generation"
    finally:
        serve_harness.remove(name)


def test_colocation_is_validated_before_anything_starts():
    both = AppConfig(llm={"colocate": True})
    assert deployment_names(both) == ["EncoderRouter", "ColocatedReplica"]
    with pytest.raises(ValueError, match="llm.device 'cpu' must be model.device 'cuda'"):
        AppConfig(model={"device": "cuda"}, llm={"colocate": True})
    vllm = {"family": "qwen3-vl", "path": "/ckpt", "engine": "vllm", "device": "cuda", "colocate": True}
    model = {"family": "qwen3-vl", "path": "/ckpt", "device": "cuda"}
    with pytest.raises(ValueError, match="gpu_memory_utilization to at most 0.85 \\(now unset"):
        AppConfig(model=model, llm=vllm)
    with pytest.raises(ValueError, match="at most 0.85 \\(now 0.9\\)"):
        AppConfig(model=model, llm={**vllm, "engine_kwargs": {"gpu_memory_utilization": 0.9}})
    with pytest.raises(ValueError, match="a share of the GPU in \\(0, 1\\], not 'most'"):
        AppConfig(model=model, llm={**vllm, "engine_kwargs": {"gpu_memory_utilization": "most"}})
    AppConfig(model=model, llm={**vllm, "engine_kwargs": {"gpu_memory_utilization": 0.75}})


def scaling(**policy_kwargs) -> dict:
    policy = {"policy_function": "deployments.autoscaling:TokenAutoscalingPolicy", "policy_kwargs": policy_kwargs}
    return {"min_replicas": 1, "max_replicas": 4, "policy": policy}


def test_the_validator_names_the_colocated_deployment_and_asks_its_autoscaling_to_count_generations():
    colocated = AppConfig(llm={"colocate": True})
    entries = [{"name": "EncoderReplica"}, {"name": "ColocatedReplica", "autoscaling_config": {"max_replicas": 4}}]
    first, second = deployment_name_problems({"deployments": entries}, colocated)
    assert first.endswith("name it 'ColocatedReplica'") and "target_generations_per_replica`, its LLM's load" in second
    tokens_only = {"name": "ColocatedReplica", "autoscaling_config": scaling(target_tokens_per_replica=9000)}
    (blind,) = deployment_name_problems({"deployments": [tokens_only]}, colocated)
    assert "policy_kwargs.target_generations_per_replica" in blind
    for kwargs, error in [
        (
            {"target_tokens_per_replica": 1, "target_generations_per_replica": "24"},
            "must be a finite number of generations",
        ),
        (
            {"target_tokens_per_replica": 1, "target_generations_per_replica": 0},
            "must be a finite number of generations",
        ),
        (
            {"target_generations_per_replica": 6},
            "missing 1 required keyword-only argument: 'target_tokens_per_replica'",
        ),
    ]:
        entry = {"name": "ColocatedReplica", "autoscaling_config": scaling(**kwargs)}
        (refused,) = deployment_name_problems({"deployments": [entry]}, colocated)
        assert refused.startswith("`deployments[0].autoscaling_config`.policy.policy_kwargs: ") and error in refused
    unreachable = {
        "name": "ColocatedReplica",
        "autoscaling_config": scaling(target_tokens_per_replica=1, target_generations_per_replica=16),
    }
    (never,) = deployment_name_problems({"deployments": [unreachable]}, colocated)
    assert never.endswith("target_generations_per_replica 16 is never exceeded: a replica runs at most 16")
    both = {
        "name": "ColocatedReplica",
        "autoscaling_config": scaling(target_tokens_per_replica=1, target_generations_per_replica=6),
    }
    assert deployment_name_problems({"deployments": [both]}, colocated) == []
    encoder = {
        "name": "EncoderReplica",
        "autoscaling_config": scaling(target_tokens_per_replica=1, target_generations_per_replica=6),
    }
    (split,) = deployment_name_problems({"deployments": [encoder]}, AppConfig())
    assert split.endswith("only a ColocatedReplica (`llm.colocate`) has them")
    (few,) = deployment_name_problems(
        {"deployments": [{"name": "ColocatedReplica", "max_ongoing_requests": 16}]}, AppConfig(llm={"colocate": True})
    )
    assert "keeps 16 slots for its LLM and packs take the rest" in few
    (alone,) = deployment_name_problems({"deployments": [{"name": "ColocatedReplica"}]}, AppConfig())
    assert alone.endswith("it exists only with `llm.colocate: true`")
