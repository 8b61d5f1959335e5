"""`ColocatedReplica`: the encoder replica and the LLM replica of E/PD in one Serve replica (`llm.colocate`).

With separate deployments a host's GPUs are split between encoders and LLMs, and where requests carry
little vision the encoder GPUs idle while the LLM's are the limit. Here every replica does both on its
GPU: the router sends it packs (`encode_pack`) and generations (`generate`, `generate_stream`) as it
would to two deployments, through two handles (two request routers: a FIFO router fulfils the oldest
waiting request with the replica it picks, so packs and generations must not share one). Of its
slots, `LLM_SLOTS` are the LLM's and the rest the packs' (`record_routing_stats` says so). The LLM
engine starts first (vLLM sizes its KV cache from the GPU's free memory at its start, within
`gpu_memory_utilization`), then the encoder, whose warm-up follows `replica.warm_up_before_ready`.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import AsyncIterator

from encoder_graphs.config import Ladder

from ..autoscaling import GENERATING_METRIC
from ..config import AppConfig
from ..deployment_names import LLM_ENGINES, LLM_SLOTS
from ..encoder.replica import EncoderReplica
from ..wire import GenerateRequest, GenerateResult, PackRequest, PackResult


def llm_class(engine: str) -> type:
    """The LLM replica class of `llm.engine` (vLLM's module is imported only where it is asked for)."""
    module, _, name = LLM_ENGINES[engine].rpartition(".")
    return getattr(importlib.import_module(module), name)


class ColocatedReplica:
    def __init__(self, config: AppConfig, ladder: Ladder):
        self.llm = llm_class(config.llm.engine)(config)
        self.llm_slots = LLM_SLOTS[config.llm.engine]
        self.encoder = EncoderReplica(config, ladder)
        self.generating = 0
        """Generations in flight here, which routers weigh when they place the next one."""

    # ---- the encoder's side

    async def encode_pack(self, pack: PackRequest) -> PackResult:
        return await self.encoder.encode_pack(pack)

    def record_routing_stats(self) -> dict:
        return {**self.encoder.record_routing_stats(), "generating": self.generating, "llm_slots": self.llm_slots}

    def record_autoscaling_stats(self) -> dict:
        """The encoder's tokens and the LLM's generations in flight (`TokenAutoscalingPolicy` weighs both)."""
        return {**self.encoder.record_autoscaling_stats(), GENERATING_METRIC: float(self.generating)}

    # ---- the LLM's side

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.generating += 1
        try:
            return await self.llm.generate(request)
        finally:
            self.generating -= 1

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[dict]:
        self.generating += 1
        try:
            async for piece in self.llm.generate_stream(request):
                yield piece
        finally:
            self.generating -= 1

    # ---- both

    def describe(self) -> dict:
        return {**self.encoder.describe(), "llm": self.llm.describe(), "generating": self.generating}

    async def check_health(self) -> None:
        await asyncio.to_thread(self.encoder.check_health)  # it waits for a forward: not on the event loop
        check = getattr(self.llm, "check_health", None)
        if check is not None and inspect.iscoroutine(outcome := check()):
            await outcome

    async def __del__(self) -> None:
        """Serve calls this once the replica's requests are done: the LLM engine stops (its generations
        have ended), then the encoder waits for its stored results to be read (`drain.py`)."""
        stop = getattr(getattr(self, "llm", None), "__del__", None)
        if stop is not None:
            stop()
        encoder = getattr(self, "encoder", None)
        if encoder is not None:
            await encoder.__del__()
