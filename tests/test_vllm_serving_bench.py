"""The deployment comparison's pure parts: requests, arrivals, a rate's numbers, the stop rule, the SLO rate."""

import base64
import io
import random

import numpy as np
import pytest
import yaml
from PIL import Image

from benchmarks.vllm_serving_bench import (
    WORKLOADS,
    arrivals,
    merge_levels,
    overloaded,
    parse_rates,
    photo,
    rate_at_slo,
    request_body,
    stamped,
    summarize,
    time_for_a_rate,
)


def record(sent, ttft, end, tokens=64, error=None):
    return {"sent": sent, "ttft": ttft, "end": end, "tokens": tokens, "error": error}


def test_arrivals_are_poisson_at_the_rate():
    times = arrivals(20.0, 100.0, random.Random(1))
    assert all(0 < a < b < 100 for a, b in zip(times, times[1:]))
    assert 1800 < len(times) < 2200
    gaps = np.diff(times)
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1  # exponential gaps: coefficient of variation 1


def test_requests_are_the_same_for_every_system_and_their_images_unique():
    bases = {size: photo(*size, seed=1) for size in WORKLOADS["image-heavy"]["sizes"]}
    count = lambda text: len(text.split())  # noqa: E731
    one = [request_body(WORKLOADS["image-heavy"], i, 7, bases, count) for i in range(12)]
    again = [request_body(WORKLOADS["image-heavy"], i, 7, bases, count) for i in range(12)]
    assert one == again
    urls = [p["image_url"]["url"] for body in one for p in body["messages"][0]["content"] if p["type"] == "image_url"]
    assert len(set(urls)) == len(urls) > 12
    counts = [sum(p["type"] == "image_url" for p in body["messages"][0]["content"]) for body in one]
    assert min(counts) >= 1 and max(counts) <= 4
    sizes = {Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size for url in urls}
    assert sizes <= set(WORKLOADS["image-heavy"]["sizes"])
    assert all(body["ignore_eos"] and body["max_tokens"] == 64 and body["stream"] for body in one)


def test_image_light_text_has_the_asked_tokens():
    bases = {(224, 224): photo(224, 224, seed=1)}
    count = lambda text: len(text.split())  # noqa: E731
    body = request_body(WORKLOADS["image-light"], 3, 1, bases, count)
    text = body["messages"][0]["content"][-1]["text"]
    assert 1000 <= count(text) <= 2000 + 4


def test_stamped_changes_only_a_block():
    image = photo(64, 48, seed=2)
    out = stamped(image, 5)
    changed = np.argwhere((out != image).any(-1))
    assert 0 < len(changed) <= 256 and np.ptp(changed[:, 0]) < 16 and np.ptp(changed[:, 1]) < 16


def test_summary_of_a_rate():
    records = [record(0.0, 0.5, 2.0), record(1.0, 1.0, 3.0), record(2.0, None, 4.0, 0, "HTTP 503: busy")]
    level = summarize(records, rate=1.5, seconds=2)
    assert level["sent"] == 3 and level["answered"] == 2 and level["errors"] == 1
    assert level["error_kinds"] == ["HTTP 503: busy"]
    assert level["requests_per_s"] == 2 / 3.0  # first send to last answer
    assert level["output_tokens_per_s"] == 128 / 3.0
    assert level["ttft_p50_s"] == 0.75


def test_overloaded_and_rate_at_slo():
    def level(rate, answered_rate, p99, errors=0):
        return {"rate": rate, "requests_per_s": answered_rate, "ttft_p99_s": p99, "errors": errors}

    levels = [level(2, 2.0, 0.4), level(4, 3.9, 1.5), level(8, 7.5, 2.5), level(16, 9.0, 12.0)]
    assert [overloaded(lv, stop_ttft=10) for lv in levels] == [False, False, False, True]
    assert overloaded(level(4, 3.0, 0.5), 10)  # fewer answers than asked
    assert overloaded(level(4, 4.0, 0.5, errors=1), 10)
    assert rate_at_slo(levels, 2.0) == 3.9
    assert rate_at_slo([level(2, 2.0, 3.0)], 2.0) == 0.0
    # the first reading stops at the first rate that failed; the order given does not matter
    noisy = [level(12, 11.8, 1.9), level(4, 3.9, 1.5), level(8, 7.6, 2.4)]
    assert rate_at_slo(noisy, 2.0) == 3.9
    assert rate_at_slo(noisy, 2.0, every_below=False) == 11.8


def test_a_rate_starts_only_if_its_arrivals_and_drain_end_before_the_time_limit():
    assert time_for_a_rate(deadline=100.0, seconds=30, now=40.0)  # 40 + 30 s of arrivals + 30 s drain = 100
    assert not time_for_a_rate(deadline=100.0, seconds=30, now=40.5)
    assert not time_for_a_rate(deadline=1.0, seconds=4, now=0.0)  # --time-limit 1: no server is started


def test_rates_per_workload_and_merged_levels():
    workloads = ["image-heavy", "image-light"]
    assert parse_rates(None, workloads) == {"image-heavy": None, "image-light": None}
    assert parse_rates(["8", "16"], workloads) == {"image-heavy": [8, 16], "image-light": [8, 16]}
    rates = parse_rates(["image-heavy=6,8,10", "image-light=16,24.5"], workloads)
    assert rates == {"image-heavy": [6, 8, 10], "image-light": [16, 24.5]}
    assert all(type(r) is int for r in rates["image-heavy"])  # 8, not 8.0: the seeds of a rate's requests match
    with pytest.raises(ValueError, match="video-heavy"):
        parse_rates(["video-heavy=4"], workloads)
    kept = [{"rate": r, "seconds": 15, "old": True} for r in (1, 2, 4, 8, 12)]
    measured = [{"rate": r, "seconds": 30} for r in (6, 8, 10)]
    merged = merge_levels(kept, measured)
    assert [lv["rate"] for lv in merged] == [1, 2, 4, 6, 8, 10, 12]
    assert [lv["seconds"] for lv in merged] == [15, 15, 15, 30, 30, 30, 15]


def test_cpu_sampler_splits_the_hosts_busy_cores_into_clients_and_servers():
    import os
    import time

    from benchmarks.common.utilisation import CpuSampler

    sampler = CpuSampler([os.getpid()])  # this process stands in for the clients
    end = time.process_time() + 0.3
    while time.process_time() < end:  # keep one core busy
        pass
    cpu = sampler.stop()
    assert cpu["client_cores"] > 0.2
    assert abs(cpu["server_cores"] - (cpu["host_cores"] - cpu["client_cores"])) <= 0.11  # each rounded to 0.1


def test_the_busiest_processes_are_ranked_by_the_cores_they_used_between_two_readings():
    from benchmarks.common.utilisation import busiest_processes

    before = {1: ("router", 10.0), 2: ("replica", 5.0), 3: ("client", 0.0)}
    after = {1: ("router", 19.0), 2: ("replica", 7.0), 3: ("client", 20.0), 4: ("started later", 4.0)}
    found = busiest_processes(before, after, 10.0, skip={3}, count=2)
    assert found == [["router", 0.9], ["started later", 0.4]]


def test_the_busiest_processes_are_named_by_their_deployment_or_program():
    from benchmarks.vllm_serving_bench import busiest

    found = [["ray::ServeReplica:epd:ColocatedReplica", 0.99], ["VLLM::EngineCore_DP0 x", 0.5], ["/bin/haproxy", 0.1]]
    assert busiest({"cpu": {"busiest_processes": found}}) == "ColocatedReplica 0.99, EngineCore_DP0 0.5, haproxy 0.1"
    assert busiest({"cpu": {"server_cores": 1.0}}) == busiest({}) == "-"  # levels measured before the breakdown


def test_vllm_epd_sends_the_encoder_instance_the_request_unstreamed_with_one_token():
    from benchmarks.common.serving_systems import encode_body

    body = {"model": "m", "messages": [{"role": "user"}], "max_tokens": 64, "stream": True, "stream_options": {}}
    assert encode_body(body) == {"model": "m", "messages": [{"role": "user"}], "max_tokens": 1}
    assert body["stream"] and body["max_tokens"] == 64  # the request itself, for the prefill-decode instance, unchanged


def test_our_systems_keep_serves_logs_beside_the_results(tmp_path):
    """A failed rate on a lent host is read from these afterwards: our systems' Serve logs in one archive."""
    import tarfile

    from benchmarks.common.serving_systems import keep_serve_logs

    session = tmp_path / "session"
    (session / "logs" / "serve").mkdir(parents=True)
    (session / "logs" / "serve" / "replica_epd_ColocatedReplica_x.log").write_text("a line\n")
    archive = keep_serve_logs("ours-colocated", tmp_path, session)
    with tarfile.open(archive) as tar:
        assert "serve-logs-ours-colocated/replica_epd_ColocatedReplica_x.log" in tar.getnames()
    assert keep_serve_logs("vllm-dp2", tmp_path, session) is None  # vLLM's servers log to their own files
    assert keep_serve_logs("ours", tmp_path, tmp_path / "no-session") is None


def test_each_systems_vllm_prefill_budgets_come_from_its_own_servers_logs(tmp_path):
    """The report states every engine's `max_num_batched_tokens` as it logged it, per system."""
    from benchmarks.common.serving_systems import prefill_budgets

    line = "INFO [scheduler.py:252] Chunked prefill is enabled with max_num_batched_tokens={}.\n"
    (tmp_path / "server-ours.log").write_text("(ServeReplica:epd:VLLMReplica pid=1) " + line.format(2048))
    (tmp_path / "server-ours-colocated.log").write_text(line.format(8192) * 2)
    (tmp_path / "server-vllm-epd.log").write_text(line.format(8192))
    (tmp_path / "server-vllm-epd-encoder.log").write_text(line.format(65536))
    assert prefill_budgets("ours", tmp_path) == [2048]
    assert prefill_budgets("ours-colocated", tmp_path) == [8192, 8192]
    assert prefill_budgets("vllm-epd", tmp_path) == [8192, 65536]
    assert prefill_budgets("vllm-dp2", tmp_path) == []


def test_a_deployment_serve_could_not_make_fails_the_start_with_serves_reason(tmp_path):
    """`serve run` keeps running when deploying fails: its log is the only sign, read while waiting."""
    from benchmarks.common.serving_systems import deploy_failure

    log = tmp_path / "server-ours.log"
    log.write_text(
        "\x1b[36m(ServeController pid=17955)\x1b[0m ERROR 2026-11-28 23:09:40,363 controller 17955 -- "
        "Deploying app 'epd' failed with exception:\n"
        "\x1b[36m(ServeController pid=17955)\x1b[0m `llm.engine_kwargs.max_model_len` (16384) exceeds the "
        "checkpoint's max_position_embeddings=4096\n"
    )
    assert (
        deploy_failure(log)
        == "`llm.engine_kwargs.max_model_len` (16384) exceeds the checkpoint's max_position_embeddings=4096"
    )
    log.write_text("INFO -- Deployed app 'epd' successfully.\n")
    assert (
        deploy_failure(log) is None and deploy_failure(tmp_path / "none.log") is None and deploy_failure(None) is None
    )


def test_our_configs_take_the_vllm_servers_max_model_len_unless_their_own_is_smaller(tmp_path):
    from benchmarks.common.serving_systems import MAX_MODEL_LEN, ROOT, ours_config

    def engine(config: str) -> dict:
        path = ours_config(ROOT / "configs" / config, "/ckpt", tmp_path, 8000, "ours", 64)
        return yaml.safe_load(path.read_text())["applications"][0]["args"]["llm"]["engine_kwargs"]

    assert engine("epd-vllm.yaml")["max_model_len"] == MAX_MODEL_LEN  # the GPU config's 32768 -> the servers'
    assert engine("epd-vllm-cpu.yaml")["max_model_len"] == 4096  # the tiny checkpoint's limit stays
