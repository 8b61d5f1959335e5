"""The YAML `args` are validated before anything is built: bad values name the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.config import AppConfig
from models import attention


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
    ],
)
def test_bad_graph_settings_are_refused_naming_the_field(graphs, field):
    with pytest.raises(ValidationError) as raised:
        AppConfig.model_validate({"graphs": graphs})
    assert field in str(raised.value)


def test_graph_settings_reach_the_runner_config():
    config = AppConfig.model_validate({"graphs": {"segment_density": 4, "budget_growth": 1.5}})
    graph_config = config.graphs.to_config()
    assert (graph_config.segment_density, graph_config.budget_growth) == (4, 1.5)
    finer = AppConfig.model_validate({"graphs": {"finer_budget_range": [2048, 8192], "finer_budget_steps": 32}})
    assert (finer.graphs.to_config().finer_budget_range, finer.graphs.to_config().finer_budget_steps) == (
        (2048, 8192),
        32,
    )
    off = AppConfig.model_validate({"graphs": {"finer_budget_range": None}})
    assert off.graphs.to_config().finer_budget_range is None


def test_default_attention_kernel_is_the_library_default():
    """The service must not pick a different CUDA kernel than models/ does by default."""
    assert AppConfig().model.attention == attention.DEFAULT_BACKEND == "auto"
    for name in attention.BACKENDS:  # the config offers exactly the kernels models/ knows
        assert AppConfig.model_validate({"model": {"attention": name}}).model.attention == name
    with pytest.raises(ValidationError, match="attention"):
        AppConfig.model_validate({"model": {"attention": "sdpa"}})


@pytest.mark.skipif(attention.cudnn_frontend_available(), reason="checks the refusal where cuDNN cannot serve")
def test_cudnn_attention_without_its_frontend_or_gpu_is_refused_and_auto_falls_back(monkeypatch):
    monkeypatch.setattr(attention, "_use_cudnn", attention._use_cudnn)  # restored after the test
    monkeypatch.setattr(attention, "_use_triton", attention._use_triton)
    with pytest.raises(ValueError, match=r"nvidia-cudnn-frontend.*'auto'"):
        attention.set_backend("cudnn")
    assert attention.set_backend("auto") == "flash"
    assert attention.set_backend("flash") == "flash"
    if not attention.triton_available():  # CPU, or no triton: our kernel is refused as cuDNN's is
        with pytest.raises(ValueError, match="'triton' needs a CUDA GPU"):
            attention.set_backend("triton")
        assert not attention._use_triton
    with pytest.raises(ValueError, match="not one of"):
        attention.set_backend("sdpa")


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
