"""HTTP request and response bodies of `/v1/encode` and the request of `/v1/chat/completions`
(pydantic; they make the OpenAPI docs). Light: the router declares its routes with them."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from .errors import RequestError


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageItem(_Body):
    type: Literal["image"] = Field(description="An image.")
    image: str = Field(description="Base64 of an image file (PNG, JPEG, WebP, ...); a data: URL prefix is accepted.")


class VideoItem(_Body):
    type: Literal["video"] = Field(description="A video.")
    frames: list[str] | None = Field(None, description="Base64 of each frame's image file, in order.")
    video: str | None = Field(None, description="Base64 of a video file (mp4, webm), decoded with PyAV.")


Item = Annotated[Union[ImageItem, VideoItem], Field(discriminator="type")]


class EncodeRequest(_Body):
    items: list[Item] = Field(min_length=1, description="Images and videos to encode, answered in this order.")
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
    cache_salt: str | None = Field(
        None, max_length=256, description="The images' cache entries are shared only with requests of the same salt."
    )


def parse_chat_request(body: dict) -> ChatRequest:
    """A handle call's arguments as a request (400 naming the first invalid field)."""
    try:
        return ChatRequest.model_validate({**body, "stream": False})
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise RequestError(400, f"{where}: {first['msg']}", param=where) from None
