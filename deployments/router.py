"""The router (ingress): validate, decode, count tokens, pack, dispatch, fan results back out.

HTTP (`/v1/encode`, `/health`, `/v1/models`, OpenAPI docs at `/docs`) and the Python handle
(`encode`) share one path: inspect headers and check limits -> decode and resize off the
event loop -> queue items in the pack scheduler -> await each item's output. Client errors
are `RequestError`s with a 4xx and a body naming the item and the limit; anything else is
logged and becomes a 500.
"""

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import psutil
import ray
import torch
from fastapi.responses import Response, StreamingResponse
from PIL import Image
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from encoder_graphs.runner import build_ladder
from models import load_preprocessor
from models.protocol import ItemOutput

from . import media
from .cache import EmbeddingCache, InflightTable, content_key, output_bytes
from .chat import ChatRequest, completion, split_messages, sse_chunk, usage
from .config import AppConfig
from .encoder import PackRequest
from .errors import RequestError, item_error, overloaded
from .http import create_api
from .llm import GenerateRequest
from .metrics import RouterMetrics, refresh_gauges
from .responses import encode_response_json
from .scheduler import Overloaded, PackScheduler, QueuedItem
from .schemas import EncodeRequest, EncodeResponse, ImageItem

logger = logging.getLogger("ray.serve")

api = create_api()

DESCRIBE_TIMEOUT_S = 2.0
"""How long `/v1/models` waits for an encoder replica's own description."""


def _done(loop: asyncio.AbstractEventLoop, value) -> asyncio.Future:
    future = loop.create_future()
    future.set_result(value)
    return future


def replica_failed(error: Exception) -> bool:
    """The encoder replica died or lost its GPU (retryable elsewhere), not a problem of the input."""
    if isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        return True
    return "CUDA error" in str(error) or "CUDA out of memory" in str(error)


async def result_within(response, timeout_s: float):
    """A handle call's result, or a 504 after `timeout_s`. The call is cancelled then, so that its
    replica stops working on it: merely ceasing to await a `DeploymentResponse` does not."""
    try:
        return await asyncio.wait_for(response, timeout_s)
    except asyncio.TimeoutError:
        response.cancel()
        raise RequestError(504, f"not done within request_timeout_s={timeout_s}", error_type="timeout_error") from None


@dataclass
class EncodeResult:
    """One item's result through the Python handle."""

    index: int
    modality: str
    grid_thw: tuple[int, int, int]
    embedding: torch.Tensor
    """`[tokens, hidden]` in the tower's dtype."""
    deepstack: torch.Tensor | None = None
    """`[num_deepstack, tokens, hidden]` (Qwen3-VL) or None."""


@serve.deployment(max_ongoing_requests=256)
@serve.ingress(api)
class EncoderRouter:
    def __init__(self, config: AppConfig, encoder: DeploymentHandle, llm: DeploymentHandle | None = None):
        self.config = config
        self.encoder = encoder
        self.llm = llm
        self.embedding_bytes_received = 0
        model = config.model
        self.family, self.preprocessor = load_preprocessor(model.preset, model.family, model.path)
        graphs = config.graphs.to_config()
        self.ladder, max_items = build_ladder(graphs, self.preprocessor.min_item_tokens)
        self.scheduler = PackScheduler(
            self.ladder,
            max_items,
            graphs.max_segments_per_pack or 2 * max_items,
            self._dispatch,
            max_wait_s=config.router.max_wait_ms / 1e3,
            target_fill=config.router.target_fill,
            max_queued_tokens=config.router.max_queued_tokens,
            retries=config.router.pack_retries,
            retryable=replica_failed,
            final_error=self._pack_error,
            on_pack=self._observe_pack,
        )
        self.metrics = RouterMetrics()
        self.rejected: dict[str, int] = {}
        self.cache = EmbeddingCache(config.router.cache_bytes)
        self.inflight = InflightTable()
        self._described: tuple[float, dict] | None = None
        """(monotonic time, the last encoder description) for `/v1/models` under saturation."""
        self._stop_gauges = refresh_gauges(self._set_gauges)
        api.state.router = self  # the serving app's handlers reach the router through this

    def _set_gauges(self) -> None:
        self.metrics.queued_tokens.set(self.scheduler.queued_tokens)
        self.metrics.cache_bytes.set(self.cache.bytes)

    # ---- HTTP ----

    @api.post("/v1/encode", response_model=EncodeResponse)
    async def encode_http(self, body: EncodeRequest) -> Response:
        self._check_item_count(len(body.items))
        raw = await asyncio.to_thread(lambda: [self._raw_from_http(i, item) for i, item in enumerate(body.items)])
        results = await self._encode(raw, use_cache=body.cache)
        content = await asyncio.to_thread(
            encode_response_json, self.config.model.model_id, results, body.encoding_format
        )
        return Response(content=content, media_type="application/json")

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self) -> dict:
        status = await asyncio.to_thread(serve.status)
        app = next((a for a in status.applications.values() if "EncoderReplica" in a.deployments), None)
        replicas = {} if app is None else dict(app.deployments["EncoderReplica"].replica_states)
        return {
            "object": "list",
            "data": [
                {
                    "id": self.config.model.model_id,
                    "object": "model",
                    "family": self.family,
                    "budgets": list(self.ladder),
                    "encoder_replicas": {str(k): v for k, v in replicas.items()},
                    "router": self.router_stats(),
                    "encoder": await self._describe_encoder(),
                }
            ],
        }

    async def _describe_encoder(self) -> dict:
        """One encoder replica's description, waited for at most `DESCRIBE_TIMEOUT_S`: under
        saturation the request queues behind packs for a replica slot (`max_ongoing_requests`),
        and `/v1/models` must not stall with it. Then the last description answers, marked with
        its age (`stale_s`), or, before any, `{"status": "busy"}`."""
        response = self.encoder.describe.remote()
        try:
            described = await asyncio.wait_for(response, DESCRIBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            response.cancel()
            if self._described is None:
                return {"status": "busy", "detail": f"no encoder replica answered within {DESCRIBE_TIMEOUT_S} s"}
            at, last = self._described
            return {**last, "stale_s": round(time.monotonic() - at, 1)}
        self._described = (time.monotonic(), described)
        return described

    def _raw_from_http(self, index: int, item) -> tuple[str, Any]:
        limits = self.config.limits
        if isinstance(item, ImageItem):
            return "image", media.decode_base64(item.image, index, limits)
        if (item.frames is None) == (item.video is None):
            raise item_error(index, 400, "a video item needs exactly one of 'frames' or 'video'")
        if item.video is not None:
            return "video", media.decode_base64(item.video, index, limits)
        if len(item.frames) > limits.max_video_frames:
            raise item_error(
                index, 413, f"{len(item.frames)} frames exceeds max_video_frames={limits.max_video_frames}"
            )
        return "frames", [media.decode_base64(frame, index, limits) for frame in item.frames]

    @api.post("/v1/chat/completions")
    async def chat_http(self, body: ChatRequest):
        request = await self._chat_request(body)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._chat_stream(request, include_usage), media_type="text/event-stream")
        result = await result_within(self.llm.generate.remote(request), self.config.router.request_timeout_s)
        return completion(self.config.model.model_id, result)

    async def chat(self, messages: list[dict], **params) -> dict:
        """The chat endpoint through the Python handle: OpenAI-shaped messages in, a chat.completion out."""
        try:
            try:
                body = ChatRequest.model_validate({"messages": messages, **params, "stream": False})
            except ValidationError as error:
                first = error.errors()[0]
                where = ".".join(str(part) for part in first["loc"])
                raise RequestError(400, f"{where}: {first['msg']}", param=where) from None
            return await self.chat_http(body)
        except RequestError as error:
            self.count_rejection(error.status)
            raise

    async def _chat_request(self, body: ChatRequest) -> GenerateRequest:
        if self.llm is None:
            raise RequestError(404, "this deployment has no LLM (set `llm` in the app config)", error_type="not_found")
        max_tokens = body.max_completion_tokens or body.max_tokens or 16
        if max_tokens > self.config.llm.max_tokens:
            raise RequestError(
                400,
                f"max_tokens={max_tokens} exceeds the deployment's llm.max_tokens={self.config.llm.max_tokens}",
                param="max_tokens",
            )
        messages, urls = split_messages(body.messages)
        self._check_item_count(len(urls))
        raw = await asyncio.to_thread(
            lambda: [("image", media.decode_base64(url, index, self.config.limits)) for index, url in enumerate(urls)]
        )
        decoded = await self._decode(raw, as_refs=True)
        refs = await self._enqueue(decoded, as_refs=True)
        return GenerateRequest(
            messages=messages,
            embeddings=refs,
            grids=[d.spec.grid_thw for d in decoded],
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
        )

    async def _chat_stream(self, request: GenerateRequest, include_usage: bool):
        model = self.config.model.model_id
        chunk_id = f"chatcmpl-{uuid.uuid4().hex}"
        yield sse_chunk(chunk_id, model, {"role": "assistant", "content": ""})
        async for piece in self.llm.options(stream=True).generate_stream.remote(request):
            if piece.get("done"):
                yield sse_chunk(chunk_id, model, {}, piece["finish_reason"])
                if include_usage:
                    counts = usage(piece["prompt_tokens"], piece["completion_tokens"], piece["vision_tokens"])
                    yield sse_chunk(chunk_id, model, None, extra={"usage": counts})
                break
            yield sse_chunk(chunk_id, model, {"content": piece["text"]}, extra={"token_ids": piece["token_ids"]})
        yield "data: [DONE]\n\n"

    # ---- Python handle ----

    async def encode(self, items: list, cache: bool = True) -> list[EncodeResult]:
        """Encode PIL images, encoded image bytes, or {"type": "video", "frames": [...] | "video": bytes} dicts."""
        try:
            raw = [self._raw_from_python(index, item) for index, item in enumerate(items)]
            return await self._encode(raw, use_cache=cache)
        except RequestError as error:  # over HTTP the exception handler counts it
            self.count_rejection(error.status)
            raise

    def _raw_from_python(self, index: int, item) -> tuple[str, Any]:
        image_types = (bytes, bytearray, Image.Image)
        if isinstance(item, dict) and item.get("type") == "image":
            item = item.get("image")
        if isinstance(item, image_types):
            return "image", item
        if isinstance(item, dict) and item.get("type") == "video":
            frames, video = item.get("frames"), item.get("video")
            if isinstance(frames, list) and all(isinstance(f, image_types) for f in frames):
                return "frames", frames
            if isinstance(video, (bytes, bytearray)):
                return "video", video
        raise item_error(
            index,
            400,
            f"unsupported item {type(item).__name__}; pass a PIL image, encoded image bytes, "
            '{"type": "video", "frames": [...]} or {"type": "video", "video": <file bytes>}',
        )

    # ---- the shared path ----

    async def _encode(self, raw: list[tuple[str, Any]], use_cache: bool = True) -> list[EncodeResult]:
        decoded = await self._decode(raw, keyed=use_cache)
        outputs = await self._enqueue(decoded)
        if decoded:
            self.metrics.vision_tokens.inc(sum(d.spec.output_tokens for d in decoded))
        return [
            EncodeResult(index, item.spec.modality, item.spec.grid_thw, out.tokens, out.deepstack)
            for index, (item, out) in enumerate(zip(decoded, outputs))
        ]

    def _check_item_count(self, count: int) -> None:
        limit = self.config.limits.max_items_per_request
        if count > limit:
            raise RequestError(413, f"{count} items exceeds max_items_per_request={limit}", "items")

    async def _decode(self, raw: list[tuple[str, Any]], keyed: bool = True, as_refs: bool = False) -> list:
        """Check limits from headers, then decode, resize and (for dedup and the cache) hash the
        pixels, off the event loop."""
        limits = self.config.limits
        start = time.perf_counter()
        self._check_item_count(len(raw))
        inspected = await asyncio.to_thread(
            lambda: [self._inspect(i, kind, value) for i, (kind, value) in enumerate(raw)]
        )
        media.check_request_tokens(inspected, limits)
        self._check_capacity(sum(item.spec.output_tokens for item in inspected))

        def decode_all() -> list[media.DecodedItem]:
            decoded = [media.decode(i, limits, self.preprocessor) for i in inspected]
            for item in decoded:
                item.key = self._cache_key(item, as_refs) if keyed else None
            return decoded

        decoded = await asyncio.to_thread(decode_all)
        self.metrics.preprocess_seconds.observe(time.perf_counter() - start)
        return decoded

    def _inspect(self, index: int, kind: str, value) -> media.InspectedItem:
        limits, pre = self.config.limits, self.preprocessor
        if kind == "frames":
            return media.inspect_frames(value, index, limits, pre)
        if kind == "video":
            return media.inspect_video(bytes(value), index, limits, pre)
        if isinstance(value, Image.Image):
            return media.inspect_pil(value, index, limits, pre)
        return media.inspect_image(bytes(value), index, limits, pre)

    def _check_capacity(self, tokens: int) -> None:
        try:
            self.scheduler.check_room(tokens)
        except Overloaded as exc:
            raise overloaded(str(exc), self.config.router.retry_after_s) from None

    async def _enqueue(self, decoded: list[media.DecodedItem], as_refs: bool = False) -> list:
        """Each item's output: from the cache, from an identical item in flight, or from a new pack."""
        loop = asyncio.get_running_loop()
        request_id = uuid.uuid4().hex
        waits, mine, new = [], [], []  # futures to await; (key, future) this request holds; items to queue
        for item in decoded:
            key = item.key
            cached = None if key is None or as_refs else self.cache.get(key)
            if cached is not None:
                self.metrics.cache_hits.inc()
                waits.append(_done(loop, cached))
                continue
            shared = None if key is None else self.inflight.join(key)
            if shared is not None:
                self.metrics.cache_dedup.inc()
                waits.append(shared)
                mine.append((key, shared))
                continue
            queued = QueuedItem(item.pixels, item.spec, request_id, loop.create_future(), as_ref=as_refs)
            if key is not None:
                self.metrics.cache_misses.inc()
                self.inflight.start(key, queued.future)
                if not as_refs:
                    queued.future.add_done_callback(lambda future, key=key: self._remember(key, future))
            new.append(queued)
            waits.append(queued.future)
            mine.append((key, queued.future))
        try:
            self.scheduler.submit(new)
            self.metrics.queued_tokens.set(self.scheduler.queued_tokens)
            shielded = asyncio.gather(*(asyncio.shield(future) for future in waits))
            return await asyncio.wait_for(shielded, self.config.router.request_timeout_s)
        except Overloaded as exc:
            raise overloaded(str(exc), self.config.router.retry_after_s) from None
        except asyncio.TimeoutError:
            raise RequestError(
                504,
                f"request not done within request_timeout_s={self.config.router.request_timeout_s}",
                error_type="timeout_error",
            ) from None
        finally:
            for key, future in mine:  # nothing stays queued for a request that is gone, unless shared
                last = key is None or self.inflight.leave(key, future)
                if last and not future.done():
                    future.cancel()

    def _cache_key(self, item: media.DecodedItem, as_refs: bool) -> bytes:
        kind = "ref:" if as_refs else ""
        return content_key(kind + self.config.model.model_id, item.spec.modality, item.pixels)

    def _remember(self, key: bytes, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None and isinstance(future.result(), ItemOutput):
            self.cache.put(key, future.result())
            self.metrics.cache_bytes.set(self.cache.bytes)

    async def _dispatch(self, modality: str, items: list[QueuedItem]) -> list[ItemOutput]:
        pack = PackRequest(
            self.scheduler.next_pack_id(),
            modality,
            [i.pixels for i in items],
            [i.spec for i in items],
            as_refs=[i.as_ref for i in items],
        )
        start = time.perf_counter()
        result = await self.encoder.encode_pack.remote(pack)
        self.metrics.transfer_seconds.observe(max(0.0, time.perf_counter() - start - result.queue_s - result.forward_s))
        self.embedding_bytes_received += sum(output_bytes(o) for o in result.outputs if isinstance(o, ItemOutput))
        return result.outputs

    def _observe_pack(self, items: list[QueuedItem], budget: int | None) -> None:
        tokens = sum(item.spec.output_tokens for item in items)
        self.metrics.pack_fill.observe(tokens / budget if budget else 1.0)
        self.metrics.pack_requests.observe(len({item.request_id for item in items}))
        self.metrics.queued_tokens.set(self.scheduler.queued_tokens)

    def _pack_error(self, error: Exception, retried: bool) -> Exception:
        """What a request whose pack failed gets: 503 if a replica died (after the retry), else 500.
        The details go to the log, not to the client."""
        logger.error("pack failed (retried: %s): %r", retried, error)
        if replica_failed(error) or isinstance(error, ConnectionAbortedError):
            again = " after a retry" if retried else ""
            return overloaded(f"an encoder replica failed while encoding this request{again}; retry", 1)
        return RequestError(500, "encoding failed; the error is in the service log", error_type="internal_error")

    def count_rejection(self, status: int) -> None:
        """Count a refused request by reason (for /v1/models and the metric)."""
        reason = {413: "limit", 415: "format", 503: "overloaded", 504: "timeout", 404: "not_found"}.get(
            status, "invalid" if status < 500 else "failed"
        )
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        self.metrics.rejected.inc(tags={"reason": reason})

    def router_stats(self) -> dict:
        return {
            "packs": self.scheduler.stats.snapshot(),
            "queued_tokens": self.scheduler.queued_tokens,
            "rejected": dict(self.rejected),
            "embedding_bytes_received": self.embedding_bytes_received,
            "cache": {
                "entries": len(self.cache),
                "bytes": self.cache.bytes,
                "max_bytes": self.cache.max_bytes,
                "hits": self.cache.hits,
                "misses": self.cache.misses,
                "inflight_dedup": self.inflight.joined,
            },
            "pid": os.getpid(),
            "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
        }
