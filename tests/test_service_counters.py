"""The benchmark's differencing of the service's counters (benchmarks/common/service_counters.py) and its
count of Serve's slow-probe lines (benchmarks/common/serve_log.py), on snapshots shaped as
`/v1/models/{id}` returns them and on lines a real run logged."""

from benchmarks.common.serve_log import SLOW_PROBE, occurrences
from benchmarks.common.service_counters import counted_between, replica_rates, run_shares


def work(pid: int, at: float, forwards: int, requests: int, tokens: int, run: float, store: float) -> dict:
    return {
        "pid": pid,
        "at": at,
        "forwards": forwards,
        "merged_packs": forwards,
        "merged_requests": requests,
        "tokens": tokens,
        "step_seconds": {"preprocess": 0.0, "run": run, "store": store},
    }


def test_each_replica_is_timed_by_its_own_reports():
    before = {"a": work(11, 100.0, 10, 30, 50_000, 5.0, 1.0), "b": work(12, 100.5, 4, 8, 20_000, 2.0, 2.0)}
    after = {"a": work(11, 110.0, 60, 230, 700_000, 14.5, 3.5), "b": work(12, 108.5, 20, 40, 180_000, 8.0, 10.0)}
    rates = replica_rates(before, after)
    assert rates["a"]["tokens_per_s"] == 65_000 and rates["a"]["requests_per_forward"] == 4.0
    assert rates["a"]["share"]["run"] == 0.95 and rates["a"]["ms_per_forward"]["store"] == 50.0
    assert rates["b"]["tokens_per_s"] == 20_000 and rates["b"]["ms_per_forward"]["store"] == 500.0


def test_a_restarted_new_or_older_replica_is_left_out():
    before = {"a": work(11, 100.0, 10, 30, 50_000, 5.0, 1.0), "d": {"pid": 14, "forwards": 3}}
    after = {
        "a": work(99, 110.0, 3, 3, 9_000, 0.5, 0.1),
        "c": work(13, 110.0, 5, 5, 9_000, 0.5, 0.1),
        "d": {"pid": 14, "forwards": 9},
    }
    assert replica_rates(before, after) == {}


def test_the_window_holds_the_replicas_and_the_slow_probes():
    before = {"replicas": {"a": work(11, 100.0, 10, 30, 50_000, 5.0, 1.0)}, "slow_queue_probes": 2}
    after = {"replicas": {"a": work(11, 110.0, 60, 230, 700_000, 14.5, 3.5)}, "slow_queue_probes": 29}
    window = counted_between(before, after)
    assert window["slow_queue_probes"] == 27 and window["replicas"]["a"]["forwards"] == 50


PROBES = (
    "\x1b[36m(ServeReplica:encoder:EncoderRouter pid=1938)\x1b[0m WARNING 2026-11-27 01:39:47,604 "
    "encoder_EncoderRouter apvo6xwc -- Failed to get queue length from Replica(id='xvwu7fqx', "
    "deployment='EncoderReplica', app='encoder') within 0.1s. If this happens repeatedly it's likely "
    "caused by high network latency in the cluster.\n"
    "\x1b[36m(ServeReplica:encoder:EncoderRouter pid=1943)\x1b[0m WARNING 2026-11-27 01:39:56,196 "
    "encoder_EncoderRouter c834qyes -- Failed to get queue length from Replica(id='8nypmte2', "
    "deployment='EncoderReplica', app='encoder') within 0.1s. If this happens repeatedly it's likely "
    "caused by high network latency in the cluster.\x1b[32m [repeated 7x across cluster]\x1b[0m\n"
    "(ServeController pid=1914) INFO 2026-11-27 01:36:21,833 controller 1914 -- Adding 4 replicas.\n"
    "\x1b[36m(ServeReplica:encoder:EncoderRouter pid=1943)\x1b[0m WARNING 2026-11-27 01:39:57,100 "
    "encoder_EncoderRouter c834qyes -- Failed to get queue length from Replica(id='q1w2e3r4', "
    "deployment='LLMServer', app='encoder') within 0.1s.\n"
)


def test_folded_repeats_count_as_often_as_ray_says_and_only_the_encoders_probes_count():
    assert occurrences(PROBES, SLOW_PROBE) == 8


def test_run_shares_span_the_replicas():
    window = {
        "replicas": {
            "a": {"share": {"run": 0.78, "first_pack_checks": 0.1, "recurring_captures": 0.02, "between": 0.1}},
            "b": {"share": {"run": 0.8, "first_pack_checks": 0.1, "recurring_captures": 0.0, "between": 0.12}},
            "c": {"seconds": 1.0},  # a replica without rates (another version's report)
        }
    }
    assert run_shares(window) == (
        "run 0.78-0.80 (first-pack checks 0.10, captures 0.00-0.02); between forwards while packs waited 0.10-0.12"
    )
    assert run_shares({}) == run_shares({"replicas": {}}) == ""
    older = {"replicas": {"a": {"share": {"run": 0.9}}}}  # reports from before these steps were counted
    assert run_shares(older) == "run 0.90"
