"""Token-based autoscaling for encoder replicas (a Ray Serve 2.60 custom policy).

One encoder request may be a thumbnail or a minute of video, so Serve's default policy, which
counts requests, misjudges load. Each encoder replica reports
`record_autoscaling_stats() -> {"queued_tokens": ..., "inflight_tokens": ...}` and the tokens
each router had not yet placed on any replica (queued, or waiting for a slot) as its last pack
there said; this policy sums the latest report of every running replica, and each router's
latest figure once, and asks for `ceil(total_tokens / target_tokens_per_replica)` replicas.
A `ColocatedReplica` (`llm.colocate`) also reports the generations it runs (`generating`): with
`target_generations_per_replica` set the policy asks for the larger of the two counts, so the
LLM's load scales the deployment too; requests queued at the handles (generations waiting for an
LLM slot, packs for a pack slot) count as generations.

Picking `target_tokens_per_replica`: a replica holding T tokens drains them in T / throughput
seconds, so set target = tokens/s per replica x acceptable queueing seconds. Take tokens/s per
GPU from the encoder benchmark (at the token budget the deployment runs), multiply by GPUs per
replica, then by the wait you accept. Example: 40,000 tokens/s x 0.5 s -> 20,000. Lower it for
latency (more replicas), raise it for utilisation (fewer, busier replicas).

Serve 2.60 does the rest for custom policies too: it wraps the policy to apply
`upscaling_factor` / `downscaling_factor` and `upscale_delay_s` / `downscale_delay_s` /
`downscale_to_zero_delay_s`, and clips the result to [min_replicas, max_replicas] adjusted for
target capacity. `policy_kwargs` reach only a class policy (its constructor), never a plain
function, hence `TokenAutoscalingPolicy` is a class. A deployment selects it like this (keys
checked against Ray's schema by tests/deployments/test_autoscaling_policy.py):

.. code-block:: yaml

    # under applications[].deployments[] of a Serve config
    - name: EncoderReplica
      autoscaling_config:
        min_replicas: 1
        max_replicas: 8
        upscale_delay_s: 30
        downscale_delay_s: 600
        policy:
          policy_function: deployments.autoscaling:TokenAutoscalingPolicy
          policy_kwargs:
            target_tokens_per_replica: 20000
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.config import AutoscalingContext

QUEUED_TOKENS_METRIC = "queued_tokens"
INFLIGHT_TOKENS_METRIC = "inflight_tokens"
TOKEN_METRICS = (QUEUED_TOKENS_METRIC, INFLIGHT_TOKENS_METRIC)
GENERATING_METRIC = "generating"
"""A colocated replica's generations in flight (its LLM's load)."""
ROUTER_WAITING_PREFIX = "router_waiting_tokens:"
"""Metrics named `<prefix><router id>`: tokens a router has not placed on any replica yet."""
ROUTER_REPORT_PREFIX = "router_report:"
"""Metrics named `<prefix><router id>`: that figure's sequence number at the router."""
ROUTER_REPORT_S = 10.0
"""How long a replica repeats what a router's last pack said (a router with work sends often)."""


def router_waiting_metrics(waiting: Mapping[str, tuple[int, int]]) -> dict[str, float]:
    """A replica's report of the routers' unplaced tokens: per router, the figure its last pack
    here carried and that figure's sequence number."""
    metrics = {}
    for router, (tokens, report) in waiting.items():
        metrics[ROUTER_WAITING_PREFIX + router] = float(tokens)
        metrics[ROUTER_REPORT_PREFIX + router] = float(report)
    return metrics


def routers_waiting_tokens(
    raw_metrics: Mapping[str, Mapping[Any, Sequence[Any]]],
    running_replicas: Sequence[Any],
    now_s: float,
    stale_after_s: float,
) -> float:
    """The routers' unplaced tokens: per router, its latest figure (by sequence number) among
    running replicas' current reports. Several replicas hear from one router: it counts once. A
    figure counts only while it is in its replica's newest report: Serve keeps a dropped metric's
    old samples for the look-back window."""
    total = 0.0
    newest_report = {
        replica_id: series[-1].timestamp
        for replica_id, series in raw_metrics.get(QUEUED_TOKENS_METRIC, {}).items()
        if series
    }
    for name, by_replica in raw_metrics.items():
        if not name.startswith(ROUTER_WAITING_PREFIX):
            continue
        reports = raw_metrics.get(ROUTER_REPORT_PREFIX + name.removeprefix(ROUTER_WAITING_PREFIX), {})
        latest = None  # (sequence number, tokens)
        for replica_id in running_replicas:
            tokens, report = by_replica.get(replica_id), reports.get(replica_id)
            if not tokens or not report or now_s - tokens[-1].timestamp > stale_after_s:
                continue
            if tokens[-1].timestamp < newest_report.get(replica_id, tokens[-1].timestamp):
                continue  # the replica no longer reports it
            if latest is None or report[-1].value > latest[0]:
                latest = (report[-1].value, tokens[-1].value)
        if latest is not None:
            total += max(float(latest[1]), 0.0)
    return total


class AutoscalingPolicyConfigError(ValueError):
    """A policy kwarg that cannot work; the message says what to set."""


@dataclass(frozen=True)
class TokenLoad:
    """A load over a deployment's running replicas."""

    total: float
    """The summed metrics (queued plus in-flight tokens, or generations) over replicas with fresh reports."""
    replicas_without_data: int
    """Running replicas whose report of those metrics is missing or stale (counted as 0)."""


def positive_number(value: Any) -> bool:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return is_number and math.isfinite(value) and value > 0


def check_target_tokens_per_replica(target_tokens_per_replica: Any) -> float:
    """The target as a float; raises AutoscalingPolicyConfigError unless it is finite and > 0."""
    if positive_number(target_tokens_per_replica):
        return float(target_tokens_per_replica)
    raise AutoscalingPolicyConfigError(
        f"target_tokens_per_replica must be a finite number of tokens > 0, got "
        f"{target_tokens_per_replica!r}; set autoscaling_config.policy.policy_kwargs."
        "target_tokens_per_replica to the benchmark's tokens/s per replica x the queueing "
        "seconds you accept (e.g. 40000 x 0.5 = 20000)"
    )


def check_target_generations_per_replica(target_generations_per_replica: Any) -> float | None:
    """None (the LLM's load not counted) or the target as a float; raises AutoscalingPolicyConfigError
    unless it is finite and > 0."""
    if target_generations_per_replica is None:
        return None
    if positive_number(target_generations_per_replica):
        return float(target_generations_per_replica)
    raise AutoscalingPolicyConfigError(
        f"target_generations_per_replica must be a finite number of generations > 0, got "
        f"{target_generations_per_replica!r}; set it to a colocated replica's requests/s at your TTFT "
        "target x their mean seconds (docs/autoscaling.md: about 11 with many images, 30 with little vision)"
    )


def desired_replicas(
    total_tokens: float,
    current_replicas: int,
    target_tokens_per_replica: float,
    min_replicas: int,
    max_replicas: int,
    *,
    metrics_complete: bool = True,
    other_replicas: int = 0,
) -> int:
    """Replicas needed for `total_tokens` at `target_tokens_per_replica` each, or `other_replicas`
    (another load's count) where more, within bounds.

    `current_replicas` is the count Serve targets now; when `metrics_complete` is False some
    replicas did not report, so the answer never drops below it (hold rather than scale down
    on missing data), though known load may still scale up. Any load keeps at least one
    replica; `max_replicas` always wins.
    """
    target_tokens_per_replica = check_target_tokens_per_replica(target_tokens_per_replica)
    assert min_replicas <= max_replicas, (min_replicas, max_replicas)
    # ceil keeps >= 1 replica under any load, whatever min_replicas says.
    needed_replicas = max(math.ceil(max(total_tokens, 0.0) / target_tokens_per_replica), other_replicas)
    if not metrics_complete:
        needed_replicas = max(needed_replicas, current_replicas)
    return min(max(needed_replicas, min_replicas), max_replicas)


def sum_token_load(
    raw_metrics: Mapping[str, Mapping[Any, Sequence[Any]]],
    running_replicas: Sequence[Any],
    now_s: float,
    stale_after_s: float,
    metric_names: Sequence[str] = TOKEN_METRICS,
) -> TokenLoad:
    """Sum each running replica's latest token samples; missing or stale samples count 0.

    `raw_metrics` is `AutoscalingContext.raw_metrics`: metric name -> replica id -> time series
    of `TimeStampedValue(timestamp, value)`, oldest first, as the replica recorded them. The
    latest sample, not `aggregated_metrics`: a window mean lags a burst by up to
    look_back_period_s and cannot tell an idle replica from a silent one; Serve's delays
    already debounce. `metric_names`: what is summed (the token metrics, or `GENERATING_METRIC`).
    """
    total = 0.0
    replicas_without_data = 0
    for replica_id in running_replicas:
        replica_complete = True
        for metric_name in metric_names:
            series = raw_metrics.get(metric_name, {}).get(replica_id)
            # Clock skew between replica and controller can make the age negative: still fresh.
            if not series or now_s - series[-1].timestamp > stale_after_s:
                replica_complete = False
                continue
            total += max(float(series[-1].value), 0.0)
        replicas_without_data += not replica_complete
    return TokenLoad(total, replicas_without_data)


def staleness_limit_s(config: Any) -> float:
    """How old a replica's newest sample may be before it counts as no data.

    A healthy replica's newest sample is at most one record interval plus one push interval old
    (both <= metrics_interval_s); the replica itself drops samples older than
    look_back_period_s. Allow whichever is longer, with slack for a skipped push.
    """
    return max(config.look_back_period_s, 3 * config.metrics_interval_s)


class TokenAutoscalingPolicy:
    """Ray Serve 2.60 autoscaling policy: replicas = ceil(tokens / target_tokens_per_replica), or
    ceil(generations / target_generations_per_replica) where that is more and the target is set.

    Serve instantiates the class once with `policy_kwargs` and calls the instance with an
    `AutoscalingContext` on every control-loop tick. It returns `(replicas, policy_state)`;
    Serve then applies scaling factors, delays and bounds (see the module docstring).
    """

    def __init__(self, *, target_tokens_per_replica: float, target_generations_per_replica: float | None = None):
        self.target_tokens_per_replica = check_target_tokens_per_replica(target_tokens_per_replica)
        self.target_generations_per_replica = check_target_generations_per_replica(target_generations_per_replica)

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        now_s = ctx.current_time if ctx.current_time is not None else time.time()
        stale_after_s = staleness_limit_s(ctx.config)
        raw_metrics = ctx.raw_metrics or {}  # Serve builds it anew on each read
        load = sum_token_load(raw_metrics, ctx.running_replicas, now_s, stale_after_s)
        # Tokens the routers have not placed on a replica (queued, or waiting for a slot): no replica counts them.
        waiting = routers_waiting_tokens(raw_metrics, ctx.running_replicas, now_s, stale_after_s)
        missing, llm_replicas = load.replicas_without_data, 0
        if self.target_generations_per_replica is not None:  # the LLM's load: generations run and waiting
            llm = sum_token_load(raw_metrics, ctx.running_replicas, now_s, stale_after_s, (GENERATING_METRIC,))
            generations = llm.total + max(ctx.total_queued_requests or 0.0, 0.0)
            llm_replicas = math.ceil(generations / self.target_generations_per_replica)
            missing = max(missing, llm.replicas_without_data)
        # No running replica means no report at all (say, all restarting): hold, too.
        metrics_complete = bool(ctx.running_replicas) and missing == 0
        # Requests waiting at handles are load even before a replica has counted their tokens.
        has_requests = (ctx.total_num_requests or 0) > 0
        min_replicas = max(ctx.capacity_adjusted_min_replicas, 1 if has_requests else 0)
        replicas = desired_replicas(
            load.total + waiting,
            ctx.target_num_replicas,
            self.target_tokens_per_replica,
            min(min_replicas, ctx.capacity_adjusted_max_replicas),
            ctx.capacity_adjusted_max_replicas,
            metrics_complete=metrics_complete,
            other_replicas=llm_replicas,
        )
        # Serve keeps its own delay bookkeeping in policy_state and merges it back in.
        return replicas, {}
