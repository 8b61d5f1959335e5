"""Serializing `/v1/encode` responses: safetensors (binary, the model's dtype) or JSON.

safetensors is what a caller that cares about speed asks for: one tensor per item output,
no base64, no float32 inflation. In the JSON forms the body is assembled from bytes around
the base64 payloads, since `json.dumps` would scan every character of such strings.
"""

from __future__ import annotations

import base64
import json

import torch
from safetensors.torch import save

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def encode_response_safetensors(model_id: str, results: list, dtype: str | None) -> bytes:
    """`{i}.embedding` and `{i}.deepstack.{k}` tensors; model, usage and each item's grid and
    modality in the header's `__metadata__` (string values, JSON where structured)."""
    tensors, metadata = {}, {"model": model_id}
    for r in results:
        tensors[f"{r.index}.embedding"] = _as(r.embedding, dtype)
        for layer, features in enumerate([] if r.deepstack is None else r.deepstack):
            tensors[f"{r.index}.deepstack.{layer}"] = _as(features, dtype)
        metadata[f"{r.index}.grid_thw"] = json.dumps(list(r.grid_thw))
        metadata[f"{r.index}.modality"] = r.modality
    metadata["usage"] = json.dumps({"vision_tokens": sum(int(r.embedding.shape[0]) for r in results)})
    return save(tensors, metadata)


def _as(tensor: torch.Tensor, dtype: str | None) -> torch.Tensor:
    if dtype is not None:
        tensor = tensor.to(DTYPES[dtype])
    return tensor.contiguous()


def float32_base64(tensor: torch.Tensor) -> bytes:
    """Little-endian float32 bytes of `tensor`, base64-encoded."""
    return base64.b64encode(tensor.to(torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes())


def _payload(tensor: torch.Tensor, encoding_format: str) -> bytes:
    if encoding_format == "float":
        return json.dumps(tensor.to(torch.float32).tolist()).encode()
    return b'"' + float32_base64(tensor) + b'"'


def item_json(result, encoding_format: str) -> bytes:
    head = {
        "index": result.index,
        "modality": result.modality,
        "grid_thw": list(result.grid_thw),
        "shape": list(result.embedding.shape),
    }
    parts = [json.dumps(head)[:-1].encode(), b', "embedding": ', _payload(result.embedding, encoding_format)]
    if result.deepstack is not None:
        layers = b", ".join(_payload(layer, encoding_format) for layer in result.deepstack)
        parts += [b', "deepstack": [', layers, b"]"]
    return b"".join(parts) + b"}"


def encode_response_json(model_id: str, results: list, encoding_format: str) -> bytes:
    """The whole response body, byte for byte what `json.dumps` of the same dict would parse to."""
    tokens = sum(int(r.embedding.shape[0]) for r in results)
    data = b", ".join(item_json(r, encoding_format) for r in results)
    return b"".join(
        [
            b'{"model": ',
            json.dumps(model_id).encode(),
            b', "data": [',
            data,
            b'], "usage": ',
            json.dumps({"vision_tokens": tokens}).encode(),
            b"}",
        ]
    )
