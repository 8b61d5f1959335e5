"""The application builder: `serve run configs/local.yaml` calls `build_app(args)`.

    applications:
      - name: encoder
        import_path: deployments.app:build_app
        args: {model: {family: qwen3-vl, preset: tiny}}   # validated as AppConfig

The builder validates first (pydantic, `extra="forbid"`), then binds: an `EncoderRouter`
ingress in front of `EncoderReplica`s routed by queued tokens and, when `llm` is set, an
LLM deployment fed with the encoders' embeddings (E/PD): `LLMReplica` (transformers) or,
with `llm.engine: vllm`, `VLLMReplica`. Each deployment's Serve options (replicas,
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
from .deployment_names import ENCODER, LLM_ENGINES, ROUTER, name_of
from .validation import validate

ROUTING_STATS_PERIOD_S = 1.0


def deployment(import_path: str, **options) -> Deployment:
    """A deployment of the class at `import_path` (`module.Class`), named after the class."""
    return serve.deployment(name=name_of(import_path), **options)(import_path)


def encoder_deployment(config: AppConfig, logging_config: LoggingConfig) -> Deployment:
    """The encoder replica deployment with defaults for its device (one GPU each on CUDA)."""
    return deployment(
        ENCODER,
        max_ongoing_requests=8,
        health_check_period_s=10,
        ray_actor_options={"num_cpus": 1, "num_gpus": 1 if config.model.device == "cuda" else 0},
        logging_config=logging_config,
        request_router_config=RequestRouterConfig(
            request_router_class="deployments.router.routing.FewestQueuedTokensRouter",
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
    )


def llm_deployment(config: AppConfig, logging_config: LoggingConfig) -> Deployment:
    """The E/PD language model: transformers' (`LLMReplica`) or vLLM's engine (`VLLMReplica`)."""
    vllm = config.llm.engine == "vllm"
    return deployment(
        LLM_ENGINES[config.llm.engine],
        max_ongoing_requests=64 if vllm else 16,
        ray_actor_options={"num_cpus": 1, "num_gpus": 1 if config.llm.device == "cuda" else 0},
        logging_config=logging_config,
    )


def build_app(args: dict) -> Application:
    """Validate everything that can be checked now (one clear error, no replica started), then bind."""
    config = validate(args)
    ladder = deployment_ladder(config)
    logging_config = LoggingConfig(enable_access_log=config.router.log_requests)
    encoder = encoder_deployment(config, logging_config).bind(config, ladder)
    llm = None if config.llm is None else llm_deployment(config, logging_config).bind(config)
    router = deployment(ROUTER, max_ongoing_requests=2048, logging_config=logging_config)
    return router.bind(config, encoder, llm, ladder)
