"""The application builder: `serve run configs/local.yaml` calls `build_app(args)`.

    applications:
      - name: encoder
        import_path: deployments.app:build_app
        args: {model: {family: qwen3-vl, preset: tiny}}   # validated as AppConfig

The builder validates first (pydantic, `extra="forbid"`), then binds: an `EncoderRouter`
ingress in front of `EncoderReplica`s routed by queued tokens and, when `llm` is set, an
LLM deployment fed with the encoders' embeddings (E/PD): `LLMReplica` (transformers) or,
with `llm.engine: vllm`, `VLLMReplica`; with `llm.colocate`, one `ColocatedReplica`
deployment runs both sides in each replica. Each deployment's Serve options (replicas,
`ray_actor_options`, autoscaling) can be overridden in the YAML's `deployments:` section by
these names.

Serve builds an application in a task of its own before any replica starts, so the build
is on the path to the first answer: it names the deployments' classes by import path (each
replica imports its own) and imports neither torch nor transformers for a preset.
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Deployment
from ray.serve.schema import LoggingConfig

from .config import AppConfig, deployment_ladder
from .deployment_names import COLOCATED, ENCODER, ENCODER_SLOTS, LLM_ENGINES, LLM_SLOTS, ROUTER, name_of
from .validation import validate

ROUTING_STATS_PERIOD_S = 1.0


def deployment(import_path: str, **options) -> Deployment:
    """A deployment of the class at `import_path` (`module.Class`), named after the class."""
    return serve.deployment(name=name_of(import_path), **options)(import_path)


def gpus(device: str) -> int:
    return 1 if device == "cuda" else 0


def packs_by_tokens() -> RequestRouterConfig:
    """Packs go to the replica with the fewest queued tokens (`router/routing.py`)."""
    return RequestRouterConfig(
        request_router_class="deployments.router.routing.FewestQueuedTokensRouter",
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
    )


def encoder_deployment(config: AppConfig, logging_config: LoggingConfig) -> Deployment:
    """The encoder replica deployment with defaults for its device (one GPU each on CUDA)."""
    return deployment(
        ENCODER,
        max_ongoing_requests=ENCODER_SLOTS,
        health_check_period_s=10,
        ray_actor_options={"num_cpus": 1, "num_gpus": gpus(config.model.device)},
        logging_config=logging_config,
        request_router_config=packs_by_tokens(),
    )


def llm_deployment(config: AppConfig, logging_config: LoggingConfig) -> Deployment:
    """The E/PD language model: transformers' (`LLMReplica`) or vLLM's engine (`VLLMReplica`)."""
    return deployment(
        LLM_ENGINES[config.llm.engine],
        max_ongoing_requests=LLM_SLOTS[config.llm.engine],
        ray_actor_options={"num_cpus": 1, "num_gpus": gpus(config.llm.device)},
        logging_config=logging_config,
    )


COLOCATED_SHUTDOWN_S = 120.0
"""Serve's bound on a colocated replica's stop: its generations in flight finish first (2048 tokens
take tens of seconds), then its stored results are read."""


def colocated_deployment(config: AppConfig, logging_config: LoggingConfig) -> Deployment:
    """`llm.colocate`: encoder and LLM in one replica, routed as the encoders are (packs by queued
    tokens, generations by those in flight); its slots hold the encoder's packs and the LLM's requests."""
    return deployment(
        COLOCATED,
        max_ongoing_requests=ENCODER_SLOTS + LLM_SLOTS[config.llm.engine],
        health_check_period_s=10,
        graceful_shutdown_timeout_s=COLOCATED_SHUTDOWN_S,
        ray_actor_options={"num_cpus": 2, "num_gpus": gpus(config.model.device)},
        logging_config=logging_config,
        request_router_config=packs_by_tokens(),
    )


def build_app(args: dict) -> Application:
    """Validate everything that can be checked now (one clear error, no replica started), then bind."""
    config = validate(args)
    ladder = deployment_ladder(config)
    logging_config = LoggingConfig(enable_access_log=config.router.log_requests)
    router = deployment(ROUTER, max_ongoing_requests=2048, logging_config=logging_config)
    if config.llm is not None and config.llm.colocate:  # one deployment serves both sides
        both = colocated_deployment(config, logging_config).bind(config, ladder)
        return router.bind(config, both, both, ladder)
    encoder = encoder_deployment(config, logging_config).bind(config, ladder)
    llm = None if config.llm is None else llm_deployment(config, logging_config).bind(config)
    return router.bind(config, encoder, llm, ladder)
