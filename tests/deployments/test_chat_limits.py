"""Chat requests that used to hold the LLM or answer 500: each is refused up front with a 4xx in the
documented shape, a timed-out generation is stopped, and a stream that fails ends properly."""

from __future__ import annotations

import base64
import io
import json
import time

import pytest
from ray import serve

from tests.deployments.media_helpers import pattern

LIMITS = {"router": {"max_wait_ms": 10, "request_timeout_s": 0.5}, "llm": {"max_prompt_tokens": 64, "max_tokens": 4000}}
LONG_TOKENS = 4000
"""Seconds of generation for the tiny LLM on CPU (512 tokens can finish inside the 0.5 s timeout)."""


@pytest.fixture(scope="module")
def url(serve_harness) -> str:
    return serve_harness.deploy("configs/epd.yaml", name="chat-limits", route_prefix="/chat-limits", **LIMITS)


def png_url(seed: int = 0) -> str:
    buffer = io.BytesIO()
    pattern(64, 48, seed=seed).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def post(client, url: str, body: dict):
    return client.post(url + "/v1/chat/completions", json=body)


def assert_error(response, status: int, param: str | None, *message: str) -> None:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param, error
    for part in message:
        assert part in error["message"], error


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def text(value: str) -> dict:
    return {"type": "text", "text": value}


@pytest.mark.parametrize(
    "body,status,param,message",
    [
        ({"messages": user(text("see <|image_"), text("pad|> here"))}, 400, "messages[0]", "<|image_pad|>"),
        (
            {
                "messages": user(
                    text("<|vision_"), {"type": "image_url", "image_url": {"url": png_url()}}, text("start|>")
                )
            },
            400,
            "messages[0]",
            "<|vision_start|>",
        ),
        ({"messages": user(text("hi")), "seed": 2**70}, 400, "seed", "seed"),
        ({"messages": user(text("hi")), "seed": -(2**70), "stream": True}, 400, "seed", "seed"),
        ({"messages": user(text("hi")), "model": "gpt-4o"}, 404, "model", "gpt-4o"),
        ({"messages": user(text("x" * 1_000_000))}, 413, "messages", "max_prompt_tokens=64"),
        (
            {"messages": user(text("hi"), {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}})},
            400,
            "messages[0].content[1]",
            "base64",
        ),
    ],
    ids=[
        "split placeholder",
        "placeholder around an image",
        "seed 2^70",
        "seed -2^70 streamed",
        "unknown model",
        "1 MB prompt",
        "bad data URL",
    ],
)
def test_bad_chat_requests_are_refused_at_once(body, status, param, message, url, serve_harness):
    with serve_harness.http(timeout=30) as client:
        start = time.perf_counter()
        assert_error(post(client, url, body), status, param, message)
        assert time.perf_counter() - start < 5


def test_a_timed_out_generation_is_stopped_and_the_next_chat_is_served(url, serve_harness):
    llm = serve.get_deployment_handle("LLMReplica", app_name="chat-limits")
    before = llm.describe.remote().result()["cancelled_generations"]
    with serve_harness.http(timeout=30) as client:
        long = post(client, url, {"messages": user(text("Tell a story.")), "max_tokens": LONG_TOKENS, "temperature": 0})
        assert_error(long, 504, None, "request_timeout_s=0.5")
        start = time.perf_counter()
        short = post(client, url, {"messages": user(text("Hi.")), "max_tokens": 2, "temperature": 0})
        assert short.status_code == 200, short.text[:300]
        assert time.perf_counter() - start < 2  # the LLM takes one request at a time: the long one stopped
    deadline = time.monotonic() + 10
    while llm.describe.remote().result()["cancelled_generations"] == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert llm.describe.remote().result()["cancelled_generations"] > before


def test_a_stream_that_fails_ends_with_an_error_event_and_done(url, serve_harness):
    """Under the router's character bound but over the LLM's exact token limit: the stream has
    begun when the LLM refuses it."""
    body = {"messages": user(text("word " * 200)), "max_tokens": 4, "stream": True}
    with serve_harness.http(timeout=30) as client:
        with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "max_prompt_tokens=64" in error["message"] and error["type"] == "invalid_request_error"
