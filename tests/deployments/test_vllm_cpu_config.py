"""configs/epd-vllm-cpu.yaml starts as shipped and answers a chat, with the checkpoint made as the
README says (`python -m models.tiny_checkpoint qwen3-vl DIR --for-vllm`); the validator passes it.
Skipped without vLLM (the main CI env); the vLLM CI step (.ci/vllm) sets `REQUIRE_VLLM=1`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

if os.environ.get("REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (an ImportError here fails the vLLM CI step instead of skipping)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed; the vLLM CI step (.ci/vllm) installs it")

from openai import OpenAI

from deployments.validation import check_file
from tests.deployments.media_helpers import pattern
from tests.deployments.test_epd import openai_messages

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "epd-vllm-cpu.yaml"
NAME = "epd-vllm-cpu"
START_WITHIN_S = 600
"""Room for vLLM's import and engine start on a shared 2-core CI machine (seconds when idle)."""


def shipped_paths() -> set[str]:
    args = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]
    return {args["model"]["path"], args["llm"]["path"]}


def test_the_validator_passes_the_shipped_config_with_its_checkpoint(tiny_vllm_checkpoint, tmp_path):
    (shipped,) = shipped_paths()
    config = tmp_path / "epd-vllm-cpu.yaml"
    config.write_text(CONFIG.read_text().replace(shipped, tiny_vllm_checkpoint))
    assert check_file(str(config)) == []


def test_the_shipped_cpu_config_starts_and_answers_a_chat(tiny_vllm_checkpoint, serve_harness):
    """Only the checkpoint's place (a temporary directory here), the application's name and route
    differ from the file; every engine argument is as shipped."""
    (shipped,) = shipped_paths()
    url = serve_harness.deploy(
        "configs/epd-vllm-cpu.yaml",
        name=NAME,
        route_prefix=f"/{NAME}",
        wait=False,
        model={"path": tiny_vllm_checkpoint},
        llm={"path": tiny_vllm_checkpoint},
    )
    serve_harness.wait_running(NAME, START_WITHIN_S)
    serve_harness.wait_healthy(url, START_WITHIN_S)
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    served = [model.id for model in client.models.list().data]
    assert served[-1] == Path(shipped).name  # the directory's name, as the config's comment says
    reply = client.chat.completions.create(
        model=served[-1], messages=openai_messages([pattern(96, 64)]), max_tokens=8, temperature=0
    )
    assert reply.usage.completion_tokens == 8 and reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens > 8
