"""The LLM replica on vLLM (`llm.engine: vllm`): continuous batching fed with the encoders' embeddings.

vLLM's async engine serves the same checkpoint as the encoders. A request's chat messages go
through the checkpoint's chat template (one placeholder per image or video); vLLM expands
each placeholder from its grid and splices in the embeddings given as multi-modal data
(`image_embeds` + `image_grid_thw`, `video_embeds` + `video_grid_thw`), the embeddings fetched
here by Ray object reference straight from the encoder replica. Qwen3-VL's deepstack features
ride after the main embedding along the hidden axis, in deepstack order: vLLM's Qwen3-VL splits
`[tokens, hidden * (1 + k)]` into `[visual_dim, multiscale_dim]`. Same `generate` and
`generate_stream` as `LLMReplica` (transformers, the reference), so the router is unchanged.

Video timing: Qwen3-VL writes each frame group's time into the prompt (`timestamps`, from the
request's `frame_seconds`); vLLM's Qwen2.5-VL takes no timing with video embeddings and places
them at one second per temporal patch (2 frames a second), its processors' default rate.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import torch
from transformers import AutoTokenizer

from models.protocol import ItemOutput

from ..config import AppConfig, LLMSettings
from ..errors import RequestError
from ..process import before_constructor
from ..wire import GenerateRequest, GenerateResult, resolve_dtype
from .transformers_engine import fetch_embeddings

logger = logging.getLogger("ray.serve")
IMPORTED = time.monotonic()
"""The end of this module's imports, for the replica's ready line."""

DEFAULT_FRAMES_PER_SECOND = 2.0
"""Frame rate assumed for a video whose request gives no `frame_seconds` (the Qwen processors' default)."""
MODEL_SAMPLING_DEFAULTS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "top_k", "min_p")
"""The checkpoint's generation defaults applied to every request (as vLLM's server and `generate` do)."""


def placeholder_modalities(messages: list[dict]) -> list[str]:
    """The modality ("image" or "video") of each vision placeholder of the chat messages, in order."""
    found = []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") in ("image", "video"):
                found.append(part["type"])
    return found


def engine_embedding(item: ItemOutput) -> torch.Tensor:
    """`[tokens, hidden * (1 + k)]`: the main embedding, then each of the k deepstack layers."""
    if item.deepstack is None:
        return item.tokens
    return torch.cat([item.tokens, *item.deepstack.unbind(0)], dim=-1)


def grid_timestamps(frame_seconds: list[float], temporal_patch_size: int) -> list[float]:
    """Qwen3-VL's time of each temporal patch: the mean of its first and last frame's time, the
    last frame repeated to fill the final patch (as its processor pads the frames)."""
    if not frame_seconds:
        raise ValueError("a video needs at least one frame time")
    padded = list(frame_seconds) + [frame_seconds[-1]] * (-len(frame_seconds) % temporal_patch_size)
    return [
        (padded[start] + padded[start + temporal_patch_size - 1]) / 2
        for start in range(0, len(padded), temporal_patch_size)
    ]


def multi_modal_data(
    modalities: list[str],
    items: list[ItemOutput],
    grids: list[tuple[int, int, int]],
    frame_seconds: list[list[float]],
    temporal_patch_size: int | None,
) -> dict[str, dict[str, Any]]:
    """vLLM's `multi_modal_data` for precomputed embeddings: per modality, the items' embeddings
    concatenated along tokens and their grids. `temporal_patch_size`: set for models whose video
    prompt carries timestamps (Qwen3-VL); videos without `frame_seconds` run at 2 frames a second."""
    if not len(modalities) == len(items) == len(grids):
        raise RequestError(
            400, f"{len(modalities)} vision placeholders for {len(items)} embeddings and {len(grids)} grids"
        )
    data: dict[str, dict[str, Any]] = {}
    for modality in ("image", "video"):
        chosen = [index for index, kind in enumerate(modalities) if kind == modality]
        if not chosen:
            continue
        data[modality] = {
            f"{modality}_embeds": torch.cat([engine_embedding(items[i]) for i in chosen]),
            f"{modality}_grid_thw": torch.tensor([list(grids[i]) for i in chosen]),
        }
    videos = [grids[i] for i, kind in enumerate(modalities) if kind == "video"]
    if videos and temporal_patch_size is not None:
        seconds = frame_seconds or [
            [frame / DEFAULT_FRAMES_PER_SECOND for frame in range(t * temporal_patch_size)] for t, _, _ in videos
        ]
        if len(seconds) != len(videos):
            raise RequestError(400, f"frame_seconds has {len(seconds)} entries for {len(videos)} videos")
        data["video"]["timestamps"] = [grid_timestamps(s, temporal_patch_size) for s in seconds]
    return data


def unfinished_requests(engine) -> int:
    """Requests the engine has not finished (vLLM 0.26's `AsyncLLM` keeps the count in its output processor only)."""
    count = getattr(engine, "get_num_unfinished_requests", None)
    return count() if count is not None else engine.output_processor.get_num_unfinished_requests()


def client_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses (a 400 here, as in vLLM's own server)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # vLLM 0.26 refuses requests with ValueError and its subclasses only
        return (ValueError,)
    return (ValueError, VLLMClientError)


def sampling_params(request: GenerateRequest, model_defaults: dict[str, Any]):
    from vllm import SamplingParams

    defaults = {key: value for key, value in model_defaults.items() if key in MODEL_SAMPLING_DEFAULTS}
    return SamplingParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        ignore_eos=request.ignore_eos,
        **defaults,
    )


def engine_args(settings: LLMSettings, max_items_per_request: int):
    """vLLM's `AsyncEngineArgs`: the checkpoint, our dtype rule, embeddings accepted, then `engine_kwargs`."""
    from vllm import AsyncEngineArgs

    dtype = resolve_dtype(settings.dtype, settings.device)
    limits = {"image": max_items_per_request, "video": max_items_per_request}
    return AsyncEngineArgs(
        **{
            "limit_mm_per_prompt": limits,
            "seed": settings.seed,
            **settings.engine_kwargs,
            "model": settings.path,
            "dtype": str(dtype).removeprefix("torch."),
            "enable_mm_embeds": True,
        }
    )


class VLLMReplica:
    def __init__(self, config: AppConfig):
        start = time.perf_counter()
        before = before_constructor(IMPORTED)
        from vllm import AsyncLLMEngine
        from vllm.usage.usage_lib import UsageContext

        settings = config.llm
        imported_s = time.perf_counter() - start
        logger.info("starting vLLM on %s (pid %d)", settings.path, os.getpid())
        # an OpenAI server's context: `vllm serve`'s scheduler defaults for this GPU (on an H100/H200 8192
        # batched tokens and 1024 sequences), not the engine context's generic 2048 and 128
        self.engine = AsyncLLMEngine.from_engine_args(
            engine_args(settings, config.limits.max_items_per_request), usage_context=UsageContext.OPENAI_API_SERVER
        )
        engine_s = time.perf_counter() - start - imported_s
        hf_config = self.engine.model_config.hf_config
        self.model_type = hf_config.model_type
        vision = hf_config.vision_config
        self.merge_unit = vision.spatial_merge_size**2
        # Qwen3-VL's video prompt carries frame times; the older families' does not.
        self.temporal_patch_size = vision.temporal_patch_size if self.model_type.startswith("qwen3") else None
        self.model_defaults = self.engine.model_config.get_diff_sampling_param()
        self.tokenizer = AutoTokenizer.from_pretrained(settings.path)
        self.handoff_totals = {"images": 0, "bytes": 0, "ms": 0.0}
        self.aborted = 0
        self._ids = itertools.count()
        logger.info(
            "vLLM replica ready in %.1f s (%s on %s: importing vLLM %.1f s, its engine %.1f s; before it: imports "
            "%.1f s, Serve's setup %.1f s, %.1f s since its worker process started)",
            time.perf_counter() - start,
            settings.model_id,
            settings.device,
            imported_s,
            engine_s,
            before.imports_s,
            before.setup_s,
            before.process_s,
        )

    def _prompt(self, request: GenerateRequest, items: list[ItemOutput]) -> dict:
        text = self.tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
        prompt = {"prompt_token_ids": self.tokenizer(text, add_special_tokens=False)["input_ids"]}
        modalities = placeholder_modalities(request.messages)
        if modalities or items:
            prompt["multi_modal_data"] = multi_modal_data(
                modalities, items, request.grids, request.frame_seconds, self.temporal_patch_size
            )
        return prompt

    async def _outputs(self, request: GenerateRequest) -> AsyncIterator:
        """vLLM's cumulative outputs for one request; aborted in the engine when the caller goes away."""
        items, handoff = await fetch_embeddings(request.embeddings, self.handoff_totals)
        request_id = f"chat-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        finished = False
        try:
            stream = self.engine.generate(
                self._prompt(request, items), sampling_params(request, self.model_defaults), request_id
            )
            async for output in stream:
                finished = output.finished
                yield output, handoff
        except client_errors() as error:  # vLLM's input checks: prompt too long, too many items, ...
            finished = True  # refused before it started: nothing to abort
            raise RequestError(400, str(error)) from None
        finally:  # cancelled (client gone, router timeout) or the stream was closed early
            if not finished:
                self.aborted += 1
                await self.engine.abort(request_id)

    def _vision_tokens(self, request: GenerateRequest) -> int:
        return sum(t * h * w // self.merge_unit for t, h, w in request.grids)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        last = None
        async with aclosing(self._outputs(request)) as outputs:
            async for output in outputs:
                last = output
        final, handoff = last
        completion = final.outputs[0]
        return GenerateResult(
            token_ids=list(completion.token_ids),
            text=completion.text,
            prompt_tokens=len(final.prompt_token_ids),
            vision_tokens=self._vision_tokens(request),
            finish_reason=completion.finish_reason or "length",
            handoff=handoff,
        )

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[dict]:
        """Yields {"token_ids": [...], "text": ...} per engine step, then a final dict with the result."""
        sent_ids, sent_text, last = 0, 0, None
        async with aclosing(self._outputs(request)) as outputs:  # closing the stream aborts the request
            async for last in outputs:
                completion = last[0].outputs[0]
                if len(completion.token_ids) > sent_ids:
                    piece = {"token_ids": list(completion.token_ids[sent_ids:]), "text": completion.text[sent_text:]}
                    sent_ids, sent_text = len(completion.token_ids), len(completion.text)
                    yield piece
        final, handoff = last
        completion = final.outputs[0]
        yield {
            "done": True,
            "prompt_tokens": len(final.prompt_token_ids),
            "completion_tokens": len(completion.token_ids),
            "vision_tokens": self._vision_tokens(request),
            "finish_reason": completion.finish_reason or "length",
            "handoff": handoff,
        }

    async def check_health(self) -> None:
        """Serve restarts the replica when vLLM's engine has died."""
        await self.engine.check_health()

    def describe(self) -> dict:
        images = max(1, self.handoff_totals["images"])
        return {
            "family": self.model_type,
            "engine": "vllm",
            "unfinished_requests": unfinished_requests(self.engine),
            "aborted_requests": self.aborted,
            "handoff_images": self.handoff_totals["images"],
            "handoff_bytes_per_image": self.handoff_totals["bytes"] / images,
            "handoff_ms_per_image": self.handoff_totals["ms"] / images,
        }

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
