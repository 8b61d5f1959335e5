"""Metrics on Ray's Prometheus endpoint after a known workload; autoscaling on tokens, end to end."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
from ray import serve

from tests.deployments.media_helpers import b64, image_file, pattern

METRIC = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{[^}]*\})?\s+(?P<value>\S+)$")


def scrape(port: int) -> dict[str, dict[str, float]]:
    """{metric name: {labels: value}} from Prometheus text."""
    metrics: dict[str, dict[str, float]] = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines():
        match = METRIC.match(line)
        if match and not line.startswith("#"):
            metrics.setdefault(match["name"], {})[match["labels"] or ""] = float(match["value"])
    return metrics


def total(metrics, name: str, label: str = "") -> float:
    return sum(v for labels, v in metrics.get(name, {}).items() if label in labels)


def test_every_metric_reports_sensible_values_after_a_known_workload(serve_harness):
    url = serve_harness.deploy("configs/local.yaml")
    port = serve_harness.metrics_port
    small = image_file(pattern(256, 256, seed=90), "PNG")  # 64 tokens with the tiny Qwen3-VL processor
    huge = image_file(pattern(2600, 2600, seed=91), "PNG")  # > 4096 tokens: larger than every budget
    before = scrape(port)
    with serve_harness.http(headers={"Authorization": "Bearer metrics"}) as client:  # one tenant: one cache scope
        for _ in range(3):  # one miss, then two cache hits
            assert (
                client.post(url + "/v1/encode", json={"items": [{"type": "image", "image": b64(small)}]}).status_code
                == 200
            )
        assert (
            client.post(url + "/v1/encode", json={"items": [{"type": "image", "image": b64(huge)}]}).status_code == 200
        )
        assert client.post(url + "/v1/encode", json={"items": [{"type": "image", "image": "%%%"}]}).status_code == 400
        assert client.post(url + "/v1/encode", json={"items": "not a list"}).status_code == 400
    idle_since = time.monotonic()
    gauges = (
        "ray_vlm_router_queued_tokens",
        "ray_vlm_encoder_queued_tokens",
        "ray_vlm_router_cache_bytes",
        "ray_vlm_encoder_graphs_live",
        "ray_vlm_encoder_full_speed",
    )
    deadline, after = time.monotonic() + 60, before
    while time.monotonic() < deadline:
        # Ray's agent exports each metric on its own schedule: wait for the last counters and for
        # every gauge (a clean-clone run once scraped before the router's first gauge arrived).
        after = scrape(port)
        if (
            total(after, "ray_vlm_router_rejected_requests_total")
            - total(before, "ray_vlm_router_rejected_requests_total")
            >= 2
            and (
                total(after, "ray_vlm_encoder_eager_fallbacks_total", 'reason="oversize"')
                > total(before, "ray_vlm_encoder_eager_fallbacks_total", 'reason="oversize"')
            )
            and all(gauge in after for gauge in gauges)
        ):
            break
        time.sleep(1)

    def grew(name, label="", by=0.0):
        return total(after, name, label) - total(before, name, label) > by

    tokens = total(after, "ray_vlm_router_vision_tokens_total") - total(before, "ray_vlm_router_vision_tokens_total")
    assert tokens >= 3 * 64 + 4096
    assert grew("ray_vlm_encoder_vision_tokens_total", by=4096)
    # The 64-token pack ran in the budget-64 graph, or, if this session's replica had already seen
    # that pack (same grid), in its own recurring-pack graph.
    assert grew("ray_vlm_encoder_graph_hits_total", 'budget="64"') or grew(
        "ray_vlm_encoder_graph_hits_total", 'budget="recurring"'
    )
    assert grew("ray_vlm_encoder_eager_fallbacks_total", 'reason="oversize"')
    assert grew("ray_vlm_encoder_computed_tokens_total")
    # the warm-up's progress: this replica served from a live graph, so it is at full speed
    assert total(after, "ray_vlm_encoder_graphs_live") > 0 and total(after, "ray_vlm_encoder_full_speed") >= 1
    assert total(after, "ray_vlm_encoder_padded_tokens_total") <= total(after, "ray_vlm_encoder_computed_tokens_total")
    assert grew("ray_vlm_encoder_forward_seconds_count") and grew("ray_vlm_encoder_queue_seconds_count")
    assert grew("ray_vlm_router_preprocess_seconds_count", by=3) and grew("ray_vlm_router_transfer_seconds_count")
    assert grew("ray_vlm_router_pack_fill_count") and grew("ray_vlm_router_pack_requests_count")
    assert total(after, "ray_vlm_router_pack_fill_sum") <= total(after, "ray_vlm_router_pack_fill_count")
    assert grew("ray_vlm_router_cache_hits_total", by=1) and grew("ray_vlm_router_cache_misses_total")
    assert grew("ray_vlm_router_rejected_requests_total", 'reason="invalid"', by=1)
    for gauge in gauges:
        assert gauge in after and all(value >= 0 for value in after[gauge].values())
    # An idle service still exports its gauges (0 queued, not "no data"): Ray drops a gauge's
    # series ~20 s after it was last set, so the replicas re-set theirs on a timer.
    time.sleep(max(0.0, idle_since + 25 - time.monotonic()))
    idle = scrape(port)
    for gauge in gauges:
        assert gauge in idle, f"{gauge} not exported after 25 s idle"
    for gauge in ("ray_vlm_router_queued_tokens", "ray_vlm_encoder_queued_tokens"):
        assert all(value == 0 for value in idle[gauge].values()), idle[gauge]


def token_autoscaling(target_tokens: int, downscale_delay_s: float) -> dict:
    """An autoscaling config of one to two encoder replicas on the token policy, quick to react."""
    return {
        "min_replicas": 1,
        "max_replicas": 2,
        "upscale_delay_s": 1,
        "downscale_delay_s": downscale_delay_s,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2,
        "policy": {
            "policy_function": "deployments.autoscaling:TokenAutoscalingPolicy",
            "policy_kwargs": {"target_tokens_per_replica": target_tokens},
        },
    }


def running_encoders(app: str) -> int:
    states = serve.status().applications[app].deployments["EncoderReplica"].replica_states
    return states.get("RUNNING", 0)


def peak_replicas_under_load(
    running: Callable[[], int], send: Callable[[httpx.Client, int], None], callers: int, seconds: float = 90
) -> int:
    """`callers` threads calling `send(client, caller)` over and over until a second replica runs
    (or `seconds` pass); the most replicas `running()` saw."""
    stop, peak = time.monotonic() + seconds, running()
    with ThreadPoolExecutor(callers) as pool, httpx.Client(timeout=120) as client:

        def load(caller: int) -> None:
            while time.monotonic() < stop and peak < 2:
                send(client, caller)

        futures = [pool.submit(load, caller) for caller in range(callers)]
        while time.monotonic() < stop and peak < 2:
            peak = max(peak, running())
            time.sleep(0.5)
        stop = time.monotonic()
        for future in futures:
            future.result()
    return peak


def peak_encoders_under_load(url: str, app: str, seconds: float = 90) -> int:
    """16 clients sending four 400x400 PNGs a request until a second encoder replica runs (or
    `seconds` pass); the most replicas seen running."""
    files = [image_file(pattern(400, 400, seed=s), "PNG") for s in range(8)]

    def send(client: httpx.Client, seed: int) -> None:
        items = [{"type": "image", "image": b64(files[(seed + i) % 8])} for i in range(4)]
        client.post(url + "/v1/encode", json={"items": items, "cache": False})

    return peak_replicas_under_load(lambda: running_encoders(app), send, callers=16, seconds=seconds)


def test_sustained_load_scales_encoders_up_and_idle_scales_them_back(serve_harness):
    url = serve_harness.deploy(
        "configs/local.yaml",
        name="autoscale",
        route_prefix="/autoscale",
        deployments={"EncoderReplica": {"num_replicas": None, "autoscaling_config": token_autoscaling(100, 6)}},
        router={"max_wait_ms": 5, "cache_bytes": 0},
    )
    assert running_encoders("autoscale") == 1
    assert peak_encoders_under_load(url, "autoscale") == 2, "sustained load did not add a replica"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and running_encoders("autoscale") != 1:
        time.sleep(1)
    assert running_encoders("autoscale") == 1, "idle replicas were not removed"


def test_a_backlog_the_router_has_not_placed_adds_a_replica(serve_harness):
    """The replica takes one pack at a time and its router keeps one in flight, so the replica
    never counts more than one pack (at most the largest budget, 4,096 tokens, under the target
    of 5,000): only what the router has not placed, as its packs report it, can add a replica."""
    autoscaling = token_autoscaling(5000, 600)
    url = serve_harness.deploy(
        "configs/local.yaml",
        name="backlog",
        route_prefix="/backlog",
        deployments={
            "EncoderReplica": {"num_replicas": None, "autoscaling_config": autoscaling, "max_ongoing_requests": 1}
        },
        router={"max_wait_ms": 5, "cache_bytes": 0, "packs_in_flight_per_replica": 1},
    )
    assert peak_encoders_under_load(url, "backlog") == 2, "the router's backlog did not add a replica"
