"""How many values a JSON body holds, counted on its bytes before anything parses it.

A parser's tree, and pydantic's errors about it, grow with the number of values, not with the
body's size: two bytes of `0,` become a Python int, a list slot and, when refused, an error of
a kilobyte. A body is therefore refused for the values it holds before any parser sees it. The
count stops at the limit, and strings are skipped with `bytes.find` (a request's bulk is base64
strings), so counting costs a few milliseconds for any body the size limit admits.
"""

from __future__ import annotations

import re
from typing import Any

import pydantic_core

_STRUCTURAL = re.compile(rb"[,:\[{]")
"""Outside strings, every value and key but the outermost value follows one of these."""
_BACKSLASH_OR_X = bytes(0x5C if byte == 0x5C else 0x58 for byte in range(256))
"""A `bytes.translate` table: backslashes stay, every other byte becomes X."""
SHORT = 256
"""Stretches between strings up to this long are counted with one regex call, longer ones with `count`."""


def values_past(body: bytes, limit: int) -> int | None:
    """Where `body` (JSON) passes `limit` values: the offset of the first past it, or None if it
    holds at most `limit`. Counted are the `,`, `:`, `[` and `{` outside strings, one before every
    value and key (and one per empty container): an upper bound of the parsed tree's size; and each
    escaped quote in a string, each of which costs this count a step. A body that is not JSON may
    be counted short (an unterminated string ends the count); the parser then refuses it."""
    count, position, end = 0, 0, len(body)
    while position < end:
        quote = body.find(b'"', position)
        stop = end if quote < 0 else quote
        if stop - position <= SHORT:
            found = len(_STRUCTURAL.findall(body, position, stop))
        else:
            found = body.count(b",", position, stop) + body.count(b":", position, stop)
            found += body.count(b"[", position, stop) + body.count(b"{", position, stop)
        if count + found > limit:
            for match in _STRUCTURAL.finditer(body, position, stop):
                count += 1
                if count > limit:
                    return match.start()
        count += found
        if quote < 0:
            return None
        start = position = quote + 1
        while True:  # to the string's closing quote
            close = body.find(b'"', position)
            if close < 0:
                return None
            if body[close - 1] != 0x5C or _backslashes_before(body, start, close) % 2 == 0:
                break
            count += 1
            if count > limit:
                return close
            position = close + 1
        position = close + 1
    return None


def _backslashes_before(body: bytes, start: int, end: int) -> int:
    """How many backslashes end `body[start:end]`, read in C: the run is bracketed by comparing
    windows growing fourfold, then its start is the last other byte of the last window."""
    size = 16
    while end - size > start and body.endswith(b"\\" * size, start, end):
        size *= 4
    window = body[max(start, end - size) : end]
    last_other = window.translate(_BACKSLASH_OR_X).rfind(b"X")
    return len(window) - 1 - last_other


def largest_container(prefix: bytes) -> tuple[tuple[str | int, ...], int] | None:
    """The list or object with the most entries in the JSON document `prefix` begins, as (its
    path, its entries so far); None if it has none. Raises ValueError where `prefix` is not the
    beginning of a JSON document (or nests too deep)."""
    root = pydantic_core.from_json(prefix, allow_partial=True)
    best: tuple[tuple[str | int, ...], int] | None = None
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), root)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            children = value.items()
        elif isinstance(value, list):
            children = enumerate(value)
        else:
            continue
        if best is None or len(value) > best[1]:
            best = (path, len(value))
        stack.extend((path + (key,), child) for key, child in children)
    return best


def json_path(path: tuple[str | int, ...]) -> str:
    """`items[0].frames` for ("items", 0, "frames")."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text
