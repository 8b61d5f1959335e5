"""Chat requests that used to hold the LLM or answer 500: each is refused up front with a 4xx in the
documented shape, a timed-out generation is stopped, and a stream that fails ends properly. A prompt
over the LLM's limit is refused by the router from its images' inspected token counts, before any
is decoded or encoded and before a stream begins; its error names the image part where it passes."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from types import SimpleNamespace

import pytest
from PIL import Image
from ray import serve

from tests.deployments.media_helpers import pattern
from tests.helpers import model_detail

LIMITS = {"router": {"max_wait_ms": 10, "request_timeout_s": 0.5}, "llm": {"max_prompt_tokens": 64, "max_tokens": 4000}}
MAX_PROMPT_TOKENS = 300
PROMPT_LIMITS = {
    "router": {"max_wait_ms": 10, "decode_workers": 1},
    "llm": {"max_prompt_tokens": MAX_PROMPT_TOKENS},
    "limits": {"max_items_per_request": 12, "max_tokens_per_request": 4000},
}
"""The second app's: room for a few images in the prompt, and the default request timeout (the
first app's 0.5 s is for the timed-out generation)."""
LONG_TOKENS = 4000
"""Seconds of generation for the tiny LLM on CPU (512 tokens can finish inside the 0.5 s timeout)."""


@pytest.fixture(scope="module")
def url(serve_harness) -> str:
    return serve_harness.deploy("configs/epd.yaml", name="chat-limits", route_prefix="/chat-limits", **LIMITS)


@pytest.fixture(scope="module")
def prompt_url(serve_harness) -> str:
    return serve_harness.deploy("configs/epd.yaml", name="chat-prompt", route_prefix="/chat-prompt", **PROMPT_LIMITS)


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


# ---- the prompt's length, checked in the router before any image is decoded ----


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def flat_png_url(side: int, shade: int) -> str:
    """A one-colour square PNG: a few kB, `(side / 32)^2` vision tokens for the tiny Qwen3-VL."""
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (shade, 90, 160)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def words(count: int) -> str:
    """`count` text tokens after the first of "Say:" (one token per " word" in the tiny tokenizer)."""
    return "Say:" + " word" * count


def stream_events(client, url: str, body: dict) -> tuple[int, list[str]]:
    with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as response:
        response.read()
        lines = response.text.splitlines()
    return response.status_code, [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def decode_jobs(client, url: str) -> tuple[int, int]:
    """(decode-pool jobs completed, embedding-cache misses) of the app's router."""
    router = model_detail(url)["router"]
    return router["decode_pool"]["completed"], router["cache"]["misses"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_images_over_the_prompt_limit_are_inspected_and_never_decoded_or_encoded(stream, prompt_url, serve_harness):
    """Three 1024x1024 images: 3,072 vision tokens, over the prompt's 300 (the issue's nine at the
    default 8,192 were all encoded before the LLM refused them). A stream never begins."""
    body = {"messages": user(text("Compare."), *[image(flat_png_url(1024, 40 * n)) for n in range(3)])}
    with serve_harness.http(timeout=30) as client:
        before = decode_jobs(client, prompt_url)
        if stream:
            status, events = stream_events(client, prompt_url, body)
            assert status == 413 and len(events) == 0, (status, events[:2])
        else:
            assert_error(post(client, prompt_url, body), 413, "messages[0].content[1]", "max_prompt_tokens=300")
        after = decode_jobs(client, prompt_url)
    assert after[0] - before[0] == 3  # their inspections only
    assert after[1] == before[1]  # nothing reached the encoders


def test_a_streamed_chat_over_the_text_limit_is_refused_before_the_stream(prompt_url, serve_harness):
    with serve_harness.http(timeout=30) as client:
        status, events = stream_events(client, prompt_url, {"messages": user(text(words(400))), "max_tokens": 4})
    assert status == 413 and not events


def test_chat_limit_errors_name_the_image_part_that_passes_the_limit(prompt_url, serve_harness):
    system = {"role": "system", "content": "Be brief."}
    thirteen = user(text("Count."), *[image(png_url(seed=n)) for n in range(13)])
    four_large = user(text("Compare."), *[image(flat_png_url(1024, 50 * n)) for n in range(4)])
    with serve_harness.http(timeout=30) as client:
        assert_error(
            post(client, prompt_url, {"messages": [system, *thirteen]}),
            413,
            "messages[1].content[13]",
            "13 images",
            "max_items_per_request=12",
        )
        assert_error(  # 4 x 1,024 vision tokens: the fourth passes 4,000
            post(client, prompt_url, {"messages": [system, *four_large]}),
            413,
            "messages[1].content[4]",
            "4096 vision tokens",
            "max_tokens_per_request=4000",
        )


def test_the_image_named_is_the_first_that_does_not_fit(prompt_url, serve_harness):
    """64x48 images of 70 vision tokens each: the prompt passes 300 at one of them; without it and
    those after it, the LLM takes the prompt."""
    parts = [text("Count."), *[image(png_url(seed=n)) for n in range(6)]]
    with serve_harness.http(timeout=30) as client:
        refused = post(client, prompt_url, {"messages": user(*parts), "max_tokens": 1})
        assert refused.status_code == 413, refused.text[:300]
        place = refused.json()["error"]["param"]
        assert place.startswith("messages[0].content[") and "max_prompt_tokens=300" in refused.text
        first_over = int(place.removeprefix("messages[0].content[").removesuffix("]"))
        assert first_over >= 3  # some images fit
        fits = post(client, prompt_url, {"messages": user(*parts[:first_over]), "max_tokens": 1})
    assert fits.status_code == 200, fits.text[:300]
    assert fits.json()["usage"]["prompt_tokens"] <= MAX_PROMPT_TOKENS


def served_prompt_tokens(client, url: str, parts: list[dict]) -> int:
    response = post(client, url, {"messages": user(*parts), "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text[:300]
    return response.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "text and an image"])
def test_the_router_counts_the_prompt_as_the_llm_does(with_image, prompt_url, serve_harness):
    """The longest prompt the LLM counts within the limit streams; one token more is refused before
    the stream, by the router (the LLM's own count, from its usage, is the reference)."""
    images = [image(png_url(seed=3))] if with_image else []
    with serve_harness.http(timeout=30) as client:
        one, two = (served_prompt_tokens(client, prompt_url, [text(words(n)), *images]) for n in (1, 2))
        per_word, base = two - one, one - (two - one)
        longest = (MAX_PROMPT_TOKENS - base) // per_word
        body = {"messages": user(text(words(longest)), *images), "max_tokens": 1}
        status, events = stream_events(client, prompt_url, {**body, "stream_options": {"include_usage": True}})
        assert status == 200 and events[-1] == "[DONE]", events[-2:]
        usage = json.loads(events[-2])["usage"]
        assert usage["prompt_tokens"] == base + per_word * longest
        assert usage["prompt_tokens"] <= MAX_PROMPT_TOKENS < usage["prompt_tokens"] + per_word
        over = {"messages": user(text(words(longest + 1)), *images), "max_tokens": 1}
        status, events = stream_events(client, prompt_url, over)
        assert status == 413 and not events
        assert_error(post(client, prompt_url, over), 413, "messages[0].content[1]" if with_image else "messages")


def test_a_stream_the_llm_refuses_ends_with_an_error_event_and_done(url):
    """The LLM's own prompt check, reached by a request built past the router's (which refuses such
    a prompt before streaming): the stream ends with the error and `[DONE]`."""
    from deployments.config import AppConfig
    from deployments.llm.transformers_engine import GenerateRequest
    from deployments.router import chat

    config = AppConfig.model_validate({"llm": LIMITS["llm"]})  # the app's LLM: 64 prompt tokens
    service = SimpleNamespace(config=config, llm=serve.get_deployment_handle("LLMReplica", app_name="chat-limits"))
    request = GenerateRequest(messages=[{"role": "user", "content": words(400)}], embeddings=[], grids=[])

    async def events() -> list[str]:
        return [event async for event in chat._stream(service, request, include_usage=False)]

    sent = [event.removeprefix("data: ").strip() for event in asyncio.run(events())]
    assert sent[-1] == "[DONE]"
    error = json.loads(sent[-2])["error"]
    assert "max_prompt_tokens=64" in error["message"] and error["type"] == "invalid_request_error"
