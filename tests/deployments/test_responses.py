"""The streamed response bodies: safetensors read back by the safetensors library itself, JSON by `json`
(and the `float` form byte for byte `json.dumps` of the nested lists)."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load

from deployments.results import EncodeResult
from deployments.router.responses import (
    CHUNK_BYTES,
    FLOAT_ELEMENTS,
    encode_response_json,
    float_json_body,
    json_body,
    safetensors_body,
)
from models.protocol import ItemOutput


def result(index: int, tokens: int, levels: int | None) -> EncodeResult:
    generator = torch.Generator().manual_seed(index)
    block = torch.randn(1 + (levels or 0), tokens, 4096, generator=generator).to(torch.bfloat16)
    output = ItemOutput(block[0], None if levels is None else block[1:])
    return EncodeResult(index, "image", (1, 2 * tokens // 16, 32), tokens, None, _output=output)


def drained(chunks) -> list:
    async def collect():
        return [chunk async for chunk in chunks]

    return asyncio.run(collect())


def test_the_streamed_body_is_a_safetensors_file_of_every_output(tmp_path):
    results = [result(0, 700, 3), result(1, 64, None)]  # 5.6 MB a tensor: several chunks each
    length, chunks = safetensors_body("qwen3-vl-8b", results, None, views=True)
    chunks = drained(chunks)
    body = b"".join(chunks)
    assert len(body) == length and max(len(c) for c in chunks[1:]) <= CHUNK_BYTES and len(chunks) > 6
    # in the model's dtype the chunks are the outputs' own memory, not copies of it
    assert numpy.shares_memory(numpy.asarray(chunks[1]), results[0].embedding.view(torch.uint8).numpy())
    copied = drained(safetensors_body("qwen3-vl-8b", results, None)[1])  # for Serve's proxy, which pickles
    assert b"".join(copied) == body and all(isinstance(chunk, bytes) for chunk in copied)
    assert (8 + int.from_bytes(body[:8], "little")) % 8 == 0  # the tensors start 8-byte aligned
    tensors = load(body)
    assert sorted(tensors) == ["0.deepstack.0", "0.deepstack.1", "0.deepstack.2", "0.embedding", "1.embedding"]
    assert torch.equal(tensors["0.embedding"], results[0].embedding) and tensors["0.embedding"].dtype == torch.bfloat16
    for level in range(3):
        assert torch.equal(tensors[f"0.deepstack.{level}"], results[0].deepstack[level])
    assert torch.equal(tensors["1.embedding"], results[1].embedding)
    (tmp_path / "body.safetensors").write_bytes(body)
    with safe_open(str(tmp_path / "body.safetensors"), "pt") as opened:
        metadata = opened.metadata()
    assert metadata["model"] == "qwen3-vl-8b" and json.loads(metadata["usage"]) == {"vision_tokens": 764}
    assert json.loads(metadata["0.grid_thw"]) == [1, 87, 32] and metadata["1.modality"] == "image"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_requested_dtype_converts_each_tensor_as_it_streams(dtype):
    results = [result(0, 300, 3)]  # float32: 4.9 MB a tensor, two chunks
    length, chunks = safetensors_body("m", results, str(dtype).removeprefix("torch."))
    body = b"".join(drained(chunks))
    tensors = load(body)
    assert len(body) == length and tensors["0.embedding"].dtype == dtype
    assert torch.equal(tensors["0.deepstack.2"], results[0].deepstack[2].to(dtype))


def test_the_streamed_json_body_is_the_documented_document():
    """`base64` streams: a valid JSON document equal to the one `json` and `base64` make of the same
    outputs (little-endian float32); a tensor over one chunk is cut where base64 joins."""
    results = [result(0, 400, 3), result(1, 30, None)]  # 1.6M values a tensor: three chunks each
    length, chunks = json_body("qwen3-vl-8b", results)
    chunks = list(chunks)
    body = b"".join(chunks)
    assert len(body) == length and len(chunks) > 20

    def b64(tensor):
        return base64.b64encode(tensor.float().numpy().astype("<f4").tobytes()).decode()

    expected = {"model": "qwen3-vl-8b", "data": [], "usage": {"vision_tokens": 430}}
    for r in results:
        entry = {"index": r.index, "modality": r.modality, "grid_thw": list(r.grid_thw)}
        entry |= {"shape": list(r.embedding.shape), "embedding": b64(r.embedding)}
        if r.deepstack is not None:
            entry["deepstack"] = [b64(layer) for layer in r.deepstack]
        expected["data"].append(entry)
    assert json.loads(body) == expected
    values = numpy.frombuffer(base64.b64decode(json.loads(body)["data"][0]["embedding"]), dtype="<f4")
    assert torch.equal(torch.from_numpy(values.copy()).reshape(400, 4096), results[0].embedding.float())


def test_the_streamed_float_body_is_json_dumps_of_the_nested_lists_a_block_of_rows_at_a_time():
    """`float` streams too: the body is byte for byte `json.dumps` of the document with each tensor
    as `tolist()` of its float32 values, and no chunk holds more than a block of rows."""
    results = [result(0, 70, 2), result(1, 3, None), result(2, 0, None)]  # 70 rows of 4096: three blocks
    chunks = list(float_json_body("qwen3-vl-8b", results))
    body = b"".join(chunks)
    expected = {"model": "qwen3-vl-8b", "data": [], "usage": {"vision_tokens": 73}}
    for r in results:
        entry = {"index": r.index, "modality": r.modality, "grid_thw": list(r.grid_thw)}
        entry |= {"shape": list(r.embedding.shape), "embedding": r.embedding.float().tolist()}
        if r.deepstack is not None:
            entry["deepstack"] = [layer.float().tolist() for layer in r.deepstack]
        expected["data"].append(entry)
    assert body == json.dumps(expected).encode()
    assert body == encode_response_json("qwen3-vl-8b", results, "float")
    rows_per_block = FLOAT_ELEMENTS // 4096
    assert max(len(c) for c in chunks) <= rows_per_block * 4096 * 26 and len(chunks) > 9  # ~20 characters a value
    assert len(json.loads(body)["data"][0]["embedding"]) == 70
