"""Operating the service: configs that cannot work fail once and clearly, health tells the truth,
logs stay quiet under load."""

from __future__ import annotations

import glob
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from ray import serve

from models.tiny_checkpoint import save_tiny_vlm
from tests.deployments.media_helpers import b64, image_file, pattern

FAIL_WITHIN_S = 30.0


def failed_message(name: str, timeout_s: float = FAIL_WITHIN_S) -> tuple[str, float]:
    """The application's DEPLOY_FAILED message and how long it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        app = serve.status().applications.get(name)
        if app is not None and app.status == "DEPLOY_FAILED":
            return app.message, time.monotonic() - start
        time.sleep(0.25)
    raise AssertionError(f"{name} did not fail within {timeout_s} s: {serve.status().applications.get(name)}")


@pytest.mark.parametrize(
    "name,overrides,expected",
    [
        ("misspelled-key", {"modle": {"preset": "tiny"}}, ["unknown key `modle`", "did you mean `model`?"]),
        ("unknown-preset", {"model": {"preset": "qwen3-vl-9000b"}}, ["unknown preset 'qwen3-vl-9000b'", "use one of"]),
        (
            "missing-path",
            {"model": {"path": "/no/such/checkpoint"}},
            ["`model.path`", "/no/such/checkpoint", "does not exist"],
        ),
        ("cuda-without-gpu", {"model": {"device": "cuda"}}, ["`model.device` is 'cuda'", "no node", "device: cpu"]),
    ],
)
def test_a_config_that_cannot_work_fails_once_with_one_clear_message(name, overrides, expected, serve_harness):
    if name == "cuda-without-gpu" and ray.cluster_resources().get("GPU", 0):
        pytest.skip("this cluster has a GPU")
    serve_harness.deploy(
        "configs/local.yaml", name=f"broken-{name}", route_prefix=f"/broken-{name}", wait=False, **overrides
    )
    try:
        message, took = failed_message(f"broken-{name}")
    finally:
        serve_harness.remove(f"broken-{name}")
    assert took < FAIL_WITHIN_S
    assert "Traceback" not in message and len(message.splitlines()) <= 2, message
    for part in expected:
        assert part in message, message


def test_health_is_503_and_requests_fail_fast_while_no_encoder_replica_can_start(serve_harness, tmp_path):
    """A checkpoint whose config is fine but whose weights are gone passes the build; its encoder
    replica never starts. The router is up: /health says 503 with the reason, and an encode request
    gets 503 at once instead of waiting for a replica."""
    checkpoint = tmp_path / "no-weights"
    save_tiny_vlm("qwen3-vl", checkpoint)
    for weights in glob.glob(str(checkpoint / "*.safetensors")):
        os.remove(weights)
    url = serve_harness.deploy(
        "configs/local.yaml",
        name="no-encoder",
        route_prefix="/no-encoder",
        wait=False,
        model={"path": str(checkpoint), "preset": None},
    )
    try:
        with serve_harness.http(timeout=30) as client:
            health = wait_for_router(client, url + "/health")
            assert health.status_code == 503, health.text
            assert health.headers["Retry-After"] and "no encoder replica is ready" in health.json()["error"]["message"]
            item = {"type": "image", "image": b64(image_file(pattern(32, 32), "PNG"))}
            start = time.perf_counter()
            response = client.post(url + "/v1/encode", json={"items": [item]})
            assert response.status_code == 503 and "Retry-After" in response.headers, response.text
            assert time.perf_counter() - start < 5
    finally:
        serve_harness.remove("no-encoder")


def wait_for_router(client, url: str, timeout_s: float = 120):
    """The first answer from the router (it starts while the encoder keeps failing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            response = client.get(url, timeout=5)
            if response.status_code != 404:  # 404: the proxy has no route yet
                return response
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    raise AssertionError(f"no answer from {url} within {timeout_s} s")


def serve_log_sizes() -> dict[str, int]:
    logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    return {f: os.path.getsize(f) for f in glob.glob(os.path.join(logs, "serve", "*.log"))}


def serve_logs_since(sizes: dict[str, int]) -> str:
    """What the proxy, the routers and the replicas logged since `sizes` was taken."""
    text = []
    for path in serve_log_sizes():
        with open(path, errors="replace") as log:
            log.seek(sizes.get(path, 0))
            text.append(log.read())
    return "".join(text)


def test_64_concurrent_requests_log_no_routing_retries_and_no_access_lines(serve_harness):
    url = serve_harness.deploy("configs/local.yaml")
    bodies = [
        {"items": [{"type": "image", "image": b64(image_file(pattern(96 + n, 64, seed=n), "PNG"))}]} for n in range(128)
    ]
    sizes = serve_log_sizes()
    with serve_harness.http() as client, ThreadPoolExecutor(64) as pool:
        statuses = list(pool.map(lambda body: client.post(url + "/v1/encode", json=body).status_code, bodies))
    assert statuses == [200] * len(bodies)
    time.sleep(1.0)  # let the log files flush
    logs = serve_logs_since(sizes)
    assert "Failed to route request" not in logs
    assert "POST /v1/encode" not in logs  # per-request access lines are opt-in (router.log_requests)


def test_health_answers_at_once_while_32_clients_poll_the_model_detail(serve_harness):
    """`/v1/models/{id}` costs the router's event loop next to nothing (no replica call, no memory
    scan): `/health` stays under a second while 32 clients poll it as fast as they can."""
    import threading

    import httpx

    url = serve_harness.deploy("configs/local.yaml")
    with serve_harness.http() as client:
        model_id = client.get(url + "/v1/models").json()["data"][0]["id"]
    stop, polled = threading.Event(), []

    def poll() -> None:
        with httpx.Client(timeout=30) as poller:
            while not stop.is_set():
                polled.append(poller.get(f"{url}/v1/models/{model_id}").status_code)

    threads = [threading.Thread(target=poll) for _ in range(32)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(2)
        waits = []
        with serve_harness.http() as client:
            for _ in range(10):
                start = time.perf_counter()
                assert client.get(url + "/health").status_code == 200
                waits.append(time.perf_counter() - start)
                time.sleep(0.2)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert len(polled) > 100 and set(polled) == {200}
    assert max(waits) < 1.0, waits


def test_the_operators_detail_is_computed_once_for_every_poller_at_a_time():
    """With `router.expose_detail`, pollers arriving together share one computation of `detail()`,
    and later ones reuse it for `DETAIL_TTL_S`."""
    import asyncio

    from deployments.router.ingress import DETAIL_TTL_S, EncoderRouter

    router = object.__new__(EncoderRouter)
    router._detail, router._detail_task = None, None
    computed = []

    async def detail() -> dict:
        computed.append(len(computed))
        await asyncio.sleep(0.05)
        return {"encoder": {"n": len(computed)}}

    router.detail = detail

    async def main():
        together = await asyncio.gather(*(router._detail_snapshot() for _ in range(32)))
        again = await router._detail_snapshot()
        router._detail = (time.monotonic() - DETAIL_TTL_S, router._detail[1])  # expired
        later = await router._detail_snapshot()
        return together, again, later

    together, again, later = asyncio.run(main())
    assert all(d == {"encoder": {"n": 1}} for d in together) and again == together[0]
    assert later == {"encoder": {"n": 2}} and len(computed) == 2
