"""`/health` tells the truth from the router's first moment: 503 naming what is missing while the
router sets itself up or a part of the application cannot serve (no encoder replica; in E/PD the LLM
deployment starting, failing or unschedulable), 200 once every part can; chat names the LLM."""

from __future__ import annotations

import glob
import os
import time

import httpx
import pytest

from deployments.router.ingress import STARTING
from models.tiny_checkpoint import save_tiny_vlm
from tests.deployments.media_helpers import pattern
from tests.deployments.test_epd import openai_messages

ANSWER_WITHIN_S = 1.0
"""The acceptance bound: every `/health` answer from the router's first one on."""


def is_ours(response: httpx.Response) -> bool:
    """An answer of the router's `/health` (not Serve's proxy, which answers 404 before the route exists)."""
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and ("missing" in body or body.get("status") == "ok")


def every_router_shows_the_replicas_warm_up(client: httpx.Client, url: str, answers: int = 12) -> list[int]:
    """Warm-up entries in `answers` consecutive `/v1/models/{id}` answers (Serve's proxy spreads them
    over the routers; one still setting up answers without the encoder's part), polled until each
    has one or 30 s pass."""
    model_id = client.get(url + "/v1/models").json()["data"][0]["id"]
    deadline = time.monotonic() + 30
    while True:
        bodies = [client.get(f"{url}/v1/models/{model_id}", timeout=10).json() for _ in range(answers)]
        counts = [len(body.get("encoder", {}).get("replica_warmup", {})) for body in bodies]
        if min(counts) > 0 or time.monotonic() > deadline:
            return counts
        time.sleep(1)


def test_health_is_503_at_once_while_the_router_starts_then_200(serve_harness):
    """Polled with a 1 s timeout from the deploy on: the router's first answer is 503 naming its own
    setup (its constructor returns before the decode pool and torch come up), every later answer
    comes within a second, 503 with the missing parts until the application can serve, then 200.
    Then, before any request was encoded, every router's `/v1/models/{id}` shows the replica's
    warm-up (a router that had served nothing once showed none, so readiness probes on it hung)."""
    url = serve_harness.deploy(
        "configs/local.yaml",
        name="health-startup",
        route_prefix="/health-startup",
        wait=False,
        deployments={"EncoderRouter": {"num_replicas": 2}},
        router={"decode_workers": 1},
    )
    answers: list[tuple[int, dict]] = []
    warm_ups: list[int] = []
    deadline = time.monotonic() + serve_harness.deploy_timeout_s
    try:
        with httpx.Client() as client:
            while time.monotonic() < deadline:
                start = time.perf_counter()
                try:
                    response = client.get(url + "/health", timeout=5 if not answers else ANSWER_WITHIN_S)
                except httpx.TimeoutException:
                    # before the router's first answer, Serve's proxy holds requests while the router's
                    # replica process starts; after it, a timeout is the failure this test is about
                    assert not answers, f"/health did not answer within {ANSWER_WITHIN_S} s after {answers[-1]}"
                    continue
                took = time.perf_counter() - start
                if is_ours(response):
                    assert took < ANSWER_WITHIN_S or not answers, (took, response.text)
                    answers.append((response.status_code, response.json()))
                    if response.status_code == 200:
                        break
                else:
                    assert not answers, (
                        f"the proxy answered after the router did: {response.status_code} {response.text}"
                    )
                time.sleep(0.1)
            warm_ups = every_router_shows_the_replicas_warm_up(client, url)
    finally:
        serve_harness.remove("health-startup")
    assert answers and answers[-1][0] == 200, answers[-3:]
    first_status, first = answers[0]
    assert first_status == 503 and STARTING in first["missing"], first
    assert first["error"]["type"] == "overloaded_error" and STARTING in first["error"]["message"]
    assert all(status == 503 and body["missing"] for status, body in answers[:-1])
    assert answers[-1][1]["encoder_replicas"] >= 1
    assert min(warm_ups) == 1, warm_ups


@pytest.fixture(scope="module")
def llm_without_weights(tmp_path_factory):
    """A tiny Qwen3-VL checkpoint whose config and tokenizer are fine (the build accepts it) but
    whose weights are gone: the LLM replica's constructor fails, every time."""
    directory = tmp_path_factory.mktemp("llm-no-weights")
    save_tiny_vlm("qwen3-vl", directory)
    for weights in glob.glob(str(directory / "*.safetensors")):
        os.remove(weights)
    return str(directory)


def test_epd_health_and_chat_name_the_failing_llm(serve_harness, llm_without_weights):
    """E/PD whose LLM cannot start: the encoders serve, yet `/health` is 503 naming the LLM deployment
    and its error, and a chat request gets 503 naming it at once instead of a 504 after 120 s."""
    url = serve_harness.deploy(
        "configs/epd.yaml",
        name="epd-broken-llm",
        route_prefix="/epd-broken-llm",
        wait=False,
        llm={"path": llm_without_weights},
    )
    deadline = time.monotonic() + serve_harness.deploy_timeout_s
    health = None
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            try:
                health = client.get(url + "/health")
            except httpx.HTTPError:
                time.sleep(0.5)
                continue
            missing = health.json().get("missing", []) if is_ours(health) else []
            # wait for the router and an encoder replica, and for Serve to report the LLM's failure
            if missing and all("LLMReplica" in reason and "Error" in reason for reason in missing):
                break
            time.sleep(0.5)
        assert health is not None and health.status_code == 503, health and health.text
        (reason,) = health.json()["missing"]
        assert reason.startswith("LLM deployment 'LLMReplica' is not running"), reason
        assert "Traceback" not in reason and "\n" not in reason, reason
        assert "Retry-After" in health.headers

        start = time.perf_counter()
        body = {"messages": openai_messages([pattern(64, 48)]), "max_tokens": 4}
        chat = client.post(url + "/v1/chat/completions", json=body)
        took = time.perf_counter() - start
    assert chat.status_code == 503, chat.text
    assert "LLM deployment 'LLMReplica' is not running" in chat.json()["error"]["message"]
    assert took < 5, took  # refused before any image is encoded, not after request_timeout_s
