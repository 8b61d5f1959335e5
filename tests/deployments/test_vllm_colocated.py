"""`llm.colocate` with vLLM: configs/epd-vllm.yaml with encoder and vLLM in one `ColocatedReplica`, on
CPU with the tiny vLLM-shaped checkpoint; its chats' greedy ids equal vLLM's own from the pixels
(offline `vllm.LLM`). Skipped without vLLM; run by the vLLM CI step (.ci/vllm)."""

from __future__ import annotations

import pytest
from ray import serve

# first: imports vLLM or skips the module (REQUIRE_VLLM=1: fails) as test_vllm does
from tests.deployments.test_vllm import ENGINE_KWARGS, PROMPTS, chat, own_outputs, tiny_checkpoint
from tests.serve_harness import REMOVE, UNCOMPILED

NAME = "epd-vllm-colocated"
CPU = {"num_cpus": 0, "num_gpus": 0}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint("qwen3-vl", tmp_path_factory)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """vLLM's own greedy ids from the pixels, offline (test_vllm.py's, where it ran first in the session)."""
    return {count: ids for count, (ids, _) in own_outputs("qwen3-vl", checkpoint).items() if count in PROMPTS}


@pytest.fixture(scope="module")
def url(checkpoint, reference, serve_harness):
    model = {"family": "qwen3-vl", "path": checkpoint, "device": "cpu", "dtype": "float32"}
    url = serve_harness.deploy(
        "configs/epd-vllm.yaml",
        name=NAME,
        route_prefix=f"/{NAME}",
        deployment_entries=[
            {"name": "EncoderRouter", "num_replicas": 1, "ray_actor_options": CPU},
            {"name": "ColocatedReplica", "num_replicas": 1, "ray_actor_options": CPU},
        ],
        model=model,
        graphs=UNCOMPILED,
        limits={"max_items_per_request": 3},
        llm={
            **model,
            "colocate": True,
            "max_tokens": 512,
            "engine_kwargs": {**ENGINE_KWARGS, "gpu_memory_utilization": REMOVE},
        },
    )
    yield url
    serve.delete(NAME)
    serve_harness.apps.pop(NAME)


@pytest.mark.parametrize("count", sorted(PROMPTS))
def test_colocated_chat_greedy_ids_equal_vllm_from_pixels(url, reference, count):
    reply = chat(url, PROMPTS[count])
    assert reply["choices"][0]["token_ids"] == reference[count]
    assert (reply["usage"]["vision_tokens"] > 0) == (count > 0)


def test_describe_shows_both_sides(url):
    detail = serve.get_deployment_handle("ColocatedReplica", NAME).describe.remote().result(timeout_s=60)
    assert detail["llm"]["engine"] == "vllm" and detail["llm"]["handoff_images"] >= 4 and "forwards" in detail
