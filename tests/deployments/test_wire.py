"""What travels through Ray's object store: packs of pixels to a replica, item outputs back.

Ray pickles with protocol 5 and keeps out-of-band buffers out of the pickle stream (written
once into shared memory, read without a copy). Tensors must travel as such buffers, and an
item sliced from a pack must carry only its own bytes.
"""

import pickle
from types import SimpleNamespace

import torch

from deployments import encoder as encoder_module
from deployments.encoder import PackRequest
from deployments.results import owned
from models.protocol import ItemOutput, ItemSpec


def pickled(value) -> tuple[object, int, int]:
    """(round trip, bytes in the pickle stream, bytes out of band)."""
    buffers = []
    stream = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(stream, buffers=buffers), len(stream), sum(b.raw().nbytes for b in buffers)


def test_an_item_output_carries_its_own_rows_out_of_band_in_its_dtype():
    pack_tokens = torch.randn(300, 64).to(torch.bfloat16)
    pack_deepstack = torch.randn(3, 300, 64).to(torch.bfloat16)
    item = ItemOutput(pack_tokens[100:150], pack_deepstack[:, 100:150])  # views of the pack
    back, in_band, out_of_band = pickled(item)
    assert out_of_band == (50 * 64 + 3 * 50 * 64) * 2  # the item's rows, not the pack's storage
    assert in_band < 1024
    assert back.tokens.dtype == torch.bfloat16 and torch.equal(back.tokens, item.tokens)
    assert torch.equal(back.deepstack, item.deepstack)


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

    monkeypatch.setattr(encoder_module, "_pack_from_wire", earlier)
    assert pickle.loads(data).pack_id == 3


def test_an_items_deepstack_levels_go_out_of_band_without_a_copy():
    """A replica's store thread pickles every item of every forward: the levels of an item's
    deepstack (each contiguous in the pack) are written from the pack's own memory, not first
    gathered into one block."""
    pack_deepstack = torch.randn(3, 300, 64).to(torch.bfloat16)
    item = ItemOutput(torch.zeros(50, 64), pack_deepstack[:, 100:150])
    buffers = []
    pickle.dumps(item, protocol=5, buffer_callback=buffers.append)
    start = pack_deepstack.data_ptr()
    end = start + pack_deepstack.nbytes
    inside = [b for b in buffers if start <= memoryview(b.raw()).obj.__array_interface__["data"][0] < end]
    assert len(inside) == 3


def test_a_caller_owns_its_result_after_one_copy():
    """`owned` copies what shares the object store's pages (the tokens, read in place) and keeps
    what reading already copied (the deepstack, stacked from its levels); either way, writing to
    the caller's tensors changes nothing another reader sees."""
    pack_deepstack = torch.randn(3, 300, 64).to(torch.bfloat16)
    back, _, _ = pickled(ItemOutput(torch.randn(50, 64).to(torch.bfloat16), pack_deepstack[:, 100:150]))
    mine = owned(back)
    assert mine.deepstack is back.deepstack and mine.tokens.data_ptr() != back.tokens.data_ptr()
    assert mine.tokens.dtype == torch.bfloat16 and torch.equal(mine.tokens, back.tokens)
    assert mine.tokens.untyped_storage().resizable() and owned(mine).tokens is mine.tokens  # copied once
    mine.tokens.zero_()
    assert back.tokens.abs().sum() > 0  # the shared copy is untouched
    whole, _, _ = pickled(ItemOutput(torch.randn(50, 64), torch.randn(3, 50, 64)))  # one block: read in place
    copied = owned(whole)
    assert copied.deepstack.data_ptr() != whole.deepstack.data_ptr()
    assert torch.equal(copied.deepstack, whole.deepstack) and torch.equal(copied.tokens, whole.tokens)


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

    def recording_owned(output):
        copied_on.append(threading.get_ident())
        return owned(output)

    monkeypatch.setattr(results, "owned", recording_owned)

    async def fetch_twice(result):
        await result.fetch()
        first = result.embedding
        await result.fetch()
        return threading.get_ident(), first

    for rows, threaded in ((8, False), (THREAD_COPY_BYTES // (4 * 256 * 2) + 1, True)):  # bf16, 4 blocks
        stored = ItemOutput(torch.randn(rows, 256).to(torch.bfloat16), torch.randn(3, rows, 256).to(torch.bfloat16))
        ref = ray.put(stored)
        result = EncodeResult(0, "image", (1, 2, 2), rows, ref)
        copied_on.clear()
        loop_thread, first = asyncio.run(fetch_twice(result))
        assert len(copied_on) == 1 and (copied_on[0] != loop_thread) == threaded
        assert result.embedding is first
        assert torch.equal(result.embedding, stored.tokens) and torch.equal(result.deepstack, stored.deepstack)
        assert result.embedding.untyped_storage().resizable() and result.deepstack.untyped_storage().resizable()
        result.embedding.zero_()
        result.deepstack.zero_()
        again = ray.get(ref)
        assert torch.equal(again.tokens, stored.tokens) and torch.equal(again.deepstack, stored.deepstack)
