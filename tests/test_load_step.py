"""The load step's pure parts (benchmarks/common/schedule.py, stats.py, load_step.py): the schedule
of callers, each client process's share of it, and samples and observations per window."""

from __future__ import annotations

import pytest

from benchmarks.common.load_step import load_step_rows, load_step_table, replica_states
from benchmarks.common.schedule import ScheduleShare, callers_at, mean_callers, parse_schedule, peak
from benchmarks.common.stats import observed_at, windows


def test_a_schedule_is_linear_between_points_and_a_repeated_time_is_a_step():
    schedule = parse_schedule("0:0,30:96,230:96,260:0,320:0")
    assert schedule == ((0.0, 0), (30.0, 96), (230.0, 96), (260.0, 0), (320.0, 0))
    assert [callers_at(schedule, t) for t in (0, 15, 29.9, 30, 100, 245, 260, 300, 320, 400)] == [
        0, 48, 96, 96, 96, 48, 0, 0, 0, 0,
    ]  # fmt: skip
    step = parse_schedule("0:0, 10:0, 10:8, 20:8")
    assert [callers_at(step, t) for t in (9.99, 10, 15, 25)] == [0, 8, 8, 8]
    assert peak(schedule) == 96
    assert mean_callers(step, 5, 15) == pytest.approx(4.0)


@pytest.mark.parametrize(
    "text, names",
    [
        ("0:0,30", "'30'"),
        ("0:0,a:4", "'a:4'"),
        ("0:0,10:-1", "'10:-1'"),
        ("0:0,10:4,5:4", "'5:4'"),
        ("0:4", "at least two points"),
        ("0:0,0:4", "at least two points"),
    ],
)
def test_a_bad_schedule_names_the_point_and_the_rule(text, names):
    with pytest.raises(ValueError, match=names):
        parse_schedule(text)


def test_client_processes_share_the_callers_lowest_first_and_never_more_than_their_peak():
    schedule = parse_schedule("0:0,10:10,20:10,30:0")
    parts = [ScheduleShare(schedule, p, 3) for p in range(3)]
    assert [part.most() for part in parts] == [4, 3, 3]
    for t in (0, 2.5, 5, 7.5, 10, 15, 25, 29.9):
        assert sum(part.callers(t) for part in parts) == callers_at(schedule, t)
        for part in parts:
            active = [c for c in range(part.most()) if part(c, t)]
            assert active == list(range(part.callers(t)))


def sample(start: float, end: float, tokens: int = 100, status=200) -> tuple:
    return (start, end, tokens, status, {})


def test_windows_count_what_completed_in_them():
    schedule = parse_schedule("0:0,0:4,12:4")
    samples = [
        sample(0.0, 1.0),
        sample(0.5, 2.5, 300),
        sample(1.0, 4.99),  # completes in the first window
        sample(4.0, 5.0),  # ends at the second's start: the second's
        sample(6.0, 8.0, 0, "RayActorError"),
        sample(7.0, 9.0, 0, 503),
        sample(10.0, 11.0),
        sample(11.5, 12.5),  # completes after the schedule's end: in no window
    ]
    rows = windows(samples, schedule, 5.0)
    assert [(r["t0_s"], r["t1_s"]) for r in rows] == [(0, 5), (5, 10), (10, 12)]
    assert [r["requests"] for r in rows] == [3, 3, 1]
    assert [r["tokens_per_s"] for r in rows] == [100.0, 20.0, 50.0]
    assert rows[0]["p50_ms"] == 2000.0 and rows[0]["p99_ms"] == 3990.0  # 1000, 2000, 3990 ms
    assert rows[2]["p50_ms"] == rows[2]["p99_ms"] == 1000.0
    assert rows[1]["errors"] == 2 and rows[1]["error_kinds"] == {"RayActorError": 1, "503": 1}
    assert [r["callers"] for r in rows] == [4, 4, 4]
    two = windows([sample(0.0, 1.0), sample(0.0, 3.0)], schedule, 5.0)[0]
    assert (two["p50_ms"], two["p99_ms"]) == (2000.0, 3000.0)  # p99 never under the median
    empty = windows([], schedule, 5.0)
    assert [(r["requests"], r["tokens_per_s"], r["p50_ms"], r["errors"]) for r in empty] == [(0, 0.0, None, 0)] * 3


def test_each_window_takes_the_last_observation_by_its_end_that_holds_each_part():
    observations = [
        {"t_s": -0.5, "replicas": {"RUNNING": 1}, "warmup": {"a": {"stage": "done", "graphs_live": 4, "graphs_total": 4, "full_speed": True}}},  # noqa: E501
        {"t_s": 4.0, "replicas": {"RUNNING": 1, "STARTING": 1}, "detail_error": "timed out"},
        {"t_s": 6.0, "serve_error": "no controller", "warmup": {
            "a": {"stage": "done", "graphs_live": 4, "graphs_total": 4, "full_speed": True},
            "b": {"stage": "graphs", "graphs_live": 1, "graphs_total": 4, "full_speed": False},
        }},
        {"t_s": 11.0, "replicas": {"RUNNING": 2}},
    ]  # fmt: skip
    assert observed_at(observations, -1.0, "replicas") is None
    assert observed_at(observations, 5.0, "warmup") == observations[0]["warmup"]
    schedule = parse_schedule("0:2,15:2")
    rows = load_step_rows([sample(1.0, 2.0)], schedule, 5.0, observations)
    scaling = {"RUNNING": 1, "STARTING": 1}
    assert [r["replicas"] for r in rows] == [scaling, scaling, {"RUNNING": 2}]
    assert [r["full_speed_replicas"] for r in rows] == [1, 1, 1]
    assert rows[1]["warmup"]["b"] == {"stage": "graphs", "graphs_live": 1, "graphs_total": 4}
    record = {"interface": "handle", "totals": {"requests": 1}, "windows": rows}
    assert "| 5-10 | 2 | 0 | - | - | 0 | 1 running, 1 starting | 1 | done 4/4, graphs 1/4 |" in load_step_table(record)


def test_serve_replica_states_are_named_and_empty_states_left_out():
    from ray.serve._private.common import ReplicaState

    states = {ReplicaState.RUNNING: 2, ReplicaState.STARTING: 1, ReplicaState.STOPPING: 0}
    assert replica_states(states) == {"RUNNING": 2, "STARTING": 1}
    assert replica_states({"RUNNING": 1}) == {"RUNNING": 1}
