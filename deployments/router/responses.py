"""Serializing `/v1/encode` responses: safetensors (binary, the model's dtype) or JSON.

safetensors is what a caller that cares about speed asks for: one tensor per item output,
no base64, no float32 inflation. In the JSON forms the body is assembled from bytes around
the payloads, since `json.dumps` would scan every character of a base64 string. Every form
streams: no response-sized buffer is built (a `float` body is ~20 bytes a value, ~350 KB a
Qwen3-VL token with its deepstack).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Iterator

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SAFETENSORS_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}
CHUNK_BYTES = 4 << 20
"""Bytes per chunk of a streamed body: small enough that the allocator reuses its freed chunks
(a buffer of a whole response, tens to hundreds of MB, is mapped fresh for every response and
faults in page by page), large enough that the chunks cost nothing per call."""


def safetensors_body(
    model_id: str, results: list, dtype: str | None, views: bool = False
) -> tuple[int, AsyncIterator[bytes | memoryview]]:
    """The response as a safetensors file, as (its length, its chunks): `{i}.embedding` and
    `{i}.deepstack.{k}` tensors; model, usage and each item's grid and modality in the header's
    `__metadata__` (string values, JSON where structured). The tensors go out a chunk at a time
    from where they lie in the object store: with `views`, as views of it (where the router's own
    HTTP server writes them; Serve's proxy pickles each message, and a view does not pickle),
    else copied (or converted, where another dtype is asked) in a worker thread. The safetensors
    library's `save` would build the whole file in one buffer first. Decode it with
    `safetensors.torch.load`."""
    tensors, metadata = {}, {"model": model_id}
    for r in results:
        tensors[f"{r.index}.embedding"] = r.embedding
        for layer, features in enumerate([] if r.deepstack is None else r.deepstack):
            tensors[f"{r.index}.deepstack.{layer}"] = features
        metadata[f"{r.index}.grid_thw"] = json.dumps(list(r.grid_thw))
        metadata[f"{r.index}.modality"] = r.modality
    metadata["usage"] = json.dumps({"vision_tokens": sum(int(r.embedding.shape[0]) for r in results)})
    target = {name: DTYPES[dtype] if dtype else t.dtype for name, t in tensors.items()}
    header = safetensors_header({name: (target[name], list(t.shape)) for name, t in tensors.items()}, metadata)
    length = len(header) + sum(t.numel() * target[n].itemsize for n, t in tensors.items())

    async def chunks() -> AsyncIterator[bytes | memoryview]:
        yield header
        for name, tensor in tensors.items():
            flat, step = tensor.reshape(-1), CHUNK_BYTES // target[name].itemsize
            for start in range(0, flat.numel(), step):
                piece = flat[start : start + step]
                if views and piece.dtype == target[name]:  # the bytes as they lie: no copy, no thread
                    yield memoryview(piece.view(torch.uint8).numpy())
                else:
                    yield await asyncio.to_thread(_converted_bytes, piece, target[name])

    return length, chunks()


def _converted_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> bytes:
    return tensor.to(dtype).view(torch.uint8).numpy().tobytes()


def safetensors_header(tensors: dict[str, tuple[torch.dtype, list[int]]], metadata: dict[str, str]) -> bytes:
    """The 8-byte length and JSON header of a safetensors file whose tensors (name: dtype, shape)
    follow in this order, little-endian and contiguous (the format's specification)."""
    entries, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = dtype.itemsize * int(torch.Size(shape).numel())
        entries[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    entries["__metadata__"] = metadata
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors start 8-byte aligned
    return len(text).to_bytes(8, "little") + text


B64_ELEMENTS = 3 << 18
"""float32 values per base64 chunk of a streamed JSON body: 3 MB, a multiple of 3 bytes, so the
chunks' base64 joins into the whole tensor's."""


def json_body(model_id: str, results: list) -> tuple[int, Iterator[bytes]]:
    """The `base64` JSON response as (its length, its chunks), byte for byte `encode_response_json`'s:
    each tensor converted to float32 and base64-encoded a chunk at a time as the client takes it,
    never a response-sized buffer (the body is ~87 KB a token with Qwen3-VL's deepstack)."""
    parts = _json_parts(model_id, results)
    length = sum(len(p) if isinstance(p, bytes) else 2 + 4 * -(-p.numel() * 4 // 3) for p in parts)

    def chunks() -> Iterator[bytes]:
        for part in parts:
            if isinstance(part, bytes):
                yield part
                continue
            flat = part.reshape(-1)
            yield b'"'
            for start in range(0, flat.numel(), B64_ELEMENTS):
                yield _float32_base64(flat[start : start + B64_ELEMENTS])
            yield b'"'

    return length, chunks()


FLOAT_ELEMENTS = 1 << 16
"""Values per chunk of a streamed `float` body, in whole rows of the tensor: ~1.3 MB of JSON text,
from a Python list of as many floats. `json.dumps` holds the GIL throughout, so this bounds how
long the router's event loop waits for a chunk (~0.1 s on a loaded CPU)."""


def float_json_body(model_id: str, results: list) -> Iterator[bytes]:
    """The `float` JSON response's chunks, byte for byte `json.dumps` of each tensor's nested
    float32 lists (`tensor.float().tolist()`) in `encode_response_json`'s document: each tensor
    written a block of rows at a time as the client takes it. Its length is known only once
    written, so it goes out without a Content-Length (chunked)."""
    for part in _json_parts(model_id, results):
        if isinstance(part, bytes):
            yield part
        else:
            yield from _float_lists(part)


def _float_lists(tensor: torch.Tensor) -> Iterator[bytes]:
    """`json.dumps(tensor.float().tolist())`, in blocks of rows: the text of a list is its
    elements' texts joined with ", " in brackets, so the blocks' inner texts join into it."""
    if tensor.dim() == 0:
        yield json.dumps(tensor.to(torch.float32).item()).encode()
        return
    row = max(1, tensor[0].numel()) if len(tensor) else 1
    step = max(1, FLOAT_ELEMENTS // row)
    yield b"["
    for start in range(0, len(tensor), step):
        text = json.dumps(tensor[start : start + step].to(torch.float32).tolist())
        yield (b", " if start else b"") + text[1:-1].encode()
    yield b"]"


def encode_response_json(model_id: str, results: list, encoding_format: str) -> bytes:
    """The whole JSON response body in one buffer (the streamed forms' chunks joined), byte for
    byte what `json.dumps` of the same dict would parse to."""
    if encoding_format == "float":
        return b"".join(float_json_body(model_id, results))
    return b"".join(json_body(model_id, results)[1])


def _json_parts(model_id: str, results: list) -> list[bytes | torch.Tensor]:
    """The body's bytes in order, assembled around the payloads (`json.dumps` would scan every
    character of a base64 string); each payload stays a tensor, written by the caller."""
    parts: list[bytes | torch.Tensor] = [b'{"model": ', json.dumps(model_id).encode(), b', "data": [']
    for number, result in enumerate(results):
        head = {
            "index": result.index,
            "modality": result.modality,
            "grid_thw": list(result.grid_thw),
            "shape": list(result.embedding.shape),
        }
        parts += [b", " if number else b"", json.dumps(head)[:-1].encode(), b', "embedding": ', result.embedding]
        if result.deepstack is not None:
            parts.append(b', "deepstack": [')
            for level, layer in enumerate(result.deepstack):
                parts += [b", " if level else b"", layer]
            parts.append(b"]")
        parts.append(b"}")
    tokens = sum(int(r.embedding.shape[0]) for r in results)
    parts += [b'], "usage": ', json.dumps({"vision_tokens": tokens}).encode(), b"}"]
    return parts


def _float32_base64(tensor: torch.Tensor) -> bytes:
    """Little-endian float32 bytes of `tensor`, base64-encoded."""
    return base64.b64encode(tensor.to(torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes())
