"""HTTP request and response bodies of `/v1/encode` and the request of `/v1/chat/completions`
(pydantic; they make the OpenAPI docs). Light: the router declares its routes with them.

Every list of a request stops at its first invalid element (`fail_fast`): pydantic would
otherwise report, and FastAPI build, one error per element. Lists whose length the app's limits
bound (items, frames) are checked against them after validation, with the limit named; the
others have a fixed bound here. A request's whole size is bounded before this, by the values
its body may hold (`http.json_value_limit`)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..errors import RequestError
from .json_values import json_path


class _Body(BaseModel):
    """An object of a request: an unknown field is refused with one error, the first one's
    (pydantic's `extra="forbid"` reports every unknown field, one error each)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={"additionalProperties": False})

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_field(cls, data):
        if isinstance(data, dict):
            for key in data:
                if key not in cls.model_fields:
                    raise PydanticCustomError("extra_forbidden", "Extra inputs are not permitted", {"field": key})
        return data


class ImageItem(_Body):
    type: Literal["image"] = Field(description="An image.")
    image: str = Field(description="Base64 of an image file (PNG, JPEG, WebP, ...); a data: URL prefix is accepted.")


class VideoItem(_Body):
    type: Literal["video"] = Field(description="A video.")
    frames: list[str] | None = Field(
        None, fail_fast=True, description="Base64 of each frame's image file, in order (at most `max_video_frames`)."
    )
    video: str | None = Field(None, description="Base64 of a video file (mp4, webm), decoded with PyAV.")


Item = Annotated[Union[ImageItem, VideoItem], Field(discriminator="type")]


class EncodeRequest(_Body):
    items: list[Item] = Field(
        min_length=1,
        fail_fast=True,
        description="Images and videos to encode, answered in this order (at most `max_items_per_request`).",
    )
    model: str | None = Field(None, description="The served model's id (`/v1/models`); another gets 404.")
    encoding_format: Literal["safetensors", "base64", "float"] = Field(
        "base64",
        description="safetensors: application/octet-stream, one tensor per item output in `dtype`; "
        "base64: JSON, little-endian float32 bytes; float: JSON, nested lists.",
    )
    dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="safetensors only: the tensors' dtype (default: the model's)."
    )
    cache: bool = Field(True, description="Use the embedding cache and in-flight dedup for these items.")
    cache_salt: str | None = Field(
        None,
        max_length=256,
        description="Share cache entries only with requests that give the same salt (and, by default, the "
        "same tenant: `router.cache_sharing`).",
    )

    @field_validator("dtype")
    @classmethod
    def _dtype_is_for_safetensors(cls, dtype: str | None, info: ValidationInfo) -> str | None:
        """A dtype the JSON forms would ignore is refused, not dropped: they are always float32."""
        if "encoding_format" not in info.data:  # refused itself: that error is the one to report
            return dtype
        if dtype is not None and info.data["encoding_format"] != "safetensors":
            raise ValueError("applies to encoding_format 'safetensors' only (the JSON forms are little-endian float32)")
        return dtype


class Embedding(BaseModel):
    index: int = Field(description="Position of the item in the request.")
    modality: Literal["image", "video"]
    grid_thw: list[int] = Field(description="Patch grid (t, h, w) as the processor reports it.")
    shape: list[int] = Field(description="[tokens, hidden] of `embedding`.")
    embedding: str | list[list[float]]
    deepstack: list[str | list[list[float]]] | None = Field(
        None, description="Qwen3-VL deepstack features, one per deepstack layer, same form and shape."
    )


class Usage(BaseModel):
    vision_tokens: int


class EncodeResponse(BaseModel):
    model: str
    data: list[Embedding]
    usage: Usage


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---- /v1/chat/completions ----

SEED_RANGE = (-(2**63), 2**64 - 1)
"""What the generator's seed accepts."""
MAX_MESSAGES = 2048
"""Most messages of a chat request."""
MAX_CONTENT_PARTS = 2048
"""Most content parts of one message."""


class ImageURL(_Body):
    url: str = Field(description="A data: URL (data:image/png;base64,...). Remote URLs are refused.")
    detail: str | None = Field(None, description="Accepted and ignored.")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS, fail_fast=True)]
    name: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class ChatRequest(_Body):
    model: str | None = Field(None, description="One of /v1/models' ids (or omitted).")
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0, le=2, description="0: greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    ignore_eos: bool = Field(
        False, description="Generate max_tokens tokens past any end of sequence (vLLM's extension, for benchmarks)."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="Only 1.")
    user: str | None = Field(None, description="Accepted and ignored.")
    cache_salt: str | None = Field(
        None, max_length=256, description="The images' cache entries are shared only with requests of the same salt."
    )


def parse_chat_request(body: dict) -> ChatRequest:
    """A handle call's arguments as a request (a 4xx naming the first invalid field, as over HTTP)."""
    try:
        return ChatRequest.model_validate({**body, "stream": False})
    except ValidationError as error:
        raise request_error(error.errors(include_url=False, include_input=False)) from None


# ---- validation errors as the API reports them ----

TAGGED_LISTS = ("items", "content")
"""Lists of tagged unions: pydantic puts an element's tag (`image`, `text`) after its index."""
PLAIN_UNIONS = ("content",)
"""Fields of a plain union (str | list): pydantic puts the member (`str`, `list[...]`) after the name."""
ERRORS_READ = 8
"""Validation errors looked at: the first, and the others of its union."""


def request_error(errors: list[dict]) -> RequestError:
    """The first of a request's validation errors (pydantic's, or FastAPI's with `body` first) as
    a `RequestError`: `items[3].frames[0]: Input should be a valid string`, its param the item
    (`items[3]`, `messages[0].content[1]`) or the field; 413 for a list over its length limit.
    Where the first is the `str` member's error of a plain union (a chat message's content is a
    string or a list of parts) and the content was a list, the list member's error replaces it:
    it says what is wrong in the list."""
    chosen = errors[0]
    if chosen.get("type") == "json_invalid":
        detail = (chosen.get("ctx") or {}).get("error") or chosen.get("msg")
        return RequestError(400, f"body is not valid JSON: {detail}")
    path = data_path(chosen)
    if _is_string_member(chosen.get("loc", ())):
        for other in errors[1:ERRORS_READ]:
            place = data_path(other)
            if place[: len(path)] == path and (len(place) > len(path) or other.get("type") == "too_long"):
                chosen, path = other, place
                break
    status = 413 if chosen.get("type") == "too_long" else 400
    return RequestError(status, f"{json_path(path) or 'body'}: {chosen.get('msg', 'invalid')}", error_param(path))


def data_path(error: dict) -> tuple[str | int, ...]:
    """An error's place in the request's JSON: pydantic's location without FastAPI's `body` and
    the union members pydantic names in it (an item's `video`, a content's `str`), and with the
    unknown field of an `extra_forbidden`."""
    loc = tuple(error.get("loc", ()))
    path: list[str | int] = []
    skip = False
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if skip:
            skip = False
            continue
        path.append(part)
        tagged = isinstance(part, int) and len(path) >= 2 and path[-2] in TAGGED_LISTS
        skip = tagged or part in PLAIN_UNIONS
    if error.get("type") == "extra_forbidden" and "field" in (error.get("ctx") or {}):
        path.append(error["ctx"]["field"])
    return tuple(path)


def _is_string_member(loc: tuple) -> bool:
    return any(a in PLAIN_UNIONS and b == "str" for a, b in zip(loc, loc[1:]))


def error_param(path: tuple[str | int, ...]) -> str | None:
    """The `param` of an error at `path`: the item, message or content part it is in, or the field."""
    if len(path) >= 4 and path[0] == "messages" and path[2] == "content" and isinstance(path[3], int):
        return json_path(path[:4])
    if len(path) >= 2 and path[0] in ("items", "messages") and isinstance(path[1], int):
        return json_path(path[:2])
    return json_path(path) or None
