"""The warm-up record's file: written and read back, and refused where it does not fit."""

from __future__ import annotations

import math

from encoder_graphs.warmup_record import WarmupRecord, fingerprint, forget, load, record_name, save


def a_record(**changes) -> WarmupRecord:
    fields = {
        "graphs": {(64, 256): 1.25, (128, 512): None, (256, 1024): math.nan},
        "costs": {"eager_ms": ((64, 2.0), (256, 5.5)), "exact_ms": ()},
        "exact_min_rows": 1024,
        "fingerprint": "abc",
    }
    return WarmupRecord(**{**fields, **changes})


def test_a_record_reads_back_as_written_and_is_forgotten(tmp_path):
    record = a_record()
    assert save(tmp_path, record) == tmp_path / record_name("abc")
    back = load(tmp_path, record.graphs, "abc")
    assert back is not None and back.costs == record.costs and back.exact_min_rows == 1024
    assert back.graphs[(64, 256)] == 1.25 and back.graphs[(128, 512)] is None and math.isnan(back.graphs[(256, 1024)])
    assert [p.name for p in tmp_path.iterdir()] == [record_name("abc")]  # the temporary file renamed over it
    forget(tmp_path, "abc")
    assert load(tmp_path, record.graphs, "abc") is None and not list(tmp_path.iterdir())


def test_a_record_for_other_graphs_or_fingerprint_or_unreadable_is_not_loaded(tmp_path):
    record = a_record(exact_min_rows=None)
    save(tmp_path, record)
    assert load(tmp_path, record.graphs, "abc").exact_min_rows is None
    assert load(tmp_path, [(64, 256)], "abc") is None
    assert load(tmp_path, record.graphs, "abd") is None
    assert load(tmp_path / "missing", record.graphs, "abc") is None
    for text in ('{"version": 1, "graphs": [[64]]}', "not json", "[]", "null", '{"version": 2}'):
        (tmp_path / record_name("abc")).write_text(text)
        assert load(tmp_path, record.graphs, "abc") is None


def test_a_record_that_cannot_be_written_is_skipped(tmp_path):
    (tmp_path / "file").write_text("")
    assert save(tmp_path / "file" / "below", a_record()) is None  # a directory under a file


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
