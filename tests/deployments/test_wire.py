"""What travels through Ray's object store: packs of pixels to a replica, item outputs back.

Ray pickles with protocol 5 and keeps out-of-band buffers out of the pickle stream (written
once into shared memory, read without a copy). Tensors must travel as such buffers, an item
sliced from a pack must carry only its own bytes, and reading an item must run nothing but
numpy's own unpickling (no code of ours inside Ray's deserialization).
"""

import json
import pickle
import pickletools
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deployments import wire
from deployments.wire import PackRequest, item_from_wire, item_nbytes, item_to_wire
from models.protocol import ItemOutput, ItemSpec
from tests.serve_harness import ROOT


def pickled(value) -> tuple[object, int, int]:
    """(round trip, bytes in the pickle stream, bytes out of band)."""
    buffers = []
    stream = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(stream, buffers=buffers), len(stream), sum(b.raw().nbytes for b in buffers)


def read_only_buffers(value) -> object:
    """A round trip whose out-of-band buffers are read-only, as Ray's object store hands them out."""
    buffers = []
    stream = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(stream, buffers=[memoryview(b.raw()).toreadonly() for b in buffers])


def test_an_item_carries_its_own_rows_out_of_band_in_its_dtype():
    pack_tokens = torch.randn(300, 64).to(torch.bfloat16)
    pack_deepstack = torch.randn(3, 300, 64).to(torch.bfloat16)
    item = ItemOutput(pack_tokens[100:150], pack_deepstack[:, 100:150])  # views of the pack
    back, in_band, out_of_band = pickled(item_to_wire(item))
    assert out_of_band == (50 * 64 + 3 * 50 * 64) * 2  # the item's rows, not the pack's storage
    assert in_band < 1024 and item_nbytes(back) == out_of_band
    read = item_from_wire(back)
    assert read.tokens.dtype == torch.bfloat16 and torch.equal(read.tokens, item.tokens)
    assert torch.equal(read.deepstack, item.deepstack)
    float_item = ItemOutput(torch.randn(7, 16), None)
    again = item_from_wire(pickled(item_to_wire(float_item))[0])
    assert (
        again.deepstack is None and again.tokens.dtype == torch.float32 and torch.equal(again.tokens, float_item.tokens)
    )


def test_reading_an_item_runs_numpy_alone():
    """The pickle stream of an item names nothing but numpy's reconstruction (no class or function of
    ours, no torch), and unpickling it in a process without torch imports neither torch nor this project."""
    item = ItemOutput(torch.randn(20, 8).to(torch.bfloat16), torch.randn(3, 40, 8).to(torch.bfloat16)[:, 10:30])
    buffers = []
    stream = pickle.dumps(item_to_wire(item), protocol=5, buffer_callback=buffers.append)
    strings = [arg for op, arg, _ in pickletools.genops(stream) if op.name in ("SHORT_BINUNICODE", "BINUNICODE")]
    named = {s for s in strings if "." in s or s.startswith("_")}
    assert all(s.startswith("numpy") or s.startswith("_") for s in named), named
    assert not any("deployments" in s or "models" in s or "torch" in s for s in strings), strings
    data = [stream.hex(), [bytes(b.raw()).hex() for b in buffers]]
    code = (
        "import json, pickle, sys; stream, buffers = json.load(sys.stdin); "
        "value = pickle.loads(bytes.fromhex(stream), buffers=[bytes.fromhex(b) for b in buffers]); "
        "print(json.dumps([sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deployments', 'models')), "
        "value['dtype'], list(value['tokens'].shape), len(value['deepstack'])]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(data), capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert json.loads(done.stdout) == [[], "bfloat16", [20, 8], 3]


def test_a_reader_cannot_write_the_stored_item_and_a_copy_is_its_own():
    """What `ray.get` gives is read-only (the pages every reader shares); `copy=True` is the caller's
    own memory, writable without changing what the next reader gets."""
    item = ItemOutput(torch.randn(50, 64).to(torch.bfloat16), torch.randn(3, 80, 64).to(torch.bfloat16)[:, 10:60])
    stored = read_only_buffers(item_to_wire(item))
    with pytest.raises(ValueError, match="read-only"):
        stored["tokens"].fill(7)
    with pytest.raises(ValueError):
        stored["tokens"].setflags(write=True)
    mine = item_from_wire(stored, copy=True)
    mine.tokens.fill_(7.0)
    mine.deepstack.fill_(7.0)
    view = item_from_wire(stored)  # what the service's own readers take: no copy
    assert torch.equal(view.tokens, item.tokens) and torch.equal(view.deepstack, item.deepstack)
    assert view.tokens.data_ptr() == np.asarray(stored["tokens"]).ctypes.data


def test_a_pack_carries_its_pixels_out_of_band():
    pixels = [
        torch.randint(0, 256, (3, 64, 96), dtype=torch.uint8),
        torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8),
    ]
    specs = [ItemSpec("image", (1, 4, 6), 24, 6), ItemSpec("image", (1, 2, 2), 4, 1)]
    pack = PackRequest(7, "image", pixels, specs, requests=2)
    back, in_band, out_of_band = pickled(pack)
    assert out_of_band == sum(p.numel() for p in pixels)
    assert in_band < 2048
    assert back.pack_id == 7 and back.specs == specs and back.modality == "image" and back.requests == 2
    assert all(torch.equal(a, b) and b.dtype == torch.uint8 for a, b in zip(pixels, back.pixels))


def test_a_packs_router_figures_travel_as_state_an_earlier_replica_ignores(monkeypatch):
    pack = PackRequest(3, "image", [torch.zeros(3, 4, 4, dtype=torch.uint8)], [ItemSpec("image", (1, 2, 2), 4, 1)])
    pack.router, pack.router_waiting_tokens, pack.router_report = "r1", 5_000, 12
    data = pickle.dumps(pack)
    got = pickle.loads(data)
    assert (got.router, got.router_waiting_tokens, got.router_report, got.pack_id) == ("r1", 5_000, 12, 3)

    def earlier(pack_id, modality, pixels, specs, requests=1):  # the rebuild before these fields
        return SimpleNamespace(pack_id=pack_id)

    monkeypatch.setattr(wire, "_pack_from_wire", earlier)
    assert pickle.loads(data).pack_id == 3


def test_an_items_deepstack_levels_go_out_of_band_without_a_copy():
    """A replica's store thread pickles every item of every forward: the levels of an item's
    deepstack (each contiguous in the pack) are written from the pack's own memory, not first
    gathered into one block."""
    pack_deepstack = torch.randn(3, 300, 64).to(torch.bfloat16)
    item = ItemOutput(torch.zeros(50, 64), pack_deepstack[:, 100:150])
    buffers = []
    pickle.dumps(item_to_wire(item), protocol=5, buffer_callback=buffers.append)
    start = pack_deepstack.data_ptr()
    end = start + pack_deepstack.nbytes
    inside = [b for b in buffers if start <= memoryview(b.raw()).obj.__array_interface__["data"][0] < end]
    assert len(inside) == 3


def test_fetch_gives_the_caller_its_own_copy_large_or_small(serve_harness, monkeypatch):
    """`fetch` copies results of `THREAD_COPY_BYTES` or more in a worker thread (the caller's event
    loop runs on meanwhile) and smaller ones in place: either way the caller gets the stored values
    in memory of its own, and a second `fetch` keeps the first copy."""
    import asyncio
    import threading

    import ray

    from deployments import results
    from deployments.results import THREAD_COPY_BYTES, EncodeResult

    copied_on = []

    def recording(value, copy=False):
        copied_on.append(threading.get_ident())
        return item_from_wire(value, copy)

    monkeypatch.setattr(results, "item_from_wire", recording)

    async def fetch_twice(result):
        await result.fetch()
        first = result.embedding
        await result.fetch()
        return threading.get_ident(), first

    for rows, threaded in ((8, False), (THREAD_COPY_BYTES // (4 * 256 * 2) + 1, True)):  # bf16, 4 blocks
        stored = ItemOutput(torch.randn(rows, 256).to(torch.bfloat16), torch.randn(3, rows, 256).to(torch.bfloat16))
        ref = ray.put(item_to_wire(stored))
        result = EncodeResult(0, "image", (1, 2, 2), rows, ref)
        copied_on.clear()
        loop_thread, first = asyncio.run(fetch_twice(result))
        assert len(copied_on) == 1 and (copied_on[0] != loop_thread) == threaded
        assert result.embedding is first
        assert torch.equal(result.embedding, stored.tokens) and torch.equal(result.deepstack, stored.deepstack)
        result.embedding.zero_()
        result.deepstack.zero_()
        again = item_from_wire(ray.get(ref))
        assert torch.equal(again.tokens, stored.tokens) and torch.equal(again.deepstack, stored.deepstack)
