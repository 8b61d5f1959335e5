"""`python -m deployments.validation FILE` checks a whole Serve config: Serve's own schema and the keys
it would silently ignore, deployment names against the application's deployments, and the vLLM engine
arguments it can check without vLLM. Each problem names its key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments.config import LLMSettings
from deployments.validation import check_file, engine_problems, validate

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, document: dict) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(document))
    return str(path)


def epd_with(edit) -> dict:
    document = yaml.safe_load((ROOT / "configs" / "epd.yaml").read_text())
    edit(document["applications"][0])
    return document


def test_a_misspelt_deployment_name_is_named_with_the_one_meant(tmp_path):
    def misspell(app):
        app["deployments"][2]["name"] = "LLMReplca"

    (problem,) = check_file(write(tmp_path, epd_with(misspell)))
    assert "application 'epd'" in problem and "`deployments[2].name` 'LLMReplca'" in problem, problem
    assert "EncoderRouter, EncoderReplica, LLMReplica" in problem and "did you mean 'LLMReplica'?" in problem


def test_the_llm_deployment_name_follows_the_engine(tmp_path):
    """`VLLMReplica` overrides are for `llm.engine: vllm`; with the transformers engine they would go nowhere."""

    def rename(app):
        app["deployments"][2]["name"] = "VLLMReplica"

    (problem,) = check_file(write(tmp_path, epd_with(rename)))
    assert "'VLLMReplica' is not a deployment of this application" in problem, problem


def test_a_misspelt_serve_key_is_named_at_any_depth(tmp_path):
    def misspell(app):
        app["deployments"][1]["num_replica"] = app["deployments"][1].pop("num_replicas")
        app["deployments"][1]["ray_actor_options"]["num_cpu"] = 0
        app["route_prefx"] = "/"

    problems = check_file(write(tmp_path, epd_with(misspell)))
    assert len(problems) == 3, problems
    text = "\n".join(problems)
    where = "applications[0] (epd).deployments[1] (EncoderReplica)"
    assert f"unknown key `{where}.num_replica` (Serve would ignore it): did you mean `num_replicas`?" in text
    assert f"unknown key `{where}.ray_actor_options.num_cpu` (Serve would ignore it): did you mean `num_cpus`?" in text
    assert (
        "unknown key `applications[0] (epd).route_prefx` (Serve would ignore it): did you mean `route_prefix`?" in text
    )


def test_a_wrong_serve_type_is_named_by_serves_schema(tmp_path):
    def wrong(app):
        app["deployments"][0]["num_replicas"] = -2

    (problem,) = check_file(write(tmp_path, epd_with(wrong)))
    assert problem.startswith(f"{tmp_path / 'serve.yaml'}: `applications[0] (epd).deployments[0] (EncoderRouter)")
    assert "num_replicas" in problem and "(got -2)" in problem, problem


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_config_passes_serves_schema(path):
    """Serve's part of the check (the args need the checkpoints the files name, not all present here)."""
    from deployments.validation import deployment_name_problems, serve_schema_problems

    document = yaml.safe_load((ROOT / path).read_text())
    if "applications" not in document:
        pytest.skip("not a Serve config")
    assert serve_schema_problems(document) == []
    for app in document["applications"]:
        args = app["args"]
        if args.get("model", {}).get("path") is None:  # presets: the whole build check runs here
            assert deployment_name_problems(app, validate(args, devices=False)) == []


def tiny_context_checkpoint(tmp_path: Path) -> str:
    """A checkpoint directory's config.json as the tiny vLLM checkpoint has it (4,096 positions)."""
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_vl", "text_config": {"max_position_embeddings": 4096}})
    )
    return str(tmp_path)


def test_vllm_engine_args_that_cannot_work_on_the_checkpoint_or_the_device_are_named(tmp_path):
    """configs/epd-vllm.yaml's engine args moved to CPU with the tiny checkpoint: vLLM crash-looped."""
    path = tiny_context_checkpoint(tmp_path)
    shipped = yaml.safe_load((ROOT / "configs" / "epd-vllm.yaml").read_text())["applications"][0]["args"]["llm"]
    settings = LLMSettings(**{**shipped, "path": path, "device": "cpu", "dtype": "float32"})
    too_long, memory = engine_problems(settings)
    assert too_long.startswith("`llm.engine_kwargs.max_model_len` (32768) exceeds the checkpoint's ")
    assert "max_position_embeddings=4096" in too_long
    assert memory.startswith("`llm.engine_kwargs.gpu_memory_utilization` (0.85) with `llm.device: cpu`")
    assert "kv_cache_memory_bytes" in memory
    fitting = {"max_model_len": 4096, "kv_cache_memory_bytes": 1 << 28, "enforce_eager": True}
    assert engine_problems(LLMSettings(**{**shipped, "path": path, "device": "cpu", "engine_kwargs": fitting})) == []
    on_gpu = LLMSettings(**{**shipped, "path": path, "engine_kwargs": {"gpu_memory_utilization": 0.85}})
    assert engine_problems(on_gpu) == []


def test_the_cli_checks_a_preset_config_without_importing_torch():
    """What keeps it at a second or two: a preset config needs neither torch nor transformers."""
    code = (
        "import sys; from deployments.validation import check_file; "
        "print(check_file('configs/epd.yaml'), 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "False", "False"], out
    cli = subprocess.run(
        [sys.executable, "-m", "deployments.validation", "configs/local.yaml"], cwd=ROOT, capture_output=True, text=True
    )
    assert (cli.returncode, cli.stdout.strip()) == (0, "ok: configs/local.yaml")
