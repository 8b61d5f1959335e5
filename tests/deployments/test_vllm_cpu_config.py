"""configs/epd-vllm-cpu.yaml passes the validator with the checkpoint made as the README says
(`python -m models.tiny_checkpoint qwen3-vl DIR --for-vllm`); that it starts as shipped and answers
chats is the serving benchmark's CPU run (tests/test_vllm_serving_bench_run.py). Skipped without
vLLM (the main CI env); the vLLM CI step (.ci/vllm) sets `REQUIRE_VLLM=1`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

if os.environ.get("REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (an ImportError here fails the vLLM CI step instead of skipping)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed; the vLLM CI step (.ci/vllm) installs it")

from deployments.validation import check_file

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "epd-vllm-cpu.yaml"


def shipped_paths() -> set[str]:
    args = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]
    return {args["model"]["path"], args["llm"]["path"]}


def test_the_validator_passes_the_shipped_config_with_its_checkpoint(tiny_vllm_checkpoint, tmp_path):
    (shipped,) = shipped_paths()
    config = tmp_path / "epd-vllm-cpu.yaml"
    config.write_text(CONFIG.read_text().replace(shipped, tiny_vllm_checkpoint))
    assert check_file(str(config)) == []
