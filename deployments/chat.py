"""OpenAI-compatible chat completions: request schema, message conversion, response shapes.

Images come as `image_url` parts with `data:` URLs (fetching remote URLs is off: no SSRF).
Messages are converted to transformers' chat-template form with `{"type": "image"}`
placeholders, in order; the router encodes the images and the LLM replica expands each
placeholder to the image's token count.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from .errors import RequestError


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
    model: str | None = Field(None, description="Accepted; the deployment serves one model.")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0, le=2, description="0: greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="Only 1.")
    user: str | None = Field(None, description="Accepted and ignored.")


RESERVED_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<IMG_CONTEXT>")
"""Vision placeholders of the families' prompts (Qwen's; InternVL's `<IMG_CONTEXT>`)."""


def _check_text(text: str, index: int) -> None:
    """Vision placeholders typed as text would be read as image slots; refuse them."""
    for token in RESERVED_TOKENS:
        if token in text:
            raise RequestError(400, f"messages[{index}]: text may not contain {token}", param=f"messages[{index}]")


def split_messages(messages: list[ChatMessage]) -> tuple[list[dict], list[str]]:
    """(chat-template messages with image placeholders, data URLs in order)."""
    converted, urls = [], []
    for index, message in enumerate(messages):
        for part in [message.content] if isinstance(message.content, str) else message.content:
            if isinstance(part, (str, TextPart)):
                _check_text(part if isinstance(part, str) else part.text, index)
        if isinstance(message.content, str):
            converted.append({"role": message.role, "content": message.content})
            continue
        parts = []
        for part in message.content:
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
                continue
            if not part.image_url.url.startswith("data:"):
                raise RequestError(
                    400,
                    f"messages[{index}]: only data: URLs are accepted (remote image fetching is disabled)",
                    param=f"messages[{index}]",
                )
            urls.append(part.image_url.url)
            parts.append({"type": "image"})
        converted.append({"role": message.role, "content": parts})
    return converted, urls


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
