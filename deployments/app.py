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
"""

from __future__ import annotations

from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.schema import LoggingConfig

from encoder_graphs.config import Ladder, budget_ladder
from models import load_preprocessor

from .config import AppConfig
from .encoder import EncoderReplica
from .llm import LLMReplica
from .router import EncoderRouter
from .routing import FewestQueuedTokensRouter
from .validation import validate
from .vllm_engine import VLLMReplica

ROUTING_STATS_PERIOD_S = 1.0


def encoder_deployment(config: AppConfig, logging_config: LoggingConfig):
    """The encoder replica deployment with defaults for its device (one GPU each on CUDA)."""
    resources = {"num_cpus": 1, "num_gpus": 1 if config.model.device == "cuda" else 0}
    return EncoderReplica.options(
        ray_actor_options=resources,
        logging_config=logging_config,
        request_router_config=RequestRouterConfig(
            request_router_class=FewestQueuedTokensRouter,
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
    )


def deployment_ladder(config: AppConfig) -> Ladder:
    """The budget ladder of the deployment, computed once here and handed to the router and
    every encoder replica (from the processor's smallest item; no weights loaded)."""
    model = config.model
    _, preprocessor = load_preprocessor(model.preset, model.family, model.path)
    return budget_ladder(config.graphs, preprocessor.min_item_tokens)


def build_app(args: dict) -> Application:
    """Validate everything that can be checked now (one clear error, no replica started), then bind."""
    config = validate(args)
    ladder = deployment_ladder(config)
    logging_config = LoggingConfig(enable_access_log=config.router.log_requests)
    encoder = encoder_deployment(config, logging_config).bind(config, ladder)
    llm = None
    if config.llm is not None:
        resources = {"num_cpus": 1, "num_gpus": 1 if config.llm.device == "cuda" else 0}
        replica = VLLMReplica if config.llm.engine == "vllm" else LLMReplica
        llm = replica.options(ray_actor_options=resources, logging_config=logging_config).bind(config)
    return EncoderRouter.options(logging_config=logging_config).bind(config, encoder, llm, ladder)
