"""The transformers LLM replica (`llm.engine: transformers`, the reference) outside Serve: what its
sampling fields do to a real tiny Qwen3-VL's generation."""

from __future__ import annotations

import asyncio

import pytest

from deployments.config import AppConfig
from deployments.llm.transformers_engine import LLMReplica
from deployments.wire import GenerateRequest
from models.tiny_checkpoint import save_tiny_vlm

MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Count to ten, slowly."}]}]


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3-vl")
    save_tiny_vlm("qwen3-vl", directory, seed=5)
    return LLMReplica(AppConfig(llm={"family": "qwen3-vl", "path": str(directory)}))


def generate(replica: LLMReplica, **fields):
    request = GenerateRequest(messages=MESSAGES, embeddings=[], grids=[], max_tokens=16, **fields)
    return asyncio.run(replica.generate(request))


def test_ignore_eos_generates_max_tokens_past_the_end_of_sequence(replica):
    """A random model rarely meets its own EOS, so the test makes one: the token greedy decoding
    emits third becomes the end-of-sequence token. Without `ignore_eos` generation stops there;
    with it, all 16 tokens come, the same greedy ones."""
    free = generate(replica).token_ids
    assert len(free) == 16
    stop = free[2]
    config = replica.model.generation_config
    original = config.eos_token_id
    config.eos_token_id = stop
    try:
        stopped = generate(replica)
        ignored = generate(replica, ignore_eos=True)
    finally:
        config.eos_token_id = original
    assert stopped.token_ids == free[: free.index(stop) + 1]
    assert ignored.token_ids == free and ignored.finish_reason == "length"
