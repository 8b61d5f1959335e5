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

from .config import AppConfig
from .encoder import EncoderReplica
from .llm import LLMReplica
from .router import EncoderRouter
from .routing import FewestQueuedTokensRouter
from .vllm_engine import VLLMReplica

ROUTING_STATS_PERIOD_S = 1.0


def encoder_deployment(config: AppConfig):
    """The encoder replica deployment with defaults for its device (one GPU each on CUDA)."""
    resources = {"num_cpus": 1, "num_gpus": 1 if config.model.device == "cuda" else 0}
    return EncoderReplica.options(
        ray_actor_options=resources,
        request_router_config=RequestRouterConfig(
            request_router_class=FewestQueuedTokensRouter,
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
    )


def build_app(args: AppConfig) -> Application:
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    encoder = encoder_deployment(config).bind(config)
    llm = None
    if config.llm is not None:
        resources = {"num_cpus": 1, "num_gpus": 1 if config.llm.device == "cuda" else 0}
        replica = VLLMReplica if config.llm.engine == "vllm" else LLMReplica
        llm = replica.options(ray_actor_options=resources).bind(config)
    return EncoderRouter.bind(config, encoder, llm)
