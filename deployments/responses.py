"""Serializing `/v1/encode` responses fast: embeddings are most of the bytes.

A Qwen3-VL-8B item of 800 tokens is 13 MB of float32 per array, four arrays with deepstack.
`json.dumps` scans every character of such strings (about 0.5 s per 140 MB); base64 text
needs no escaping, so the body is assembled from bytes around the base64 payloads.
"""

from __future__ import annotations

import base64
import json

import torch


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
