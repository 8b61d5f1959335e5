"""A replica told to warm up before it takes traffic (`replica.warm_up_before_ready`) is at full speed
when Serve first routes to it, and its log says where the warm-up's seconds went, before its ready line."""

from __future__ import annotations

from pathlib import Path

import ray

from tests.helpers import model_detail

APP = "warmfirst"


def replica_log_lines(app: str) -> list[str]:
    """The lines of the application's encoder replicas' Serve logs (this session's)."""
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    return [line for path in sorted(logs.glob(f"replica_{app}_EncoderReplica_*.log")) for line in path.open()]


def test_a_replica_that_warms_up_first_is_at_full_speed_when_it_is_ready(serve_harness):
    url = serve_harness.deploy(
        "configs/local.yaml", name=APP, route_prefix="/warmfirst", replica={"warm_up_before_ready": "always"}
    )
    described = model_detail(url)["replica"]  # the replica's own description, asked of it now
    lines = replica_log_lines(APP)
    ready = [i for i, line in enumerate(lines) if "encoder replica ready in" in line]
    summary = [i for i, line in enumerate(lines) if "warm-up seconds (before taking traffic)" in line]
    assert len(ready) == 1 and len(summary) == 1, lines[-20:]
    assert summary[0] < ready[0]  # the constructor returned only once the warm-up had ended
    assert "at full speed" in lines[ready[0]]
    assert "stages: prepare" in lines[summary[0]] and "slowest steps:" in lines[summary[0]]
    assert described["warmup"]["full_speed"] and described["warmup"]["stage"] == "done"
