"""The embedding cache: byte bound, hits, in-flight dedup across concurrent requests, opt-out."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from ray import serve

from deployments.router.cache import EmbeddingCache, cache_scope
from deployments.router.encode_queue import Encoded
from tests.deployments.media_helpers import b64, decode_embedding, image_file, pattern
from tests.helpers import model_detail


def test_the_byte_bound_holds_and_least_recent_goes_first():
    cache = EmbeddingCache(max_bytes=300)
    for key in (b"a", b"b", b"c"):
        cache.put(key, Encoded(key, 100, "r1"))
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"d", Encoded(b"d", 100, "r1"))
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.get(b"d") is not None
    assert cache.bytes == 300 and len(cache) == 3
    cache.put(b"huge", Encoded(b"huge", 301, "r1"))  # larger than the whole cache: not stored, nothing evicted
    assert cache.get(b"huge") is None and len(cache) == 3


def test_entries_of_a_dead_replica_are_dropped():
    cache = EmbeddingCache(max_bytes=1000)
    cache.put(b"a", Encoded(b"a", 100, "dead"))
    cache.put(b"b", Encoded(b"b", 100, "alive"))
    cache.forget_replica("dead")
    assert cache.get(b"a") is None and cache.get(b"b") is not None and cache.bytes == 100


def encoded_items() -> int:
    return (
        serve.get_deployment_handle("EncoderReplica", app_name="encoder").describe.remote().result()["stats"]["items"]
    )


TENANT = {"Authorization": "Bearer tenant-a"}


def test_a_scope_is_one_tenant_and_salt_and_none_without_either():
    assert cache_scope("tenant", None, None) is None  # nobody to share with: no cache
    scopes = {cache_scope("tenant", t, s) for t in ("http:a", "http:b", "handle") for s in (None, "x", "y")}
    assert len(scopes) == 9 and None not in scopes
    assert cache_scope("tenant", "http:a", "x") == cache_scope("tenant", "http:a", "x")
    assert cache_scope("tenant", None, "x") not in scopes  # a salt alone: those who know it share
    assert (
        cache_scope("shared", "http:a", None)
        == cache_scope("shared", None, None)
        == cache_scope("shared", "handle", None)
    )
    assert cache_scope("shared", "http:a", "x") != cache_scope("shared", "http:a", None)


def test_a_cache_hit_returns_identical_embeddings_without_encoding(serve_harness):
    url = serve_harness.deploy("configs/local.yaml")
    body = {"items": [{"type": "image", "image": b64(image_file(pattern(140, 90, seed=77), "PNG"))}]}
    with serve_harness.http(headers=TENANT) as client:
        first = client.post(url + "/v1/encode", json=body).json()["data"][0]
        before = encoded_items()
        second = client.post(url + "/v1/encode", json=body).json()["data"][0]
        assert encoded_items() == before  # answered from the cache
        third = client.post(url + "/v1/encode", json={**body, "cache": False}).json()["data"][0]
        assert encoded_items() == before + 1  # opted out: encoded again
    assert second == first
    assert torch.equal(decode_embedding(third), decode_embedding(first))


def test_20_concurrent_identical_requests_cause_one_encode(serve_harness):
    url = serve_harness.deploy("configs/local.yaml")
    body = {"items": [{"type": "image", "image": b64(image_file(pattern(300, 200, seed=78), "PNG"))}]}
    before = encoded_items()
    with serve_harness.http(headers=TENANT) as client, ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(lambda _: client.post(url + "/v1/encode", json=body), range(20)))
        cache = model_detail(url)["router"]["cache"]
    assert all(r.status_code == 200 for r in replies)
    assert len({r.json()["data"][0]["embedding"] for r in replies}) == 1
    assert encoded_items() == before + 1
    assert cache["inflight_dedup"] + cache["hits"] >= 19


def test_no_caller_sees_a_hit_on_another_tenants_entry(serve_harness):
    """Another tenant's request for the same image is encoded again: its timing (`forward`), the
    replica's work and the operators' hit counter all say so, as for a first request; a request
    that names no tenant never hits, and the public model detail carries no counter at all."""
    url = serve_harness.deploy("configs/local.yaml")
    body = {"items": [{"type": "image", "image": b64(image_file(pattern(150, 90, seed=79), "PNG"))}]}

    def forward_ms(reply) -> float:
        return float(reply.headers["server-timing"].split("forward;dur=")[1].split(",")[0])

    with serve_harness.http() as client:
        first = client.post(url + "/v1/encode", json=body, headers=TENANT)
        hits = model_detail(url)["router"]["cache"]["hits"]
        before = encoded_items()
        other = client.post(url + "/v1/encode", json=body, headers={"Authorization": "Bearer tenant-b"})
        anonymous = [client.post(url + "/v1/encode", json=body) for _ in range(2)]
        salted = client.post(url + "/v1/encode", json={**body, "cache_salt": "s"}, headers=TENANT)
        assert encoded_items() == before + 4 and model_detail(url)["router"]["cache"]["hits"] == hits
        assert all(forward_ms(r) > 0 for r in [other, *anonymous, salted])
        again = client.post(url + "/v1/encode", json=body, headers=TENANT)  # the first tenant: a hit
        assert encoded_items() == before + 4 and forward_ms(again) == 0
        model_id = first.json()["model"]
        public = client.get(f"{url}/v1/models/{model_id}").json()["encoder"]
    assert "router" not in public and "replica_work" not in public and "cache" not in str(public)
    assert all(r.status_code == 200 for r in [first, other, *anonymous, salted, again])
    assert again.json() == first.json() and other.json()["data"][0]["embedding"] == first.json()["data"][0]["embedding"]


def test_a_finished_items_waiters_never_touch_a_newer_future_of_the_same_content():
    """Request A's X finished; B re-encodes X (new future); A leaving must not let C's wait be cancelled."""
    import asyncio

    from deployments.router.cache import InflightTable

    async def main():
        loop = asyncio.get_running_loop()
        table = InflightTable()
        first = loop.create_future()
        table.start(b"x", first)  # request A
        first.set_result("done")
        await asyncio.sleep(0)  # A's future finishes and is forgotten
        second = loop.create_future()
        assert table.join(b"x") is None
        table.start(b"x", second)  # request B
        assert table.leave(b"x", first)  # A leaves: its finished future, not B's
        assert table.join(b"x") is second  # request C joins B's future
        assert not table.leave(b"x", second)  # B leaves: C still waits, so it must not be cancelled
        assert table.leave(b"x", second)  # C leaves: nobody waits any more

    asyncio.run(main())


def test_an_item_that_just_finished_is_shared_before_its_callbacks_run():
    """Between set_result and its done-callbacks (forget, cache put) a request must still find the result.

    This one-loop-turn window let 20 concurrent identical requests encode twice in CI."""
    import asyncio

    from deployments.router.cache import InflightTable

    async def main():
        loop = asyncio.get_running_loop()
        table = InflightTable()
        done, failed = loop.create_future(), loop.create_future()
        table.start(b"ok", done)
        table.start(b"bad", failed)
        done.set_result("embedding")
        failed.set_exception(RuntimeError("replica died"))
        assert table.join(b"ok") is done  # callbacks not yet run: still shared
        assert table.join(b"bad") is None  # a failure is not shared: the next request encodes again
        assert not table.leave(b"ok", done) and table.leave(b"ok", done)  # joiner, then starter leave
        await asyncio.sleep(0)
        assert table.join(b"ok") is None  # forgotten once the callbacks ran (the cache has it by then)

    asyncio.run(main())
