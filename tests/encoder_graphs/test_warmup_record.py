"""The warm-up record's file: written and read back, signed, and refused where it is not ours or does
not fit."""

from __future__ import annotations

import json
import logging
import math

import pytest

from encoder_graphs.cache_trust import HEADER, Signer
from encoder_graphs.compile_cache import CompileCache
from encoder_graphs.warmup_record import (
    MAX_RECORD_BYTES,
    WarmupRecord,
    fingerprint,
    forget,
    load,
    record_name,
    save,
)


def a_record(**changes) -> WarmupRecord:
    fields = {
        "graphs": {(64, 256): 1.25, (128, 512): None, (256, 1024): math.nan},
        "costs": {"eager_ms": ((64, 2.0), (256, 5.5)), "exact_ms": ()},
        "exact_min_rows": 1024,
        "fingerprint": "abc",
    }
    return WarmupRecord(**{**fields, **changes})


@pytest.fixture
def cache(tmp_path) -> CompileCache:
    made = CompileCache(tmp_path, "key", Signer(b"k" * 32, "test"))
    made.path.mkdir(parents=True)
    return made


def test_a_record_reads_back_as_written_and_is_forgotten(cache):
    record = a_record()
    assert save(cache, record) == cache.path / record_name("abc")
    assert (cache.path / record_name("abc")).read_bytes().startswith(HEADER)
    back = load(cache, record.graphs, "abc")
    assert back is not None and back.costs == record.costs and back.exact_min_rows == 1024
    assert back.graphs[(64, 256)] == 1.25 and back.graphs[(128, 512)] is None and math.isnan(back.graphs[(256, 1024)])
    assert [p.name for p in cache.path.iterdir()] == [record_name("abc")]  # the temporary file renamed over it
    forget(cache, "abc")
    assert load(cache, record.graphs, "abc") is None and not list(cache.path.iterdir())


def test_a_record_for_other_graphs_or_fingerprint_or_unreadable_is_not_loaded(cache, tmp_path):
    record = a_record(exact_min_rows=None)
    save(cache, record)
    assert load(cache, record.graphs, "abc").exact_min_rows is None
    assert load(cache, [(64, 256)], "abc") is None
    assert load(cache, record.graphs, "abd") is None
    assert load(CompileCache(tmp_path / "missing", "key", cache.signer), record.graphs, "abc") is None
    for text in ('{"version": 2, "graphs": [[64]]}', "not json", "[]", "null", '{"version": 1}', "\xff"):
        cache.write(record_name("abc"), text.encode("latin-1"))  # signed: it reaches the parser
        assert load(cache, record.graphs, "abc") is None


def genuine(**changes) -> dict:
    return {**json.loads(a_record().to_json()), **changes}


GRAPH = {"budget": 64, "max_seqlen": 256, "live": True}


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100000 + "]" * 100000,  # json.loads: RecursionError
        "1" * 5000,  # int: ValueError (more digits than Python converts)
        json.dumps(genuine(graphs=[{**GRAPH, "replay_ms": -1.0}])),
        json.dumps(genuine(graphs=[{**GRAPH, "replay_ms": "1.0"}])),
        json.dumps(genuine(graphs=[{**GRAPH, "replay_ms": True}])),
        json.dumps(genuine(graphs=[{**GRAPH, "live": 1, "replay_ms": 1.0}])),
        json.dumps(genuine(graphs=[{**GRAPH, "budget": 0, "replay_ms": 1.0}])),
        json.dumps(genuine(graphs=[{**GRAPH, "budget": 64.5, "replay_ms": 1.0}])),
        json.dumps(genuine(graphs=[{**GRAPH, "replay_ms": 1.0}, {**GRAPH, "replay_ms": 2.0}])),
        json.dumps(genuine(graphs=[{**GRAPH, "replay_ms": 1.0, "extra": 1}])),
        json.dumps(genuine(costs={"eager_ms": [[64, -2.0]]})),
        json.dumps(genuine(costs={"eager_ms": [[64, 2.0, 3.0]]})),
        json.dumps(genuine(costs={"eager_ms": [[-64, 2.0]]})),
        json.dumps(genuine(costs=[])),
        json.dumps(genuine(exact_min_rows=-1)),
        json.dumps(genuine(exact_min_rows=True)),
        json.dumps(genuine(fingerprint=1)),
        json.dumps(genuine(graphs=[{**GRAPH, "replay_ms": math.nan}])),  # Python writes NaN
        json.dumps(genuine(graphs=[{**GRAPH, "replay_ms": math.inf}])),
        json.dumps(genuine(costs={"eager_ms": [[64, math.nan]]})),
        json.dumps(genuine(costs={"eager_ms": [[64, -math.inf]]})),
    ],
)
def test_a_record_with_a_value_out_of_range_or_that_breaks_the_parser_is_ignored_with_one_warning(cache, text, caplog):
    """Signed (as a bug of ours could write it): read up to the parser, which refuses it; nothing raises."""
    cache.write(record_name("abc"), text.encode())
    with caplog.at_level(logging.WARNING):
        assert load(cache, [(64, 256)], "abc") is None
    assert len(caplog.records) == 1 and "warm-up record" in caplog.text and "ignored" in caplog.text


def test_the_genuine_record_of_the_parametrized_cases_loads(cache):
    """The base the cases above alter reads back (so each case is refused for its own change)."""
    cache.write(record_name("abc"), json.dumps(genuine(graphs=[{**GRAPH, "replay_ms": 1.0}])).encode())
    assert load(cache, [(64, 256)], "abc").graphs == {(64, 256): 1.0}


def test_an_unsigned_forged_or_altered_record_is_refused_before_it_is_parsed(cache, monkeypatch, caplog):
    record = a_record()
    name = record_name("abc")
    parsed = []
    monkeypatch.setattr(WarmupRecord, "from_json", classmethod(lambda cls, text: parsed.append(text)))
    signed = cache.signer.sign(f"key/{name}", record.to_json().encode())
    for blob in (
        record.to_json().encode(),  # unsigned
        Signer(b"x" * 32, "another").sign(f"key/{name}", record.to_json().encode()),  # another key
        signed.replace(b'"exact_min_rows": 1024', b'"exact_min_rows": 1025'),  # altered
        ("[" * 100000 + "]" * 100000).encode(),
    ):
        (cache.path / name).write_bytes(blob)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert load(cache, record.graphs, "abc") is None
        assert len(caplog.records) == 1 and f"{cache.path / name} refused" in caplog.text
    assert parsed == []


def test_a_record_too_large_is_refused_unread(cache, caplog):
    with open(cache.path / record_name("abc"), "wb") as file:
        file.truncate(MAX_RECORD_BYTES + 1)
    with caplog.at_level(logging.WARNING):
        assert load(cache, a_record().graphs, "abc") is None
    assert f"larger than {MAX_RECORD_BYTES} bytes" in caplog.text


def test_a_record_names_only_hex_fingerprints():
    assert record_name("0123abcdef") == "warmup-0123abcdef.json"
    for bad in ("../x", "", "ABC", "a/b"):
        with pytest.raises(ValueError):
            record_name(bad)


def test_a_record_that_cannot_be_written_is_skipped(tmp_path, cache):
    (tmp_path / "file").write_text("")
    assert save(CompileCache(tmp_path / "file", "below", Signer(b"k" * 32, "test")), a_record()) is None
    assert save(cache, a_record(costs={"eager_ms": ((64, math.inf),)})) is None  # never a record it would refuse
    assert not list(cache.path.iterdir())


def test_the_fingerprint_follows_the_sources_and_settings(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    assert fingerprint({}, [package]) is None  # no sources found: no record
    (package / "a.py").write_text("x = 1\n")
    before = fingerprint({"tolerance": 0.05}, [package])
    assert fingerprint({"tolerance": 0.05}, [package]) == before and len(before) == 20
    assert fingerprint({"tolerance": 0.1}, [package]) != before
    (package / "a.py").write_text("x = 2\n")
    assert fingerprint({"tolerance": 0.05}, [package]) != before
    assert fingerprint({}) is not None  # the installed packages' sources
