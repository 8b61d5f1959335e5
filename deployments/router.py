"""The router (ingress): validate, decode, count tokens, pack, dispatch, fan results back out.

HTTP (`/v1/encode`, `/health`, `/v1/models`, OpenAPI docs at `/docs`) and the Python handle
(`encode`) share one path: inspect headers and check limits -> decode and resize off the
event loop -> queue items in the pack scheduler -> await each item's output. Client errors
are `RequestError`s with a 4xx and a body naming the item and the limit; anything else is
logged and becomes a 500.
"""


import asyncio
import json
import os
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
import psutil
import ray
from PIL import Image
from ray import serve
from ray.serve.handle import DeploymentHandle

from encoder_graphs.runner import build_ladder
from models import load_preprocessor
from models.protocol import ItemOutput

from . import media
from .config import AppConfig
from .chat import ChatRequest, completion, split_messages, sse_chunk, usage
from .encoder import PackRequest
from .llm import GenerateRequest
from .errors import RequestError, item_error, overloaded
from .responses import encode_response_json
from .scheduler import Overloaded, PackScheduler, QueuedItem
from .schemas import EncodeRequest, EncodeResponse, ErrorResponse, ImageItem

logger = logging.getLogger("ray.serve")

api = FastAPI(
    title="VLM vision-encoder service",
    description="Encodes images and videos with a VLM's vision tower; packs requests into CUDA-graph budgets.",
    responses={400: {"model": ErrorResponse}, 413: {"model": ErrorResponse}, 503: {"model": ErrorResponse}},
)


@api.exception_handler(RequestError)
async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    location = [part for part in first.get("loc", ()) if part != "body"]
    if len(location) >= 2 and location[0] == "items" and isinstance(location[1], int):
        param = f"items[{location[1]}]"
    else:
        param = ".".join(str(part) for part in location) or None
    fields = ".".join(str(part) for part in location[2:])
    message = f"{param or 'body'}{'.' + fields if fields else ''}: {first.get('msg', 'invalid')}"
    return JSONResponse(RequestError(400, message, param=param).body(), status_code=400)


@api.middleware("http")
async def _limit_body(request: Request, call_next):
    limit = getattr(api.state, "max_request_bytes", None)
    declared = request.headers.get("content-length")
    if limit is not None and declared is not None and declared.isdigit() and int(declared) > limit:
        error = RequestError(413, f"request body of {declared} bytes exceeds max_request_bytes={limit}")
        return JSONResponse(error.body(), status_code=413)
    return await call_next(request)


def replica_failed(error: Exception) -> bool:
    """The encoder replica died or lost its GPU (retryable elsewhere), not a problem of the input."""
    if isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        return True
    return "CUDA error" in str(error) or "CUDA out of memory" in str(error)


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
        )
        self.rejected: dict[str, int] = {}
        api.state.max_request_bytes = config.limits.max_request_bytes

    # ---- HTTP ----

    @api.post("/v1/encode", response_model=EncodeResponse)
    async def encode_http(self, body: EncodeRequest) -> Response:
        raw = [self._raw_from_http(index, item) for index, item in enumerate(body.items)]
        results = await self._encode(raw)
        content = await asyncio.to_thread(
            encode_response_json, self.config.model.model_id, results, body.encoding_format
        )
        return Response(content=content, media_type="application/json")

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self) -> dict:
        status = serve.status()
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
                    "encoder": await self.encoder.describe.remote(),
                }
            ],
        }

    def _raw_from_http(self, index: int, item) -> tuple[str, Any]:
        limits = self.config.limits
        if isinstance(item, ImageItem):
            return "image", media.decode_base64(item.image, index, limits)
        if (item.frames is None) == (item.video is None):
            raise item_error(index, 400, "a video item needs exactly one of 'frames' or 'video'")
        if item.video is not None:
            return "video", media.decode_base64(item.video, index, limits)
        if len(item.frames) > limits.max_video_frames:
            raise item_error(index, 413, f"{len(item.frames)} frames exceeds max_video_frames={limits.max_video_frames}")
        return "frames", [media.decode_base64(frame, index, limits) for frame in item.frames]

    @api.post("/v1/chat/completions")
    async def chat_http(self, body: ChatRequest):
        request = await self._chat_request(body)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._chat_stream(request, include_usage), media_type="text/event-stream")
        result = await self.llm.generate.remote(request)
        return completion(self.config.model.model_id, result)

    async def chat(self, messages: list[dict], **params) -> dict:
        """The chat endpoint through the Python handle: OpenAI-shaped messages in, a chat.completion out."""
        body = ChatRequest.model_validate({"messages": messages, **params, "stream": False})
        return await self.chat_http(body)

    async def _chat_request(self, body: ChatRequest) -> GenerateRequest:
        if self.llm is None:
            raise RequestError(404, "this deployment has no LLM (set `llm` in the app config)", error_type="not_found")
        messages, urls = split_messages(body.messages)
        raw = [("image", media.decode_base64(url, index, self.config.limits)) for index, url in enumerate(urls)]
        decoded = await self._decode(raw)
        refs = await self._enqueue(decoded, as_refs=True)
        max_tokens = body.max_completion_tokens or body.max_tokens or 16
        if max_tokens > self.config.llm.max_tokens:
            raise RequestError(
                400, f"max_tokens={max_tokens} exceeds the deployment's llm.max_tokens={self.config.llm.max_tokens}",
                param="max_tokens",
            )
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
                    yield f"data: {json.dumps({'id': chunk_id, 'object': 'chat.completion.chunk', 'model': model, 'choices': [], 'usage': counts})}\n\n"
                break
            yield sse_chunk(chunk_id, model, {"content": piece["text"]}, extra={"token_ids": piece["token_ids"]})
        yield "data: [DONE]\n\n"

    # ---- Python handle ----

    async def encode(self, items: list) -> list[EncodeResult]:
        """Encode PIL images, encoded image bytes, or {"type": "video", "frames": [...]} dicts."""
        return await self._encode([self._raw_from_python(index, item) for index, item in enumerate(items)])

    def _raw_from_python(self, index: int, item) -> tuple[str, Any]:
        if isinstance(item, (bytes, bytearray, Image.Image)):
            return "image", item
        if isinstance(item, dict) and item.get("type") == "image" and "image" in item:
            return "image", item["image"]
        if isinstance(item, dict) and item.get("type") == "video" and isinstance(item.get("frames"), list):
            return "frames", item["frames"]
        if isinstance(item, dict) and item.get("type") == "video" and isinstance(item.get("video"), (bytes, bytearray)):
            return "video", item["video"]
        raise item_error(index, 400, f"unsupported item of type {type(item).__name__}; pass a PIL image, bytes, or a dict")

    # ---- the shared path ----

    async def _encode(self, raw: list[tuple[str, Any]]) -> list[EncodeResult]:
        decoded = await self._decode(raw)
        outputs = await self._enqueue(decoded)
        return [
            EncodeResult(index, item.spec.modality, item.spec.grid_thw, out.tokens, out.deepstack)
            for index, (item, out) in enumerate(zip(decoded, outputs))
        ]

    async def _decode(self, raw: list[tuple[str, Any]]) -> list[media.DecodedItem]:
        """Check limits from headers, then decode and resize off the event loop."""
        limits = self.config.limits
        try:
            if len(raw) > limits.max_items_per_request:
                raise RequestError(
                    413, f"{len(raw)} items exceeds max_items_per_request={limits.max_items_per_request}", "items"
                )
            inspected = [self._inspect(index, kind, value) for index, (kind, value) in enumerate(raw)]
            media.check_request_tokens(inspected, limits)
            self._check_capacity(sum(item.spec.output_tokens for item in inspected))
            decoded = await asyncio.to_thread(lambda: [media.decode(i, limits, self.preprocessor) for i in inspected])
        except RequestError as exc:
            self._count_rejection(exc)
            raise
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
        loop = asyncio.get_running_loop()
        request_id = uuid.uuid4().hex
        queued = [QueuedItem(d.pixels, d.spec, request_id, loop.create_future(), as_ref=as_refs) for d in decoded]
        try:
            self.scheduler.submit(queued)
        except Overloaded as exc:
            error = overloaded(str(exc), self.config.router.retry_after_s)
            self._count_rejection(error)
            raise error from None
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(q.future for q in queued)), self.config.router.request_timeout_s
            )
        except asyncio.TimeoutError:
            raise RequestError(
                504, f"request not done within request_timeout_s={self.config.router.request_timeout_s}",
                error_type="timeout_error",
            ) from None
        finally:
            for item in queued:  # a cancelled or failed request leaves nothing queued behind
                if not item.future.done():
                    item.future.cancel()

    async def _dispatch(self, modality: str, items: list[QueuedItem]) -> list[ItemOutput]:
        pack = PackRequest(
            self.scheduler.next_pack_id(),
            modality,
            [i.pixels for i in items],
            [i.spec for i in items],
            as_refs=[i.as_ref for i in items],
        )
        outputs = await self.encoder.encode_pack.remote(pack)
        self.embedding_bytes_received += sum(
            o.tokens.nbytes + (0 if o.deepstack is None else o.deepstack.nbytes)
            for o in outputs
            if isinstance(o, ItemOutput)
        )
        return outputs

    def _pack_error(self, error: Exception, retried: bool) -> Exception:
        """What a request whose pack failed gets: 503 if a replica died (after the retry), else 500."""
        if replica_failed(error):
            again = " after a retry on another replica" if retried else ""
            return overloaded(f"an encoder replica failed while encoding this request{again}: {error!r}"[:500], 1)
        logger.exception("pack failed", exc_info=error)
        return RequestError(500, f"encoding failed: {type(error).__name__}", error_type="internal_error")

    def _count_rejection(self, error: RequestError) -> None:
        reason = {413: "limit", 415: "format", 503: "overloaded"}.get(error.status, "invalid")
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def router_stats(self) -> dict:
        return {
            "packs": self.scheduler.stats.snapshot(),
            "queued_tokens": self.scheduler.queued_tokens,
            "rejected": dict(self.rejected),
            "embedding_bytes_received": self.embedding_bytes_received,
            "pid": os.getpid(),
            "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
        }
