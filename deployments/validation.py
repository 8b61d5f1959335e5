"""Checks that make a config that cannot work fail once, at build time, with one message.

Serve shows a `RayServeException` raised by an application builder as its message alone
(any other exception as a traceback, and a replica constructor's failure as a traceback per
retry), so every check here raises `ConfigError` naming the key, the value and the fix.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError
from ray.serve.exceptions import RayServeException

from .config import AppConfig, deployment_ladder


class ConfigError(RayServeException):
    """The application's `args` cannot work; the message says which key and how to fix it."""


def _fields(model: type[BaseModel] | None) -> list[str]:
    return list(model.model_fields) if model is not None and hasattr(model, "model_fields") else []


def _model_at(location: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = AppConfig
    for part in location:
        field = (model.model_fields if model is not None and hasattr(model, "model_fields") else {}).get(part)
        if field is None:
            return None
        annotation = field.annotation
        candidates = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)]
        model = next((a for a in candidates if issubclass(a, BaseModel)), None)
    return model


def _explain(error: dict) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "args"
    if error["type"] == "extra_forbidden":
        key = str(error["loc"][-1])
        known = _fields(_model_at(error["loc"][:-1]))
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean `{close[0]}`?" if close else f"known keys: {', '.join(known)}"
        return f"unknown key `{where}`: {hint}"
    value = error.get("input")
    shown = "" if isinstance(value, dict) else f" (got {value!r})"
    return f"`{where}`{shown}: {error['msg']}"


def parse_args(args) -> AppConfig:
    """The YAML `args` as an `AppConfig`, or a `ConfigError` listing what is wrong."""
    if isinstance(args, AppConfig):
        return args
    try:
        return AppConfig.model_validate(args or {})
    except ValidationError as error:
        problems = [_explain(e) for e in error.errors()]
        raise ConfigError("invalid application args: " + "; ".join(problems)) from None


def check_path(key: str, path: str | None, family: str | None) -> None:
    """A checkpoint path must hold a config transformers can read, of the configured family."""
    if path is None:
        return
    from models import CheckpointError, load_preprocessor

    if not Path(path).exists() and Path(path).is_absolute():
        raise ConfigError(f"`{key}`: {path!r} does not exist; give a checkpoint directory or a hub id")
    try:
        load_preprocessor(None, family, path)
    except CheckpointError as error:
        raise ConfigError(f"`{key}`: {error}") from None
    except Exception as error:  # the hub, a missing or broken config.json, ...
        raise ConfigError(
            f"`{key}`: cannot read a model config from {path!r} ({type(error).__name__}: {error}); "
            "give a checkpoint directory (config.json + safetensors) or a hub id that is reachable"
        ) from None


def check_device(key: str, device: str) -> None:
    """`cuda` needs a GPU somewhere in the cluster."""
    if device != "cuda":
        return
    import ray

    gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    if gpus == 0:
        raise ConfigError(
            f"`{key}` is 'cuda' but no node of this Ray cluster has a GPU; use `{key}: cpu`, or start Ray on GPU nodes"
        )


def validate(args, devices: bool = True) -> AppConfig:
    """Everything that can be checked before any replica starts (`devices`: whether the running
    cluster has the GPUs the config asks for)."""
    config = parse_args(args)
    check_path("model.path", config.model.path, config.model.family if config.model.path else None)
    if devices:
        check_device("model.device", config.model.device)
    if config.llm is not None:
        check_path("llm.path", config.llm.path, config.llm.family)
        if devices:
            check_device("llm.device", config.llm.device)
    return config


BUILD_APP = "deployments.app:build_app"


def serve_config_apps(path: str) -> list[tuple[str, dict]]:
    """(name, `args`) of each application a Serve config file builds with `deployments.app:build_app`."""
    document = yaml.safe_load(Path(path).read_text())
    applications = document.get("applications", []) if isinstance(document, dict) else []
    return [
        (app.get("name", "default"), app.get("args") or {})
        for app in applications
        if isinstance(app, dict) and app.get("import_path") == BUILD_APP
    ]


def check_file(path: str) -> list[str]:
    """What the build would refuse in a Serve config file's applications, one line each: the
    build's own checks (`validate`, the budget ladder), but for the GPUs, which it asks the
    running cluster for."""
    from encoder_graphs.budgets import BudgetConfigError

    try:
        apps = serve_config_apps(path)
    except (OSError, yaml.YAMLError) as error:
        return [f"{path}: {error}"]
    if not apps:
        return [f"{path}: no application with import_path {BUILD_APP}"]
    names = [name for name, _ in apps]
    problems = [
        f"{path}: application name {n!r} is used twice" for n in sorted({n for n in names if names.count(n) > 1})
    ]
    for name, args in apps:
        try:
            deployment_ladder(validate(args, devices=False))
        except (ConfigError, BudgetConfigError) as error:
            problems.append(f"{path}: application {name!r}: {error}")
    return problems


if __name__ == "__main__":  # python -m deployments.validation configs/my.yaml ...
    if len(sys.argv) < 2:
        sys.exit("usage: python -m deployments.validation CONFIG.yaml ...")
    found = [problem for path in sys.argv[1:] for problem in check_file(path)]
    print("\n".join(found) or f"ok: {' '.join(sys.argv[1:])}")
    sys.exit(1 if found else 0)
