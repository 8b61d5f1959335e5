"""Token autoscaling: the pure replica count, the AutoscalingContext adapter, and the policy as
Ray Serve 2.60 runs it (resolved from config, wrapped with Serve's delays), plus the YAML example.

No Ray cluster: the contexts are real `AutoscalingContext`s built by hand, and the policy goes
through the same two Serve functions `DeploymentAutoscalingState.register` composes.
"""

from __future__ import annotations

import math
import re
import textwrap
from types import SimpleNamespace

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel
from ray.serve import autoscaling_policy as serve_autoscaling_policy
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy
from ray.serve.schema import DeploymentSchema, ServeDeploySchema

from deployments import autoscaling
from deployments.autoscaling import (
    GENERATING_METRIC,
    INFLIGHT_TOKENS_METRIC,
    QUEUED_TOKENS_METRIC,
    AutoscalingPolicyConfigError,
    TokenAutoscalingPolicy,
    desired_replicas,
)

POLICY_PATH = "deployments.autoscaling:TokenAutoscalingPolicy"
NOW_S = 50_000.0
TARGET_TOKENS = 10_000
DEPLOYMENT_ID = DeploymentID(name="EncoderReplica", app_name="encoder")


# ---- the pure replica count -------------------------------------------------------------


def fewest_replicas_holding(total_tokens, target_tokens, min_replicas, max_replicas):
    """Reference by search: the fewest replicas in bounds whose targets cover the load."""
    floor_replicas = max(min_replicas, 1 if total_tokens > 0 else 0)
    for replicas in range(floor_replicas, max_replicas + 1):
        if replicas * target_tokens >= total_tokens:
            return replicas
    return max_replicas


@given(
    st.integers(0, 10_000_000),
    st.integers(1, 100_000),
    st.integers(0, 8),
    st.integers(0, 24),
    st.integers(0, 32),
)
def test_desired_replicas_is_the_fewest_replicas_in_bounds_that_hold_the_load(
    total_tokens, target_tokens, min_replicas, extra_replicas, current_replicas
):
    max_replicas = max(min_replicas + extra_replicas, 1)
    got = desired_replicas(total_tokens, current_replicas, target_tokens, min_replicas, max_replicas)
    assert got == fewest_replicas_holding(total_tokens, target_tokens, min_replicas, max_replicas)


@given(st.integers(0, 1_000_000), st.integers(0, 32), st.integers(0, 4), st.integers(1, 32))
def test_desired_replicas_never_drops_below_current_when_metrics_are_incomplete(
    total_tokens, current_replicas, min_replicas, max_replicas
):
    min_replicas = min(min_replicas, max_replicas)
    got = desired_replicas(
        total_tokens,
        current_replicas,
        TARGET_TOKENS,
        min_replicas,
        max_replicas,
        metrics_complete=False,
    )
    complete = desired_replicas(total_tokens, current_replicas, TARGET_TOKENS, min_replicas, max_replicas)
    assert got == min(max(complete, current_replicas), max_replicas)


def test_desired_replicas_rounds_up_scales_down_and_keeps_one_replica_under_any_load():
    assert desired_replicas(25_000, 1, TARGET_TOKENS, 1, 16) == 3
    assert desired_replicas(20_000, 2, TARGET_TOKENS, 1, 16) == 2
    assert desired_replicas(0, 4, TARGET_TOKENS, 1, 16) == 1
    assert desired_replicas(0, 4, TARGET_TOKENS, 0, 16) == 0
    assert desired_replicas(1, 0, TARGET_TOKENS, 0, 16) == 1
    assert desired_replicas(10**9, 4, TARGET_TOKENS, 1, 16) == 16
    assert desired_replicas(0, 4, TARGET_TOKENS, 3, 16) == 3


# ---- bad kwargs -------------------------------------------------------------------------


@pytest.mark.parametrize("bad_target", [0, -5, 0.0, math.nan, math.inf, True, "20000", None])
def test_bad_target_tokens_per_replica_says_what_to_set(bad_target):
    fix = r"set autoscaling_config\.policy\.policy_kwargs\.target_tokens_per_replica"
    with pytest.raises(AutoscalingPolicyConfigError, match=fix):
        TokenAutoscalingPolicy(target_tokens_per_replica=bad_target)
    with pytest.raises(AutoscalingPolicyConfigError, match=fix):
        desired_replicas(100, 1, bad_target, 1, 4)


@pytest.mark.parametrize(
    "policy_kwargs, error_text",
    [
        ({}, "missing 1 required keyword-only argument: 'target_tokens_per_replica'"),
        ({"target_token_per_replica": 20_000}, "unexpected keyword argument 'target_token_per_replica'"),
        ({"target_tokens_per_replica": -1}, "set autoscaling_config.policy.policy_kwargs"),
    ],
)
def test_serve_rejects_missing_misspelled_or_bad_policy_kwargs_when_it_builds_the_policy(policy_kwargs, error_text):
    policy = AutoscalingPolicy(policy_function=POLICY_PATH, policy_kwargs=policy_kwargs)
    with pytest.raises((TypeError, ValueError), match=re.escape(error_text)):
        _resolve_policy_callable(policy)


# ---- the AutoscalingContext adapter -----------------------------------------------------


def replica_id(index: int) -> ReplicaID:
    return ReplicaID(unique_id=f"replica-{index}", deployment_id=DEPLOYMENT_ID)


def token_series(tokens: float, age_s: float, now_s: float) -> list[TimeStampedValue]:
    """A replica's series: an old burst, then the latest sample `age_s` before `now_s`."""
    return [TimeStampedValue(now_s - age_s - 5.0, 999_999.0), TimeStampedValue(now_s - age_s, tokens)]


def token_context(
    reports,
    *,
    target_num_replicas: int,
    now_s: float = NOW_S,
    total_num_requests: float = 0.0,
    total_queued_requests: float = 0.0,
    policy_state: dict | None = None,
    **config_fields,
) -> AutoscalingContext:
    """A real context; `reports` has one entry per running replica: (queued, inflight, age_s)
    or None for a replica that has not reported."""
    config = AutoscalingConfig(**{"min_replicas": 1, "max_replicas": 16, **config_fields})
    running = [replica_id(index) for index in range(len(reports))]
    raw_metrics = {QUEUED_TOKENS_METRIC: {}, INFLIGHT_TOKENS_METRIC: {}}
    for replica, report in zip(running, reports):
        if report is not None:
            queued_tokens, inflight_tokens, age_s = report
            raw_metrics[QUEUED_TOKENS_METRIC][replica] = token_series(queued_tokens, age_s, now_s)
            raw_metrics[INFLIGHT_TOKENS_METRIC][replica] = token_series(inflight_tokens, age_s, now_s)
    return AutoscalingContext(
        deployment_id=DEPLOYMENT_ID,
        deployment_name=DEPLOYMENT_ID.name,
        app_name=DEPLOYMENT_ID.app_name,
        current_num_replicas=len(running),
        target_num_replicas=target_num_replicas,
        running_replicas=running,
        total_num_requests=total_num_requests,
        total_queued_requests=total_queued_requests,
        aggregated_metrics=None,  # the policy reads raw_metrics; Serve fills both lazily
        raw_metrics=raw_metrics,
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=dict(policy_state or {}),
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now_s,
        config=config,
    )


POLICY = TokenAutoscalingPolicy(target_tokens_per_replica=TARGET_TOKENS)


def test_policy_scales_up_on_the_latest_queued_plus_inflight_tokens():
    ctx = token_context([(20_000, 10_000, 1.0)] * 3, target_num_replicas=3)
    assert POLICY(ctx) == (9, {})


def test_policy_holds_when_the_load_matches_its_replicas():
    ctx = token_context([(6_000, 4_000, 1.0), (0, 10_000, 2.0)], target_num_replicas=2)
    assert POLICY(ctx) == (2, {})


def test_policy_scales_down_when_every_replica_reports_idle():
    ctx = token_context([(0, 0, 1.0)] * 4, target_num_replicas=4)
    assert POLICY(ctx) == (1, {})


def test_policy_stays_within_min_and_max_replicas():
    assert POLICY(token_context([(10**7, 0, 1.0)], target_num_replicas=1, max_replicas=5))[0] == 5
    ctx = token_context([(0, 0, 1.0)] * 4, target_num_replicas=4, min_replicas=2, max_replicas=5)
    assert POLICY(ctx)[0] == 2


def test_policy_holds_rather_than_scaling_down_when_a_replica_has_not_reported():
    ctx = token_context([(0, 0, 1.0), None, (0, 0, 1.0)], target_num_replicas=3)
    assert POLICY(ctx)[0] == 3


def test_policy_treats_a_stale_report_as_no_data():
    # Default look_back_period_s=30 and metrics_interval_s=10: samples older than 30 s are stale.
    stale = (500_000, 0, 31.0)
    assert POLICY(token_context([(0, 0, 1.0), stale], target_num_replicas=2))[0] == 2
    fresh = (500_000, 0, 29.0)
    assert POLICY(token_context([(0, 0, 1.0), fresh], target_num_replicas=2))[0] == 16


def test_policy_scales_up_on_known_load_even_when_another_replica_is_silent():
    ctx = token_context([(45_000, 5_000, 1.0), None], target_num_replicas=2)
    assert POLICY(ctx)[0] == 5


def test_policy_holds_when_no_replica_is_running_yet():
    assert POLICY(token_context([], target_num_replicas=3))[0] == 3
    assert POLICY(token_context([], target_num_replicas=0, min_replicas=0))[0] == 0


def test_policy_keeps_one_replica_while_requests_wait_at_handles():
    ctx = token_context([(0, 0, 1.0)], target_num_replicas=1, min_replicas=0, total_num_requests=3)
    assert POLICY(ctx)[0] == 1


COLOCATED = TokenAutoscalingPolicy(target_tokens_per_replica=TARGET_TOKENS, target_generations_per_replica=8)


def with_generations(ctx: AutoscalingContext, generations: list[tuple[float, float] | None]) -> AutoscalingContext:
    """`ctx` with each running replica's generations in flight, (count, age_s), or None: not reported."""
    ctx.raw_metrics[GENERATING_METRIC] = {
        replica: token_series(report[0], report[1], NOW_S)
        for replica, report in zip(ctx.running_replicas, generations)
        if report is not None
    }
    return ctx


def test_a_colocated_policy_scales_on_generations_where_they_ask_for_more_replicas_than_tokens():
    """Two replicas with 20 generations each at a target of 8 ask for 5, though their tokens ask for 1;
    with more tokens than generations the tokens decide; idle both, one replica stays."""
    light = token_context([(1_000, 0, 1.0)] * 2, target_num_replicas=2)
    assert COLOCATED(with_generations(light, [(20, 1.0), (20, 1.0)]))[0] == 5
    assert POLICY(with_generations(light, [(20, 1.0), (20, 1.0)]))[0] == 1  # without the target: tokens only
    heavy = token_context([(30_000, 20_000, 1.0)] * 2, target_num_replicas=2)
    assert COLOCATED(with_generations(heavy, [(4, 1.0), (4, 1.0)]))[0] == 10
    idle = token_context([(0, 0, 1.0)] * 2, target_num_replicas=2)
    assert COLOCATED(with_generations(idle, [(0, 1.0), (0, 1.0)]))[0] == 1


def test_generations_at_their_target_ask_for_no_extra_replica_whatever_the_targets_ratio():
    """11 generations at a target of 11 are one replica's worth, also where 15000 / 11 is inexact."""
    policy = TokenAutoscalingPolicy(target_tokens_per_replica=15_000, target_generations_per_replica=11)
    idle = token_context([(0, 0, 1.0)] * 2, target_num_replicas=2)
    assert policy(with_generations(idle, [(11, 1.0), (0, 1.0)]))[0] == 1
    assert policy(with_generations(idle, [(11, 1.0), (11, 1.0)]))[0] == 2


def test_requests_queued_at_the_handles_count_as_generations_waiting_for_a_slot():
    """Two replicas full at 16 generations each with 90 more queued at the handles: (32 + 90) / 8 -> 16,
    where the replicas' own count alone asks for 4."""

    def full(queued: float) -> AutoscalingContext:
        ctx = token_context([(0, 0, 1.0)] * 2, target_num_replicas=2, total_queued_requests=queued)
        return with_generations(ctx, [(16, 1.0), (16, 1.0)])

    assert COLOCATED(full(0.0))[0] == 4
    assert COLOCATED(full(90.0))[0] == 16
    assert POLICY(full(90.0))[0] == 1  # without the target, queued requests only keep one replica


def test_a_colocated_policy_holds_while_a_replica_has_not_reported_its_generations():
    idle = token_context([(0, 0, 1.0)] * 2, target_num_replicas=2)
    assert COLOCATED(with_generations(idle, [(0, 1.0), None]))[0] == 2
    assert COLOCATED(with_generations(idle, [(0, 1.0), (0, 31.0)]))[0] == 2  # stale


@pytest.mark.parametrize("bad_target", [0, -1, math.nan, math.inf, True, "24"])
def test_bad_target_generations_per_replica_says_what_to_set(bad_target):
    with pytest.raises(AutoscalingPolicyConfigError, match="target_generations_per_replica must be a finite number"):
        TokenAutoscalingPolicy(target_tokens_per_replica=TARGET_TOKENS, target_generations_per_replica=bad_target)


def test_tokens_the_routers_have_not_placed_count_once_per_router_at_their_latest_figure():
    """Two routers hold work no replica has yet; each replica repeats what the last pack it got
    from each router said. A router counts once: its latest figure by the router's own sequence
    number, whichever replica recorded it last, and only while that replica still reports it."""
    ctx = token_context([(8_000, 2_000, 1.0), (8_000, 2_000, 1.0)], target_num_replicas=2)
    replicas = ctx.running_replicas
    reports = {  # router -> replica -> (tokens not placed, the figure's sequence number, age of the report s)
        "a": {replicas[0]: (30_000, 6, 1.0), replicas[1]: (40_000, 7, 1.0)},  # the latest figure: 40,000
        "b": {replicas[1]: (20_000, 3, 1.0)},
        "dropped": {replicas[0]: (10**6, 9, 5.0)},  # no longer in its replica's newest report
        "gone": {replicas[0]: (10**6, 1, 31.0)},  # stale
        "elsewhere": {replica_id(9): (10**6, 1, 1.0)},  # heard only by a replica not running
    }
    for router, heard in reports.items():
        ctx.raw_metrics[autoscaling.ROUTER_WAITING_PREFIX + router] = {
            replica: token_series(tokens, age_s, NOW_S) for replica, (tokens, _, age_s) in heard.items()
        }
        ctx.raw_metrics[autoscaling.ROUTER_REPORT_PREFIX + router] = {
            replica: token_series(report, age_s, NOW_S) for replica, (_, report, age_s) in heard.items()
        }
    assert POLICY(ctx)[0] == math.ceil((20_000 + 40_000 + 20_000) / TARGET_TOKENS)


# ---- the policy as Serve runs it: resolved from config, wrapped with Serve's delays -----


class FakeClock:
    """Stands in for the `time` module inside ray.serve.autoscaling_policy."""

    def __init__(self, now_s: float):
        self.now_s = now_s

    def time(self) -> float:
        return self.now_s


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock(NOW_S)
    monkeypatch.setattr(serve_autoscaling_policy, "time", SimpleNamespace(time=fake.time))
    return fake


def serve_policy(**policy_kwargs):
    """The callable Serve's controller runs: resolved from config, then wrapped by Serve."""
    config = AutoscalingPolicy(
        policy_function=POLICY_PATH,
        policy_kwargs={"target_tokens_per_replica": TARGET_TOKENS, **policy_kwargs},
    )
    return _apply_autoscaling_config(_resolve_policy_callable(config))


def run_ticks(policy, clock, reports, target_num_replicas, offsets_s, **config_fields):
    """Decisions at `offsets_s` after the start, feeding each decision back as Serve's target."""
    start_s, decisions, policy_state = clock.now_s, [], {}
    for offset_s in offsets_s:
        clock.now_s = start_s + offset_s
        ctx = token_context(
            reports(offset_s),
            target_num_replicas=target_num_replicas,
            now_s=clock.now_s,
            policy_state=policy_state,
            **config_fields,
        )
        target_num_replicas, policy_state = policy(ctx)
        decisions.append(target_num_replicas)
    return decisions


def test_serve_builds_the_class_policy_with_its_policy_kwargs():
    instance = _resolve_policy_callable(
        AutoscalingPolicy(policy_function=POLICY_PATH, policy_kwargs={"target_tokens_per_replica": 123})
    )
    # Serve unpickles the class by value, so it is a copy of TokenAutoscalingPolicy, not the same object.
    assert type(instance).__name__ == "TokenAutoscalingPolicy"
    assert instance.target_tokens_per_replica == 123.0


def test_serve_scales_down_only_after_downscale_delay_s_of_idle(clock):
    decisions = run_ticks(
        serve_policy(),
        clock,
        lambda _: [(0, 0, 1.0)] * 4,
        4,
        [0, 30, 59.9, 60],
        downscale_delay_s=60,
    )
    assert decisions == [4, 4, 4, 1]


def test_serve_restarts_the_downscale_delay_when_load_returns(clock):
    def reports(offset_s):
        return [(10_000, 0, 1.0)] * 4 if offset_s == 40 else [(0, 0, 1.0)] * 4

    decisions = run_ticks(serve_policy(), clock, reports, 4, [0, 40, 70, 100, 129, 130], downscale_delay_s=60)
    assert decisions == [4, 4, 4, 4, 4, 1]


def test_serve_scales_up_only_after_upscale_delay_s_of_load(clock):
    decisions = run_ticks(serve_policy(), clock, lambda _: [(25_000, 0, 1.0)] * 2, 2, [0, 29, 30], upscale_delay_s=30)
    assert decisions == [2, 2, 5]


def test_serve_never_starts_the_downscale_delay_while_a_replica_is_silent(clock):
    decisions = run_ticks(serve_policy(), clock, lambda _: [(0, 0, 1.0), None], 2, [0, 600, 1200], downscale_delay_s=60)
    assert decisions == [2, 2, 2]


def test_serve_scales_to_zero_after_downscale_to_zero_delay_s(clock):
    decisions = run_ticks(
        serve_policy(),
        clock,
        lambda _: [(0, 0, 1.0)],
        1,
        [0, 5],
        min_replicas=0,
        downscale_delay_s=600,
        downscale_to_zero_delay_s=5,
    )
    assert decisions == [1, 0]


# ---- the YAML example in the module docstring ---------------------------------------------


def docstring_yaml() -> list[dict]:
    """The `.. code-block:: yaml` example of deployments/autoscaling.py, parsed."""
    block = autoscaling.__doc__.split(".. code-block:: yaml\n", 1)[1]
    return yaml.safe_load(textwrap.dedent(block))


def assert_known_keys(values: dict, model: type[BaseModel], where: str) -> None:
    """Ray's Serve schemas ignore unknown keys, so check every key against the model's fields."""
    unknown = set(values) - set(model.model_fields)
    assert not unknown, f"{where}: {sorted(unknown)} are not fields of {model.__name__}"


def assert_strictly_valid(deployment: dict) -> AutoscalingConfig:
    """Every key a field Ray 2.60 knows, and the policy built exactly as Serve builds it."""
    assert_known_keys(deployment, DeploymentSchema, "deployment")
    autoscaling_fields = deployment["autoscaling_config"]
    assert_known_keys(autoscaling_fields, AutoscalingConfig, "autoscaling_config")
    assert_known_keys(autoscaling_fields["policy"], AutoscalingPolicy, "autoscaling_config.policy")
    config = AutoscalingConfig.model_validate(autoscaling_fields)
    _resolve_policy_callable(config.policy)  # the kwargs must fit TokenAutoscalingPolicy
    return config


def test_docstring_yaml_validates_with_serves_own_schema():
    [deployment] = docstring_yaml()
    app = {"name": "encoder", "import_path": "deployments.app:build_app", "deployments": [deployment]}
    ServeDeploySchema.model_validate({"applications": [app]})
    config = assert_strictly_valid(deployment)
    assert config.policy.policy_function == POLICY_PATH
    assert config.policy.policy_kwargs == {"target_tokens_per_replica": 20000}
    assert (config.min_replicas, config.max_replicas) == (1, 8)
    assert (config.upscale_delay_s, config.downscale_delay_s) == (30, 600)


@pytest.mark.parametrize(
    "typo",
    [
        lambda d: d["autoscaling_config"].update(upscale_dely_s=30),
        lambda d: d["autoscaling_config"].update(polcy=d["autoscaling_config"].pop("policy")),
        lambda d: d["autoscaling_config"]["policy"].update(
            policy_kwarg=d["autoscaling_config"]["policy"].pop("policy_kwargs")
        ),
    ],
)
def test_a_typo_in_the_yaml_keys_fails_although_ray_alone_would_ignore_it(typo):
    [deployment] = docstring_yaml()
    typo(deployment)
    AutoscalingConfig.model_validate(deployment["autoscaling_config"])  # Ray: silently accepted
    with pytest.raises((AssertionError, TypeError)):
        assert_strictly_valid(deployment)
