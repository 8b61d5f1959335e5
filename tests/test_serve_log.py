"""The benchmark's reading of `serve run`'s log (benchmarks/common/serve_log.py), on lines that real
failed starts wrote (trimmed to the lines that matter)."""

from benchmarks.common.serve_log import ray_address, startup_failure, startup_lines

STARTING = (
    "2026-11-27 00:25:09,527\tINFO worker.py:2029 -- Started a local Ray instance. View the dashboard at "
    "http://127.0.0.1:8265\n"
    'INFO 2026-11-27 00:25:11,493 serve 4116 -- Started Serve in namespace "serve".\n'
    "(ServeController pid=4490) INFO 2026-11-27 00:25:17,587 controller 4490 -- Adding 1 replica to "
    "Deployment(name='EncoderReplica', app='encoder').\n"
)
REPLICA_RAISED = (
    "(ServeController pid=4490) ERROR 2026-11-27 00:25:{s},289 controller 4490 -- Exception in "
    "Replica(id='kem1qtmu', deployment='EncoderReplica', app='encoder'), the replica will be stopped.\n"
    "(ServeController pid=4490) Traceback (most recent call last):\n"
)
ROUTER_READY = (
    "(ServeReplica:encoder:EncoderRouter pid=4652) INFO 2026-11-27 00:25:28,636 encoder_EncoderRouter "
    "1hu4e8hy -- router ready in 8.9 s (before it: imports 1.3 s, Serve's setup 0.1 s; 4 decode workers "
    "+ 1 for small images, HTTP through serve-proxy). "
    "Attach from Python: RAY_AUTH_MODE=token RAY_ADDRESS=192.0.2.2:40719 python, then ray.init(); "
    "serve.get_app_handle('encoder')\n"
)
APP_FAILED = (
    "(ServeController pid=30306) ERROR 2026-11-27 02:02:59,975 controller 30306 -- Deploying app 'encoder' "
    "failed with exception:\n(ServeController pid=30306) invalid application args: `model`: Value error, "
    "unknown preset 'nope' for family 'qwen3-vl'; use one of ['internvl-tiny', 'internvl3-1b']\n"
)


def test_a_starting_service_has_not_failed_and_its_lines_are_found():
    text = STARTING + ROUTER_READY
    assert startup_failure(text, answered=False) is None
    assert ray_address(text) == "192.0.2.2:40719"
    assert startup_lines(text) == {"ray_started_s", "serve_started_s", "encoder_added_s", "router_ready_s"}


def test_a_replica_constructor_failing_three_times_before_any_answer_is_a_failed_start():
    twice = STARTING + REPLICA_RAISED.format(s=28) + REPLICA_RAISED.format(s=34)
    assert startup_failure(twice, answered=False) is None  # Serve still retries that replica
    thrice = twice + REPLICA_RAISED.format(s=40)
    assert startup_failure(thrice, answered=False) == "'Exception in Replica(' 3 times"
    # after the first answer a replica that raises is a failover (a killed replica), not a failed start
    assert startup_failure(thrice, answered=True) is None


def test_the_application_failing_to_deploy_is_a_failed_start_even_after_an_answer():
    text = STARTING + APP_FAILED
    assert startup_failure(text, answered=False) == "failed with exception:"
    assert startup_failure(text, answered=True) == "failed with exception:"
