"""Checks that make a config that cannot work fail once, at build time, with one message.

Serve shows a `RayServeException` raised by an application builder as its message alone
(any other exception as a traceback, and a replica constructor's failure as a traceback per
retry), so every check here raises `ConfigError` naming the key, the value and the fix.

`python -m deployments.validation FILE.yaml` checks a whole Serve config file without starting
anything: Serve's own schema (`ServeDeploySchema`: types, and the keys Serve would silently
ignore), each application's `args`, the names in its `deployments:` against the deployments it
builds, and the vLLM engine arguments that can be checked without vLLM.
"""

from __future__ import annotations

import difflib
import json
import sys
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError
from ray.serve.exceptions import RayServeException

from .config import AppConfig, deployment_ladder
from .deployment_names import ENCODER, LLM_ENGINES, LLM_SLOTS, deployment_names, name_of


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
        problems = engine_problems(config.llm)
        if problems:
            raise ConfigError("; ".join(problems))
    return config


def checkpoint_config(path: str) -> dict | None:
    """A checkpoint's config.json, from its directory or the hub's local cache (never the network);
    None where there is none to read."""
    local = Path(path).expanduser()
    if local.is_dir():
        file = local / "config.json"
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(path, "config.json")
        except Exception:  # not a hub id either: check_path says so
            return None
        file = Path(found) if isinstance(found, str) else None
    if file is None or not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except ValueError:
        return None


def context_length(config: dict) -> int | None:
    """The language model's longest context in a VLM's config.json (`max_position_embeddings`, in
    its `text_config` or at the top level)."""
    for section in (config.get("text_config") or {}, config.get("llm_config") or {}, config):
        if isinstance(section.get("max_position_embeddings"), int):
            return section["max_position_embeddings"]
    return None


def engine_problems(settings) -> list[str]:
    """What vLLM would refuse in `llm.engine_kwargs` (or crash-loop on), as far as it can be told
    without importing vLLM: a `max_model_len` over the checkpoint's context, and
    `gpu_memory_utilization` on a CPU device (vLLM's CPU backend reads it as a share of host RAM)."""
    if settings.engine != "vllm":
        return []
    kwargs, problems = settings.engine_kwargs, []
    if "max_model_len" in kwargs:
        found = checkpoint_config(settings.path)
        longest = None if found is None else context_length(found)
        if longest is not None and isinstance(kwargs["max_model_len"], int) and kwargs["max_model_len"] > longest:
            problems.append(
                f"`llm.engine_kwargs.max_model_len` ({kwargs['max_model_len']}) exceeds the checkpoint's "
                f"max_position_embeddings={longest} ({settings.path}); vLLM refuses to start: set it to {longest} "
                "or less"
            )
    if settings.device == "cpu" and "gpu_memory_utilization" in kwargs:
        problems.append(
            f"`llm.engine_kwargs.gpu_memory_utilization` ({kwargs['gpu_memory_utilization']}) with `llm.device: cpu`: "
            "vLLM's CPU backend has no GPU memory and would take that share of the host's RAM for its KV cache; "
            "remove it and size the cache with `kv_cache_memory_bytes` (e.g. 268435456)"
        )
    return problems


BUILD_APP = "deployments.app:build_app"


def _where(document, location: tuple) -> str:
    """A Serve config location as the YAML reads it: `applications[0] (epd).deployments[2]
    (LLMReplica).num_replica`, each list entry with its `name` where it has one."""
    parts, value = [], document
    for part in location:
        value = value[part] if isinstance(value, (dict, list)) and _has(value, part) else None
        if isinstance(part, int):
            named = f" ({value['name']})" if isinstance(value, dict) and isinstance(value.get("name"), str) else ""
            parts[-1] = f"{parts[-1]}[{part}]{named}"
        else:
            parts.append(str(part))
    return ".".join(parts) or "the file"


def _in_document(document, location: tuple) -> tuple:
    """The part of a pydantic error location that is in the document (without the union member tags
    pydantic appends, e.g. `num_replicas.constrained-int`)."""
    kept, value = [], document
    for part in location:
        if not (isinstance(value, (dict, list)) and _has(value, part)):
            break
        kept.append(part)
        value = value[part]
    return tuple(kept)


def _has(value, part) -> bool:
    return part in value if isinstance(value, dict) else isinstance(part, int) and 0 <= part < len(value)


def _models_of(annotation) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation admits (in unions and lists too)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for argument in getattr(annotation, "__args__", ()) for model in _models_of(argument)]


def unknown_keys(model: type[BaseModel], value, location: tuple = ()) -> list[tuple[tuple, list[str]]]:
    """(location, the keys known there) of every key of `value` that `model` does not define, at
    any depth: Serve's schemas accept and drop them, so a misspelt option is silently ignored."""
    if isinstance(value, list):
        return [found for index, item in enumerate(value) for found in unknown_keys(model, item, (*location, index))]
    if not isinstance(value, dict):
        return []
    fields = {**{f.alias: f for f in model.model_fields.values() if f.alias}, **model.model_fields}
    found = []
    for key, item in value.items():
        field = fields.get(key)
        if field is None:
            found.append(((*location, key), list(model.model_fields)))
            continue
        for nested in _models_of(field.annotation)[:1]:
            found += unknown_keys(nested, item, (*location, key))
    return found


def serve_schema_problems(document) -> list[str]:
    """What Serve's own schema refuses (types, missing keys) or silently drops (unknown keys)."""
    from ray.serve.schema import ServeDeploySchema

    problems = []
    try:
        ServeDeploySchema.model_validate(document)
    except ValidationError as error:
        found: dict[str, list[str]] = {}  # a union's alternatives fail at the same key: one line for them
        for e in error.errors():
            value = e.get("input")
            shown = "" if isinstance(value, (dict, list)) else f" (got {value!r})"
            found.setdefault(f"`{_where(document, _in_document(document, e['loc']))}`{shown}", []).append(e["msg"])
        problems += [f"{where}: {' or '.join(dict.fromkeys(messages))}" for where, messages in found.items()]
    for location, known in unknown_keys(ServeDeploySchema, document):
        key = str(location[-1])
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean `{close[0]}`?" if close else f"known keys: {', '.join(known)}"
        problems.append(f"unknown key `{_where(document, location)}` (Serve would ignore it): {hint}")
    return problems


SPLIT_SIDES = (name_of(ENCODER), *map(name_of, LLM_ENGINES.values()))
"""The deployments `llm.colocate` folds into `ColocatedReplica`."""


TOKEN_POLICY = "deployments.autoscaling:TokenAutoscalingPolicy"


def autoscaling_problem(index: int, entry: dict, config: AppConfig) -> str | None:
    """An entry's token policy whose kwargs it would refuse when Serve builds it, a colocated replica
    set to autoscale without counting its LLM's generations, or that count asked of a deployment
    without generations or above what its LLM can hold."""
    scaling = entry.get("autoscaling_config")
    policy = scaling.get("policy") if isinstance(scaling, dict) else None
    token_policy = isinstance(policy, dict) and str(policy.get("policy_function", "")).strip() == TOKEN_POLICY
    kwargs = policy.get("policy_kwargs") if token_policy else None
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    where = f"`deployments[{index}].autoscaling_config`"
    if token_policy:
        from .autoscaling import AutoscalingPolicyConfigError, TokenAutoscalingPolicy

        try:
            TokenAutoscalingPolicy(**kwargs)
        except (AutoscalingPolicyConfigError, TypeError) as error:
            return f"{where}.policy.policy_kwargs: {error}"
    target = kwargs.get("target_generations_per_replica")
    if entry.get("name") != "ColocatedReplica" or config.llm is None or not config.llm.colocate:
        if target is None:
            return None
        return f"{where} sets target_generations_per_replica: only a ColocatedReplica (`llm.colocate`) has them"
    if not scaling:
        return None
    if target is None:
        return (
            f"{where} (ColocatedReplica): autoscale it on `policy.policy_function: {TOKEN_POLICY}` with "
            "`policy_kwargs.target_generations_per_replica`, its LLM's load (docs/autoscaling.md); or `num_replicas`"
        )
    slots = LLM_SLOTS[config.llm.engine]
    if target >= slots:
        return f"{where}: target_generations_per_replica {target} is never exceeded: a replica runs at most {slots}"
    return None


def deployment_name_problems(app: dict, config: AppConfig) -> list[str]:
    """Entries of the application's `deployments:` that name no deployment it builds, and autoscaling
    that Serve or the policy would refuse or that misses a colocated replica's LLM load (`autoscaling_problem`)."""
    names = deployment_names(config)
    colocated = config.llm is not None and config.llm.colocate
    problems = []
    for index, entry in enumerate(app.get("deployments") or []):
        name = entry.get("name") if isinstance(entry, dict) else None
        if isinstance(entry, dict) and (problem := autoscaling_problem(index, entry, config)):
            problems.append(problem)
        slots = entry.get("max_ongoing_requests") if colocated and name == "ColocatedReplica" else None
        if isinstance(slots, int) and slots <= LLM_SLOTS[config.llm.engine]:
            problems.append(
                f"`deployments[{index}].max_ongoing_requests` {slots}: a ColocatedReplica keeps "
                f"{LLM_SLOTS[config.llm.engine]} slots for its LLM and packs take the rest; make it larger"
            )
        if isinstance(name, str) and name not in names:
            if colocated and name in SPLIT_SIDES:
                hint = "with `llm.colocate: true` encoder and LLM are one deployment: name it 'ColocatedReplica'"
            elif name == "ColocatedReplica":
                hint = "it exists only with `llm.colocate: true`"
            else:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"did you mean {close[0]!r}?" if close else "remove it"
            problems.append(
                f"`deployments[{index}].name` {name!r} is not a deployment of this application (it builds "
                f"{', '.join(names)}); {hint}"
            )
    return problems


def check_file(path: str) -> list[str]:
    """What Serve or the build would refuse in a Serve config file, one line each: Serve's schema
    and the keys it would ignore, then each application's `args` (the build's own checks, but for
    the GPUs, which it asks the running cluster for), budget ladder, deployment names and vLLM
    engine arguments."""
    from encoder_graphs.budgets import BudgetConfigError

    try:
        document = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        return [f"{path}: {error}"]
    if not isinstance(document, dict):
        return [f"{path}: not a Serve config (a mapping with `applications:`)"]
    problems = [f"{path}: {problem}" for problem in serve_schema_problems(document)]
    applications = [a for a in document.get("applications") or [] if isinstance(a, dict)]
    apps = [a for a in applications if a.get("import_path") == BUILD_APP]
    if not apps:
        return problems + [f"{path}: no application with import_path {BUILD_APP}"]
    for app in apps:
        name = app.get("name", "default")
        try:
            config = validate(app.get("args") or {}, devices=False)
            deployment_ladder(config)
        except (ConfigError, BudgetConfigError) as error:
            problems.append(f"{path}: application {name!r}: {error}")
            continue
        problems += [f"{path}: application {name!r}: {p}" for p in deployment_name_problems(app, config)]
    return problems


def serve_config_apps(path: str) -> list[tuple[str, dict]]:
    """(name, `args`) of each application a Serve config file builds with `deployments.app:build_app`."""
    document = yaml.safe_load(Path(path).read_text())
    applications = document.get("applications", []) if isinstance(document, dict) else []
    return [
        (app.get("name", "default"), app.get("args") or {})
        for app in applications
        if isinstance(app, dict) and app.get("import_path") == BUILD_APP
    ]


def main(argv: list[str] | None = None) -> int:
    """Check Serve config files: every problem on a line of its own (exit 1), or `ok: FILES`."""
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m deployments validate CONFIG.yaml ...", file=sys.stderr)
        return 2
    found = [problem for path in paths for problem in check_file(path)]
    print("\n".join(found) or f"ok: {' '.join(paths)}")
    return 1 if found else 0


if __name__ == "__main__":  # python -m deployments validate configs/my.yaml ...
    sys.exit(main())
