"""Counting a JSON body's values on its bytes: exact against a reading character by character,
escapes included, and where the count passes its limit, the body's largest list named."""

from __future__ import annotations

import json
import random

import pytest

from deployments.config import AppConfig, Limits, LLMSettings
from deployments.router.http import MIN_JSON_VALUES, json_value_limit, too_many_values
from deployments.router.json_values import json_path, largest_container, values_past


def reference_count(body: bytes) -> int:
    """The `,`, `:`, `[` and `{` outside strings and the escaped quotes inside them, read one
    character at a time."""
    count, inside, escaped = 0, False, False
    for char in body.decode():
        if inside:
            if escaped:
                escaped = False
                count += char == '"'
            elif char == "\\":
                escaped = True
            elif char == '"':
                inside = False
        elif char == '"':
            inside = True
        elif char in ",:[{":
            count += 1
    return count


ODD_VALUES = [1, -2.5e-3, None, True, "", "x,y:[{", 'a "quote"', "\\", '\\"', "\\\\\\", "é€", "\n\t"]
ODD_VALUES += [{"b": [1, {}]}, [], {}]


def test_the_count_is_exact_on_random_documents():
    rng = random.Random(7)
    for _ in range(3000):
        doc = {"a": [rng.choice(ODD_VALUES) for _ in range(rng.randint(0, 30))], "k,:": rng.choice(ODD_VALUES)}
        body = json.dumps(doc, ensure_ascii=rng.random() < 0.5, separators=rng.choice([None, (",", ":")])).encode()
        count = reference_count(body)
        assert values_past(body, count) is None, body
        past = values_past(body, count - 1)
        assert past is not None and reference_count(body[:past]) == count - 1, body


def test_the_offset_is_where_the_first_value_past_the_limit_begins():
    body = b'{"frames": [' + b",".join([b'"x"'] * 10) + b"]}"
    past = values_past(body, 5)
    assert body[past : past + 1] == b"," and reference_count(body[:past]) == 5


@pytest.mark.parametrize(
    "text",
    [
        b"QUJD" * 1_000_000,  # base64: skipped whole
        b"\\\\" * 100_000,  # a long run of escaped backslashes, then the real end
        b"a\\\\\\\\\\\\" * 1000 + b"\\\\",  # runs of every parity before quotes
    ],
    ids=["base64", "backslashes", "runs"],
)
def test_strings_are_skipped_whole(text):
    body = b'{"text": "' + text + b'", "b": 1}'
    assert json.loads(body)["b"] == 1
    assert values_past(body, 4) is None and values_past(body, 3) == body.rindex(b":")


def test_escaped_quotes_count():
    body = b'{"text": "' + b'\\"' * 100 + b'"}'
    assert values_past(body, 102) is None and values_past(body, 101) is not None  # and its `{` and `:`


def test_a_body_that_is_not_json_is_left_to_the_parser():
    assert values_past(b'{"a": "never closed, [, {', 2) is None  # the parser refuses it
    assert values_past(b"[1, 2, 3" + b"," * 100, 10) is not None


def test_the_largest_list_of_a_cut_body_is_named():
    body = b'{"items": [{"type": "video", "frames": [' + b",".join([b"0"] * 1000) + b"]}]}"
    past = values_past(body, 500)
    assert largest_container(body[:past]) == (("items", 0, "frames"), 493)  # 8 tokens before the frames
    assert json_path(("messages", 3, "content", 0, "text")) == "messages[3].content[0].text"


def test_the_refusal_names_the_largest_list_or_says_the_body_is_not_json():
    body = b'{"items": [{"type": "video", "frames": [' + b",".join([b"0"] * 1000) + b"]}]}"
    error = too_many_values(body[: values_past(body, 500)], 500)
    assert error.status == 413 and error.param == "items[0]"
    assert error.message.startswith("items[0].frames: more than 493 entries") and "500 JSON values" in error.message
    spread = json.dumps({"items": [{"type": "video", "frames": ["x"] * 10}] * 100}).encode()
    error = too_many_values(spread[: values_past(spread, 500)], 500)  # no list holds most of them
    assert error.status == 413 and error.param is None and "500 JSON values" in error.message
    deep = b"[" * 100_000
    error = too_many_values(deep[: values_past(deep, 1000)], 1000)
    assert error.status == 400 and "not valid JSON" in error.message


def test_the_limit_leaves_room_for_the_largest_request_the_limits_allow():
    assert json_value_limit(AppConfig()) == MIN_JSON_VALUES
    large = AppConfig(limits=Limits(max_items_per_request=256, max_video_frames=1024))
    assert json_value_limit(large) == 256 * 1032 + 64
    chat = AppConfig(llm=LLMSettings(max_prompt_tokens=100_000))
    assert json_value_limit(chat) == 400_000
    most = {"items": [{"type": "video", "frames": ["x"] * 1024}] * 256, "model": "m", "cache": True}
    assert values_past(json.dumps(most).encode(), json_value_limit(large)) is None
