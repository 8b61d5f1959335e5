"""HTTP request and response bodies of `/v1/encode` (pydantic; they make the OpenAPI docs)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


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
