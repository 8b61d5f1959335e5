"""OpenAI-compatible chat completions: request schema, message conversion, response shapes.

Images come as `image_url` parts with `data:` URLs (fetching remote URLs is off: no SSRF).
Messages are converted to transformers' chat-template form with `{"type": "image"}`
placeholders, in order; the router encodes the images and the LLM replica expands each
placeholder to the image's token count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Literal, Union

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import RequestError
from .media import RawItem

logger = logging.getLogger("ray.serve")

SEED_RANGE = (-(2**63), 2**64 - 1)
"""What the generator's seed accepts."""
CHARS_PER_TOKEN_BOUND = 32
"""A prompt longer than this many characters per allowed token is refused before tokenizing."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageURL(_Body):
    url: str = Field(description="A data: URL (data:image/png;base64,...). Remote URLs are refused.")
    detail: str | None = Field(None, description="Accepted and ignored.")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Union[TextPart, ImagePart]


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class ChatRequest(_Body):
    model: str | None = Field(None, description="One of /v1/models' ids (or omitted).")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0, le=2, description="0: greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="Only 1.")
    user: str | None = Field(None, description="Accepted and ignored.")


RESERVED_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<IMG_CONTEXT>")
"""Vision placeholders of the families' prompts (Qwen's; InternVL's `<IMG_CONTEXT>`)."""


def _check_text(text: str, index: int) -> None:
    """Vision placeholders typed as text would be read as image slots; refuse them (checked on a
    message's text parts joined, so a placeholder split across two parts is found too)."""
    for token in RESERVED_TOKENS:
        if token in text:
            raise RequestError(400, f"messages[{index}]: text may not contain {token}", param=f"messages[{index}]")


def split_messages(messages: list[ChatMessage]) -> tuple[list[dict], list[str], list[str]]:
    """(chat-template messages with image placeholders, data URLs in order, where each URL was)."""
    converted, urls, places = [], [], []
    for index, message in enumerate(messages):
        parts = [message.content] if isinstance(message.content, str) else message.content
        _check_text("".join(p if isinstance(p, str) else p.text for p in parts if not isinstance(p, ImagePart)), index)
        if isinstance(message.content, str):
            converted.append({"role": message.role, "content": message.content})
            continue
        template = []
        for position, part in enumerate(message.content):
            if isinstance(part, TextPart):
                template.append({"type": "text", "text": part.text})
                continue
            place = f"messages[{index}].content[{position}]"
            if not part.image_url.url.startswith("data:"):
                raise RequestError(
                    400, f"{place}: only data: URLs are accepted (remote image fetching is disabled)", param=place
                )
            urls.append(part.image_url.url)
            places.append(place)
            template.append({"type": "image"})
        converted.append({"role": message.role, "content": template})
    return converted, urls, places


def prompt_chars(messages: list[dict]) -> int:
    return sum(
        len(m["content"]) if isinstance(m["content"], str) else sum(len(p.get("text", "")) for p in m["content"])
        for m in messages
    )


def parse_request(body: dict) -> ChatRequest:
    """A handle call's arguments as a request (400 naming the first invalid field)."""
    try:
        return ChatRequest.model_validate({**body, "stream": False})
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise RequestError(400, f"{where}: {first['msg']}", param=where) from None


def _relabel(error: RequestError, places: list[str]) -> RequestError:
    """An image's error as the chat request names it (`messages[i].content[j]`, not `items[k]`)."""
    if error.param and error.param.startswith("items["):
        place = places[int(error.param[6:-1])]
        return RequestError(
            error.status, error.message.replace(error.param, place, 1), place, error.error_type, error.headers
        )
    return error


async def complete(router, body: ChatRequest):
    """`/v1/chat/completions` (and the handle's `chat`): check, encode the images, generate."""
    request = await _generate_request(router, body)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(router, request, include_usage), media_type="text/event-stream")
    result = await result_within(router.llm.generate.remote(request), router.config.router.request_timeout_s)
    return completion(router.config.llm.model_id, result)


async def result_within(response, timeout_s: float):
    """A `DeploymentResponse`'s result, or 504 after `timeout_s`: the call is cancelled, which stops
    the generation in the LLM replica (ceasing to await it would not)."""
    try:
        return await asyncio.wait_for(response, timeout_s)
    except asyncio.TimeoutError:
        response.cancel()
        raise RequestError(504, f"not done within request_timeout_s={timeout_s}", error_type="timeout_error") from None


async def _generate_request(router, body: ChatRequest):
    from .llm import GenerateRequest

    config = router.config
    if router.llm is None:
        raise RequestError(404, "this deployment has no LLM (set `llm` in the app config)", error_type="not_found")
    served = {config.model.model_id, config.llm.model_id}
    if body.model is not None and body.model not in served:
        raise RequestError(
            404, f"model {body.model!r} is not served here; use one of {sorted(served)}", "model", "model_not_found"
        )
    max_tokens = body.max_completion_tokens or body.max_tokens or 16
    if max_tokens > config.llm.max_tokens:
        raise RequestError(
            400,
            f"max_tokens={max_tokens} exceeds the deployment's llm.max_tokens={config.llm.max_tokens}",
            "max_tokens",
        )
    messages, urls, places = split_messages(body.messages)
    chars = prompt_chars(messages)
    if chars > config.llm.max_prompt_tokens * CHARS_PER_TOKEN_BOUND:
        raise RequestError(
            413,
            f"prompt of {chars} characters exceeds llm.max_prompt_tokens={config.llm.max_prompt_tokens}",
            "messages",
        )
    try:
        decoded, encoded = await router.encode_raw([RawItem(i, "image", url) for i, url in enumerate(urls)], True)
    except RequestError as error:
        raise _relabel(error, places) from None
    return GenerateRequest(
        messages=messages,
        embeddings=[e.ref for e in encoded],
        grids=[d.spec.grid_thw for d in decoded],
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
    )


async def _stream(router, request, include_usage: bool):
    """Server-sent events; a failure mid-stream ends with an error event and `[DONE]`."""
    model = router.config.llm.model_id
    chunk_id = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        yield sse_chunk(chunk_id, model, {"role": "assistant", "content": ""})
        async for piece in router.llm.options(stream=True).generate_stream.remote(request):
            if piece.get("done"):
                yield sse_chunk(chunk_id, model, {}, piece["finish_reason"])
                if include_usage:
                    counts = usage(piece["prompt_tokens"], piece["completion_tokens"], piece["vision_tokens"])
                    yield sse_chunk(chunk_id, model, None, extra={"usage": counts})
                break
            yield sse_chunk(chunk_id, model, {"content": piece["text"]}, extra={"token_ids": piece["token_ids"]})
    except RequestError as error:
        yield f"data: {json.dumps(error.body())}\n\n"
    except Exception:
        logger.exception("chat stream failed")
        failed = RequestError(500, "generation failed; the error is in the service log", error_type="internal_error")
        yield f"data: {json.dumps(failed.body())}\n\n"
    yield "data: [DONE]\n\n"


def completion(model: str, result, include_token_ids: bool = True) -> dict:
    """A `chat.completion` body (token ids added as an extension, for parity checks)."""
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": result.text},
        "finish_reason": result.finish_reason,
    }
    if include_token_ids:
        choice["token_ids"] = result.token_ids
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(result.prompt_tokens, len(result.token_ids), result.vision_tokens),
    }


def usage(prompt_tokens: int, completion_tokens: int, vision_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "vision_tokens": vision_tokens,
    }


def sse_chunk(
    chunk_id: str, model: str, delta: dict | None, finish_reason: str | None = None, extra: dict | None = None
) -> str:
    """One server-sent event of a streamed completion (`delta=None`: a chunk without choices)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
    body = {
        "id": chunk_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **(extra or {}),
    }
    return f"data: {json.dumps(body)}\n\n"
