"""When a replica takes traffic (`replica_startup`), and the counters it reports (`replica_counters`)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from deployments.autoscaling import ROUTER_REPORT_S
from deployments.config import AppConfig
from deployments.encoder.replica_counters import ReplicaCounters
from deployments.encoder.replica_startup import WarmupTimeline, cache_filled, waits_for_warm_up, warm_up_line
from encoder_graphs.compile_cache import ARTIFACTS, CompileCache
from encoder_graphs.warmup import WarmupStatus


@pytest.mark.parametrize(
    ("mode", "filled", "waits"),
    [
        ("cached", True, True),
        ("cached", False, False),
        ("always", False, True),
        ("always", True, True),
        ("never", True, False),
        ("never", False, False),
    ],
)
def test_a_replica_waits_for_its_warm_up_only_where_the_mode_says(mode, filled, waits):
    assert waits_for_warm_up(mode, filled) is waits


def test_the_default_waits_on_a_filled_cache_only():
    assert AppConfig().replica.warm_up_before_ready == "cached"


def runner_with(cache: CompileCache | None, compiled: bool | None):
    status = SimpleNamespace(compiled=compiled)
    return SimpleNamespace(compile_cache=cache, warmup_status=lambda: status)


def test_a_cache_is_filled_by_the_files_this_start_would_otherwise_make(tmp_path):
    """Compiled forward: the artifacts of this cache key; without compile: a warm-up record."""
    cache = CompileCache(tmp_path, "key", signer=None)
    assert not cache_filled(runner_with(None, compiled=False))
    assert not cache_filled(runner_with(cache, compiled=False))
    cache.path.mkdir(parents=True)
    (cache.path / "warmup-0123abcd.json").write_text("{}")
    assert cache_filled(runner_with(cache, compiled=None))  # compile off: the record is what is reused
    assert not cache_filled(runner_with(cache, compiled=False))  # compiled: the artifacts are missing
    (cache.path / ARTIFACTS).write_bytes(b"signed artifacts")
    assert cache_filled(runner_with(cache, compiled=False))


def test_the_warm_up_line_names_the_stages_and_the_slowest_steps():
    logged = []
    timeline = WarmupTimeline(logged.append)
    timeline("compile cache /c: 57 artifacts loaded")
    time.sleep(0.05)
    timeline("graph 10/20 captured: budget 4096 tokens")
    timeline("full speed")
    assert logged == [line for _, line in timeline.lines]
    slowest = timeline.slowest(2)
    assert [line for _, line in slowest][0] == "graph 10/20 captured: budget 4096 tokens"
    assert slowest[0][0] >= 0.05 and slowest[0][0] >= slowest[1][0]
    status = WarmupStatus("done", 20, 20, True, None, {"prepare": 1.0, "compile": 2.5, "graphs": 3.0}, True, True)
    line = warm_up_line(status, timeline, waited=True)
    assert line.startswith("warm-up seconds (before taking traffic):")
    assert "20/20 graphs live, graphs captured on the warm-up record" in line
    assert "prepare 1.0 s, compile 2.5 s, graphs 3.0 s" in line and "to 'graph 10/20 captured" in line


def test_counters_sum_forwards_and_report_each_router_until_it_goes_quiet(monkeypatch):
    counters = ReplicaCounters()
    counters.count(queued=300)
    counters.count(queued=-100, inflight=100)
    counters.ran(packs=2, requests=3, tokens=100)
    counters.add_seconds("run", 0.25)
    assert counters.load_tokens == 300
    stats = SimpleNamespace(first_pack_check_s=0.1, recurring_capture_s=0.0)
    work = counters.work_summary(stats)
    assert (work["forwards"], work["merged_packs"], work["merged_requests"], work["tokens"]) == (1, 2, 3, 100)
    assert work["step_seconds"]["run"] == 0.25 and work["step_seconds"]["first_pack_checks"] == 0.1
    assert counters.per_forward() == {"packs_per_forward": 2.0, "requests_per_forward": 3.0}
    counters.router_said("r1", waiting_tokens=5000, report=7)
    reported = counters.autoscaling_stats()
    assert reported["queued_tokens"] == 200.0 and reported["inflight_tokens"] == 100.0
    assert 5000.0 in reported.values() and 7.0 in reported.values()
    later = time.monotonic() + ROUTER_REPORT_S + 1
    monkeypatch.setattr("deployments.encoder.replica_counters.time.monotonic", lambda: later)
    assert set(counters.autoscaling_stats()) == {"queued_tokens", "inflight_tokens"}  # r1 went quiet
