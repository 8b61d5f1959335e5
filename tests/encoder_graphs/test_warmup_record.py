"""The warm-up record's file: written and read back, and refused where it does not fit."""

from __future__ import annotations

import math

from encoder_graphs.warmup_record import RECORD, WarmupRecord, code_digest, load, save


def a_record(**changes) -> WarmupRecord:
    fields = {
        "graphs": {(64, 256): 1.25, (128, 512): None, (256, 1024): math.nan},
        "costs": {"eager_ms": ((64, 2.0), (256, 5.5)), "exact_ms": ()},
        "exact_min_rows": 1024,
        "code": "abc",
        "tolerance": 0.05,
    }
    return WarmupRecord(**{**fields, **changes})


def test_a_record_reads_back_as_written(tmp_path):
    record = a_record()
    save(tmp_path, record)
    back = load(tmp_path, record.graphs, "abc", 0.05)
    assert back is not None and back.costs == record.costs and back.exact_min_rows == 1024
    assert back.graphs[(64, 256)] == 1.25 and back.graphs[(128, 512)] is None and math.isnan(back.graphs[(256, 1024)])
    assert [p.name for p in tmp_path.iterdir()] == [RECORD]  # the temporary file renamed over it


def test_a_record_for_other_graphs_code_or_tolerance_or_unreadable_is_not_loaded(tmp_path):
    record = a_record(exact_min_rows=None)
    save(tmp_path, record)
    assert load(tmp_path, record.graphs, "abc", 0.05).exact_min_rows is None
    assert load(tmp_path, [(64, 256)], "abc", 0.05) is None
    assert load(tmp_path, record.graphs, "abd", 0.05) is None
    assert load(tmp_path, record.graphs, "abc", 0.1) is None
    assert load(tmp_path / "missing", record.graphs, "abc", 0.05) is None
    (tmp_path / RECORD).write_text('{"version": 1, "graphs": [[64]]}')
    assert load(tmp_path, record.graphs, "abc", 0.05) is None
    (tmp_path / RECORD).write_text("not json")
    assert load(tmp_path, record.graphs, "abc", 0.05) is None


def test_the_code_digest_follows_the_sources(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("x = 1\n")
    before = code_digest([package])
    assert code_digest([package]) == before and len(before) == 20
    (package / "a.py").write_text("x = 2\n")
    assert code_digest([package]) != before
    assert code_digest() == code_digest()
