"""OpenAI-compatible chat completions: message conversion, generation, response shapes (the
request schema is in `schemas.py`).

Images come as `image_url` parts with `data:` URLs (fetching remote URLs is off: no SSRF).
Messages are converted to transformers' chat-template form with `{"type": "image"}`
placeholders, in order; the router encodes the images and the LLM replica expands each
placeholder to the image's token count. The prompt's length is checked in the router first, from
the LLM's tokenizer and the images' inspected token counts (`prompt_tokens.py`): a prompt over
`llm.max_prompt_tokens` is refused before any image is decoded, and before a stream begins.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable

from fastapi.responses import StreamingResponse

from models.protocol import ItemSpec

from ..config import AppConfig, Limits
from ..decode.media import RawItem
from ..errors import RequestError, overloaded
from .prompt_tokens import PromptText, count_text
from .schemas import ChatMessage, ChatRequest, ImagePart, TextPart

logger = logging.getLogger("ray.serve")

CHARS_PER_TOKEN_BOUND = 32
"""A prompt longer than this many characters per allowed token is refused before tokenizing."""


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


def _relabel(error: RequestError, places: list[str]) -> RequestError:
    """An image's error as the chat request names it (`messages[i].content[j]`, not `items[k]`)."""
    if error.param and error.param.startswith("items["):
        place = places[int(error.param[6:-1])]
        return RequestError(
            error.status, error.message.replace(error.param, place, 1), place, error.error_type, error.headers
        )
    return error


async def complete(service, body: ChatRequest, scope: str | None):
    """`/v1/chat/completions` (and the handle's `chat`) for the router's `EncodeService`: check,
    encode the images (sharing cache entries within `scope`), generate."""
    request = await _generate_request(service, body, scope)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(service, request, include_usage), media_type="text/event-stream")
    result = await result_within(
        service.llm.generate.remote(request), service.config.router.request_timeout_s, service.llm.deployment_name
    )
    return completion(service.config.llm.model_id, result)


async def result_within(response, timeout_s: float, deployment: str | None = None):
    """A `DeploymentResponse`'s result, or 504 after `timeout_s` (naming the `deployment` that did
    not answer): the call is cancelled, which stops the generation in the LLM replica (ceasing to
    await it would not)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    who = "" if deployment is None else f"LLM deployment {deployment!r}: "
    try:
        return await asyncio.wait_for(response, timeout_s)
    except asyncio.TimeoutError:
        response.cancel()
        raise RequestError(
            504, f"{who}not done within request_timeout_s={timeout_s}", error_type="timeout_error"
        ) from None
    except (ActorDiedError, ActorUnavailableError) as error:  # its replica died or went away mid-request
        raise RequestError(
            503,
            f"{who}its replica failed during the request ({type(error).__name__}); send again",
            error_type="overloaded_error",
        ) from None


def check_llm(service) -> None:
    """503 at once, naming the LLM deployment and why, when no LLM replica runs (it is starting,
    failing or cannot be scheduled): a request sent to it would wait for a replica until
    `request_timeout_s`."""
    fleet = getattr(service, "fleet", None)
    if fleet is not None and not fleet.llm_ready:
        raise overloaded(fleet.why_llm_not_ready(), service.config.router.retry_after_s)


async def _generate_request(service, body: ChatRequest, scope: str | None):
    from ..wire import GenerateRequest

    config = service.config
    if service.llm is None:
        raise RequestError(404, "this deployment has no LLM (set `llm` in the app config)", error_type="not_found")
    served = {config.model.model_id, config.llm.model_id}
    if body.model is not None and body.model not in served:
        raise RequestError(404, f"model {body.model!r} is not served here; use one of {sorted(served)}", "model")
    max_tokens = body.max_completion_tokens or body.max_tokens or 16
    if max_tokens > config.llm.max_tokens:
        raise RequestError(
            400,
            f"max_tokens={max_tokens} exceeds the deployment's llm.max_tokens={config.llm.max_tokens}",
            "max_tokens",
        )
    messages, urls, places = split_messages(body.messages)
    check_image_count(places, config.limits)
    check_llm(service)  # before any image is decoded or encoded for it
    prompt = await _prompt_text(config, messages)
    raws = [RawItem(i, "image", url) for i, url in enumerate(urls)]
    try:
        decoded, encoded = await service.encode_raw(raws, scope, check_specs=spec_check(prompt, places, config))
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
        ignore_eos=body.ignore_eos,
    )


async def _prompt_text(config: AppConfig, messages: list[dict]) -> PromptText:
    """The prompt's text tokens, refused at once when they alone exceed the LLM's limit (a text far
    too long for it is refused before it is tokenized)."""
    limit = config.llm.max_prompt_tokens
    chars = prompt_chars(messages)
    if chars > limit * CHARS_PER_TOKEN_BOUND:
        raise RequestError(413, f"prompt of {chars} characters exceeds llm.max_prompt_tokens={limit}", "messages")
    prompt = await asyncio.to_thread(count_text, config.llm, messages)
    if prompt.text_tokens > limit:
        raise RequestError(
            413, f"prompt of {prompt.text_tokens} text tokens exceeds llm.max_prompt_tokens={limit}", "messages"
        )
    return prompt


def check_image_count(places: list[str], limits: Limits) -> None:
    """Images over the request's item limit: the first one over it is named."""
    limit = limits.max_items_per_request
    if len(places) > limit:
        place = places[limit]
        raise RequestError(
            413, f"{place}: {len(places)} images, over max_items_per_request={limit} from this one on", place
        )


def spec_check(prompt: PromptText, places: list[str], config: AppConfig) -> Callable[[list[ItemSpec]], None]:
    """The check of a chat's inspected images, before any is decoded: their vision tokens within the
    request's limit, and the whole prompt within the LLM's. An error names the image at which the
    total passes the limit (the prompt's text counted first)."""
    limits, max_prompt_tokens = config.limits, config.llm.max_prompt_tokens

    def check(specs: list[ItemSpec]) -> None:
        vision = [spec.output_tokens for spec in specs]
        if sum(vision) > limits.max_tokens_per_request:
            place = places[_passing(vision, 0, limits.max_tokens_per_request)]
            raise RequestError(
                413,
                f"{place}: the images need {sum(vision)} vision tokens, over max_tokens_per_request="
                f"{limits.max_tokens_per_request} from this image on",
                place,
            )
        total = prompt.total(vision)
        if total > max_prompt_tokens:
            per_image = [tokens + prompt.tokens_per_image for tokens in vision]
            place = places[_passing(per_image, prompt.text_tokens, max_prompt_tokens)]
            raise RequestError(
                413,
                f"{place}: prompt of {total} tokens ({prompt.text_tokens} of text, {sum(vision)} of its images) "
                f"exceeds llm.max_prompt_tokens={max_prompt_tokens} from this image on",
                place,
            )

    return check


def _passing(counts: list[int], start: int, limit: int) -> int:
    """The index at which `start` plus the running sum of `counts` first exceeds `limit`."""
    total = start
    for index, count in enumerate(counts):
        total += count
        if total > limit:
            return index
    raise ValueError(f"{start} + {sum(counts)} does not exceed {limit}")


async def _stream(service, request, include_usage: bool):
    """Server-sent events; a failure mid-stream ends with an error event and `[DONE]`."""
    model = service.config.llm.model_id
    chunk_id = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        yield sse_chunk(chunk_id, model, {"role": "assistant", "content": ""})
        last = None
        # read to the stream's end, never `break`: Serve counts a generation finished (its router's
        # in-flight count, its replica's queue) only when the stream has ended here
        async for piece in service.llm.options(stream=True).generate_stream.remote(request):
            if piece.get("done"):
                last = piece
            elif last is None:
                yield sse_chunk(chunk_id, model, {"content": piece["text"]}, extra={"token_ids": piece["token_ids"]})
        if last is not None:
            yield sse_chunk(chunk_id, model, {}, last["finish_reason"])
            if include_usage:
                counts = usage(last["prompt_tokens"], last["completion_tokens"], last["vision_tokens"])
                yield sse_chunk(chunk_id, model, None, extra={"usage": counts})
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
