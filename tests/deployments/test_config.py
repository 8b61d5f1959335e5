"""The YAML `args` are validated before anything is built: bad values name the field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import ValidationError

from deployments.config import AppConfig, LLMSettings
from encoder_graphs.config import GraphConfig
from models import attention
from models.attention import AttentionBackend


@pytest.mark.parametrize(
    ("graphs", "field"),
    [
        ({"segment_density": 0}, "segment_density"),
        ({"budget_growth": 1.0}, "budget_growth"),
        ({"max_budget_tokens": 0}, "max_budget_tokens"),
        ({"memory_fraction": 1.5}, "memory_fraction"),
        ({"segment_desnity": 4}, "segment_desnity"),  # a typo is an error, not a silent default
        ({"finer_budget_range": [4096, 1024]}, "finer_budget_range"),
        ({"finer_budget_range": [0, 1024]}, "finer_budget_range"),
        ({"finer_budget_range": [1024]}, "finer_budget_range"),
        ({"finer_budget_steps": 0}, "finer_budget_steps"),
        ({"budgets": []}, "budgets"),
        ({"recurring_graphs": -1}, "recurring_graphs"),
        ({"compile_cache": 3}, "compile_cache"),
        ({"compile_cache_key_file": ""}, "compile_cache_key_file"),
    ],
)
def test_bad_graph_settings_are_refused_naming_the_field(graphs, field):
    with pytest.raises(ValidationError) as raised:
        AppConfig.model_validate({"graphs": graphs})
    assert field in str(raised.value)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"model": {"switch_interval_ms": 0}}, "switch_interval_ms"),
        ({"model": {"switch_interval_ms": float("inf")}}, "switch_interval_ms"),  # setswitchinterval would store 0
        ({"model": {"switch_interval_ms": 1000}}, "switch_interval_ms"),  # would starve the event loop
        ({"router": {"handle_hold_s": -1}}, "handle_hold_s"),
    ],
)
def test_bad_process_settings_are_refused_naming_the_field(args, field):
    with pytest.raises(ValidationError) as raised:
        AppConfig.model_validate(args)
    assert field in str(raised.value)


def test_graph_settings_reach_the_runner_config():
    config = AppConfig.model_validate({"graphs": {"segment_density": 4, "budget_growth": 1.5}})
    assert isinstance(config.graphs, GraphConfig)  # the runner's own config, validated here
    assert (config.graphs.segment_density, config.graphs.budget_growth) == (4, 1.5)
    finer = AppConfig.model_validate({"graphs": {"finer_budget_range": [2048, 8192], "finer_budget_steps": 32}})
    assert (finer.graphs.finer_budget_range, finer.graphs.finer_budget_steps) == ((2048, 8192), 32)
    off = AppConfig.model_validate({"graphs": {"finer_budget_range": None, "budgets": [64, 256]}})
    assert off.graphs.finer_budget_range is None and off.graphs.budgets == (64, 256)


def test_yaml_errors_name_the_field_and_every_graph_field_is_described():
    document = yaml.safe_load("graphs:\n  max_budget_tokens: 8192\n  memory_fraction: 2\n")
    with pytest.raises(ValidationError, match=r"graphs.memory_fraction must be in \(0, 1\]; got 2"):
        AppConfig.model_validate(document)
    uncompiled = {"graphs": {"compile": False, "precompile_regions": True}}
    with pytest.raises(ValidationError, match=r"graphs.precompile_regions needs graphs.compile: true"):
        AppConfig.model_validate(uncompiled)
    schema = AppConfig.model_json_schema()["$defs"]["GraphConfig"]
    fields = {field.name for field in dataclasses.fields(GraphConfig)}
    assert set(schema["properties"]) == fields and schema["additionalProperties"] is False
    assert all(schema["properties"][name].get("description") for name in fields)


def test_default_attention_kernel_is_the_library_default():
    """The service must not pick a different CUDA kernel than models/ does by default."""
    assert AppConfig().model.attention == attention.DEFAULT_BACKEND == "auto"
    for name in attention.BACKENDS:  # the config offers exactly the kernels models/ knows
        assert AppConfig.model_validate({"model": {"attention": name}}).model.attention == name
    with pytest.raises(ValidationError, match="attention"):
        AppConfig.model_validate({"model": {"attention": "sdpa"}})


@pytest.mark.skipif(attention.cudnn_frontend_available(), reason="checks the refusal where cuDNN cannot serve")
def test_cudnn_attention_without_its_frontend_or_gpu_is_refused_and_auto_falls_back():
    cuda = "cuda"  # resolving never allocates: it only asks what the device can run
    with pytest.raises(ValueError, match=r"nvidia-cudnn-frontend.*'auto'"):
        AttentionBackend.resolve("cudnn", cuda)
    assert AttentionBackend.resolve("auto", cuda).kernel in ("flash", "triton")
    assert AttentionBackend.resolve("flash", cuda).kernel == "flash"
    if not attention.fa3_available():  # no Hopper GPU, or no vLLM build: FlashAttention-3 is refused by name
        with pytest.raises(ValueError, match="'fa3' needs a Hopper GPU, vLLM's FlashAttention-3 build"):
            AttentionBackend.resolve("fa3", cuda)
    else:
        assert AttentionBackend.resolve("fa3", cuda).kernel == "fa3"
    if not attention.triton_available():  # CPU, or no triton: our kernel is refused as cuDNN's is
        with pytest.raises(ValueError, match="'triton' needs a CUDA GPU"):
            AttentionBackend.resolve("triton", cuda)
        assert AttentionBackend.resolve("auto", cuda).kernel == "flash"
    with pytest.raises(ValueError, match="not one of"):
        AttentionBackend.resolve("sdpa", cuda)


def test_the_vllm_engine_needs_a_checkpoint_on_both_sides():
    with pytest.raises(ValidationError, match="llm.path"):
        AppConfig.model_validate({"llm": {"engine": "vllm"}})
    with pytest.raises(ValidationError, match="model.path"):
        AppConfig.model_validate({"llm": {"engine": "vllm", "path": "/ckpt"}})
    config = AppConfig.model_validate({"model": {"path": "/ckpt"}, "llm": {"engine": "vllm", "path": "/ckpt"}})
    assert config.llm.engine == "vllm" and AppConfig.model_validate({"llm": {}}).llm.engine == "transformers"


def test_engine_kwargs_are_vllms_only_and_leave_the_checkpoint_and_dtype_to_their_fields():
    both = {"model": {"path": "/ckpt"}}
    with pytest.raises(ValidationError, match="engine_kwargs"):
        AppConfig.model_validate({**both, "llm": {"path": "/ckpt", "engine_kwargs": {"max_model_len": 4096}}})
    with pytest.raises(ValidationError, match=r"\['dtype', 'model'\]"):
        AppConfig.model_validate(
            {**both, "llm": {"engine": "vllm", "path": "/ckpt", "engine_kwargs": {"model": "x", "dtype": "half"}}}
        )


def test_the_vllm_prompt_limit_follows_the_engines_context_unless_given():
    """A prompt `vllm serve` would answer on the same `max_model_len` is not refused by a default below it."""

    def limit(**llm) -> int:
        config = AppConfig.model_validate({"model": {"path": "/ckpt"}, "llm": {"path": "/ckpt", **llm}})
        return config.llm.max_prompt_tokens

    vllm = {"engine": "vllm", "engine_kwargs": {"max_model_len": 32768}}
    assert limit(**vllm, max_tokens=2048) == 30720
    assert limit(**vllm) == 32768 - LLMSettings.model_fields["max_tokens"].default
    assert limit(**vllm, max_prompt_tokens=1000) == 1000
    default = LLMSettings.model_fields["max_prompt_tokens"].default
    assert limit(engine="vllm") == default  # vLLM's context is then the checkpoint's, unknown here
    assert limit() == default  # the transformers engine
    assert limit(**vllm, max_tokens=40000) == default  # no room left: vLLM refuses the settings itself


def test_every_shipped_config_validates_and_names_our_deployments():
    """Each `configs/*.yaml` passes Serve's own schema, its `args` pass `AppConfig`, and it
    configures only deployments this package defines (a misspelled name fails only at deploy)."""
    from pathlib import Path

    from ray.serve.schema import ServeDeploySchema

    from deployments.colocated.replica import ColocatedReplica
    from deployments.encoder.replica import EncoderReplica
    from deployments.llm.transformers_engine import LLMReplica
    from deployments.llm.vllm_engine import VLLMReplica
    from deployments.router.ingress import EncoderRouter

    ours = {d.__name__ for d in (ColocatedReplica, EncoderReplica, EncoderRouter, LLMReplica, VLLMReplica)}
    paths = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
    assert len(paths) >= 6
    for path in paths:
        document = yaml.safe_load(path.read_text())
        ServeDeploySchema.model_validate(document)
        for app in document["applications"]:
            AppConfig.model_validate(app.get("args", {}))
            named = {d["name"] for d in app.get("deployments", [])}
            assert named <= ours, f"{path.name}: {sorted(named - ours)} are not deployments of this package"


def test_a_config_file_is_checked_as_its_build_would_check_it(tmp_path):
    """`python -m deployments.validation FILE` finds what `serve run` would only report once Ray
    and Serve are up, and finds nothing in a good file."""
    from deployments.validation import check_file

    bad = tmp_path / "bad.yaml"
    app = {"import_path": "deployments.app:build_app", "args": {"router": {"max_wiat_ms": 3}}}
    bad.write_text(yaml.safe_dump({"applications": [{"name": "enc", **app}]}))
    assert check_file(str(bad)) == [
        f"{bad}: application 'enc': invalid application args: unknown key `router.max_wiat_ms`: did you mean "
        "`max_wait_ms`?"
    ]
    assert check_file(str(Path(__file__).parents[2] / "configs" / "local.yaml")) == []
    ladder = tmp_path / "ladder.yaml"  # what only the budget ladder refuses
    app = {"import_path": "deployments.app:build_app", "args": {"graphs": {"max_budget_tokens": 1}}}
    ladder.write_text(yaml.safe_dump({"applications": [app, app]}))
    problems = check_file(str(ladder))
    assert 'multiple configs for application "default"' in problems[0]  # Serve's own schema says so
    assert len(problems) == 3 and "max_budget_tokens=1" in problems[1]
    broken = tmp_path / "broken.yaml"
    broken.write_text("applications: [unclosed\n")
    assert check_file(str(broken))[0].startswith(f"{broken}: ")
    assert "No such file" in check_file(str(tmp_path / "absent.yaml"))[0]
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"applications": [{"name": "x", "import_path": "somewhere:else"}]}))
    assert "no application with import_path deployments.app:build_app" in check_file(str(other))[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_prebuilding_the_compile_cache_without_a_gpu_says_so():
    from deployments.encoder.compile_cache import main

    with pytest.raises(SystemExit, match="no CUDA GPU"):
        main(["--config", str(Path(__file__).parents[2] / "configs" / "gpu.yaml")])


def test_the_application_build_imports_no_torch_and_binds_every_deployment():
    """Serve builds the app before any replica starts: the build must not pay for torch or
    transformers (seconds on a GPU host), and its import-path deployments must name real classes."""
    import importlib
    import subprocess
    import sys

    probe = (
        "import sys, yaml; from deployments.app import build_app\n"
        "for path in ('configs/local.yaml', 'configs/epd.yaml'):\n"
        "    build_app(yaml.safe_load(open(path))['applications'][0]['args'])\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'PIL'}))\n"
    )
    root = __import__("pathlib").Path(__file__).parents[2]
    done = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr

    from deployments.app import build_app

    app = build_app(yaml.safe_load((root / "configs/epd.yaml").read_text())["applications"][0]["args"])
    bound = [app._bound_deployment]
    bound += [a._bound_deployment for a in app._bound_deployment.init_args if hasattr(a, "_bound_deployment")]
    for deployment in bound:
        module, _, name = deployment.func_or_class.rpartition(".")
        assert name == deployment.name and isinstance(getattr(importlib.import_module(module), name), type)
    assert {d.name for d in bound} == {"EncoderRouter", "EncoderReplica", "LLMReplica"}


def test_the_router_module_imports_no_torch():
    """A router replica imports its module before its constructor runs: torch and transformers
    come only in the constructor, after it spawned the decode template that imports them too."""
    import subprocess
    import sys

    probe = (
        "import sys, deployments.router.ingress\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'PIL'}))\n"
    )
    root = __import__("pathlib").Path(__file__).parents[2]
    done = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.parametrize(
    ("path", "served"),
    [
        ("Qwen/Qwen3-VL-8B-Instruct", "Qwen/Qwen3-VL-8B-Instruct"),
        ("/srv/private/checkpoints/qwen3-vl-2b/", "qwen3-vl-2b"),
        ("./checkpoints/qwen3-vl-2b", "qwen3-vl-2b"),
        ("~/models/internvl3-1b", "internvl3-1b"),
        (
            "/home/me/.cache/huggingface/hub/models--Qwen--Qwen3-VL-2B-Instruct/snapshots/0123abcd",
            "Qwen/Qwen3-VL-2B-Instruct",
        ),
    ],
    ids=["hub id", "absolute directory", "relative directory", "home directory", "hub cache snapshot"],
)
def test_a_checkpoint_is_served_by_its_hub_id_or_its_directorys_name(path, served):
    config = AppConfig.model_validate({"model": {"path": path}, "llm": {"path": path}})
    assert config.model.model_id == config.llm.model_id == served


def test_the_reference_is_rewritten_in_place_between_its_markers(tmp_path):
    import subprocess
    import sys

    from deployments.config import REFERENCE_END, REFERENCE_START, reference_markdown

    root = Path(__file__).resolve().parents[2]
    stale = tmp_path / "configuration.md"
    stale.write_text(f"# Prose kept\n\n{REFERENCE_START}| an old table |{REFERENCE_END}\n\nMore prose.\n")
    unmarked = tmp_path / "unmarked.md"
    unmarked.write_text("# No markers\n")
    write = [sys.executable, "-m", "deployments.config", "--write"]
    subprocess.run([*write, str(stale)], cwd=root, check=True)
    refused = subprocess.run([*write, str(unmarked)], cwd=root, capture_output=True, text=True)
    regenerated = f"{REFERENCE_START}{reference_markdown()}{REFERENCE_END}"
    assert stale.read_text() == f"# Prose kept\n\n{regenerated}\n\nMore prose.\n"
    assert refused.returncode == 1 and "config-reference:start" in refused.stderr
    assert unmarked.read_text() == "# No markers\n"
