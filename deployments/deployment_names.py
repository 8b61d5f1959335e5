"""The application's deployments: each one's class (by import path) and the name Serve gives it.

The YAML's `deployments:` entries refer to these names; the app builder and the config validator
both read them here (this module imports nothing heavy: the validator must stay quick).
"""

from __future__ import annotations

ROUTER = "deployments.router.ingress.EncoderRouter"
ENCODER = "deployments.encoder.replica.EncoderReplica"
LLM_ENGINES = {
    "transformers": "deployments.llm.transformers_engine.LLMReplica",
    "vllm": "deployments.llm.vllm_engine.VLLMReplica",
}
"""The LLM deployment's class per `llm.engine`."""
COLOCATED = "deployments.colocated.replica.ColocatedReplica"
"""With `llm.colocate`: encoder and LLM in one deployment."""
ENCODER_SLOTS = 8
"""An encoder replica's `max_ongoing_requests` (packs) unless the YAML sets it."""
LLM_SLOTS = {"transformers": 16, "vllm": 64}
"""An LLM replica's, per engine (vLLM batches continuously); a colocated replica keeps this many of
its slots for generations and the rest for packs."""


def name_of(import_path: str) -> str:
    """A deployment's name: its class's (`module.Class` -> `Class`)."""
    return import_path.rpartition(".")[2]


def deployment_names(config) -> list[str]:
    """The names of the deployments an `AppConfig` builds: router, encoder, and the LLM's if set
    (one deployment for both with `llm.colocate`)."""
    if config.llm is not None and config.llm.colocate:
        return [name_of(ROUTER), name_of(COLOCATED)]
    paths = [ROUTER, ENCODER] + ([] if config.llm is None else [LLM_ENGINES[config.llm.engine]])
    return [name_of(path) for path in paths]
