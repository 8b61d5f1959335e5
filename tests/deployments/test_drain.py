"""Scale-down loses nothing: an encoder replica that Serve stops while callers hold results it stored
waits until they have read them, takes no new packs meanwhile, and exits once they are released."""

from __future__ import annotations

import gc
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from ray import serve
from ray.core.generated.common_pb2 import Address

from deployments.wire import item_from_wire
from models import from_preset
from tests.deployments.media_helpers import image_file, pattern, reference_image
from tests.helpers import reference_tower, relative_error

APP = "drain"
SHUTDOWN_BUDGET_S = 60
"""The encoder deployment's `graceful_shutdown_timeout_s` here: far longer than the test reads take,
so a replica that exits early did so because its results were released, not on the timeout."""
IMAGES = [image_file(pattern(256 + 32 * (i % 4), 256, seed=i), "PNG") for i in range(12)]


@pytest.fixture(scope="module")
def references():
    encoder = from_preset("qwen3-vl-tiny")
    tower = reference_tower(encoder)
    return [reference_image(encoder, tower, data)[0] for data in IMAGES]


def deploy(serve_harness, replicas: int, wait: bool = True) -> str:
    return serve_harness.deploy(
        "configs/local.yaml",
        name=APP,
        route_prefix="/drain",
        wait=wait,
        deployments={
            "EncoderReplica": {
                "num_replicas": replicas,
                "graceful_shutdown_wait_loop_s": 0.5,
                "graceful_shutdown_timeout_s": SHUTDOWN_BUDGET_S,
            }
        },
        router={"max_wait_ms": 2, "handle_hold_s": 1.0},
    )


def owner(ref) -> str:
    """The worker id of the process that stored the object (an encoder replica)."""
    address = Address()
    address.ParseFromString(ref.owner_address())
    return address.worker_id.hex()


def encoder_states() -> dict[str, int]:
    deployment = serve.status().applications[APP].deployments["EncoderReplica"]
    return {str(state).rsplit(".", 1)[-1]: count for state, count in deployment.replica_states.items()}


def wait_for(condition, timeout_s: float, what: str) -> float:
    """Seconds until `condition()` held (polled); fails naming `what` after `timeout_s`."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} not within {timeout_s} s: {encoder_states()}"
        time.sleep(0.2)
    return time.monotonic() - start


def encode_all(handle, picks: list[int]) -> list:
    """One request per pick, all in flight at once; every other one with `as_refs`."""
    with ThreadPoolExecutor(len(picks)) as pool:
        calls = [
            pool.submit(lambda i, p: handle.encode.remote([IMAGES[p]], as_refs=i % 2 == 1).result(), i, p)
            for i, p in enumerate(picks)
        ]
        return [call.result()[0] for call in calls]


def read(result):
    """The embedding, as the caller reads it: `EncodeResult.embedding`, or an `ItemRef`'s reference."""
    if hasattr(result, "embedding"):
        return result.embedding
    return item_from_wire(ray.get(result.ref)).tokens


def test_a_replica_scaled_down_waits_until_its_stored_results_are_read(serve_harness, references):
    deploy(serve_harness, replicas=2)
    handle = serve.get_app_handle(APP)
    held: list = []  # (pick, result): read only after the scale-down began
    for round_ in range(10):  # until both replicas hold results of ours
        picks = [(round_ * 5 + i) % len(IMAGES) for i in range(12)]
        held += zip(picks, encode_all(handle, picks))
        if len({owner(result.ref) for _, result in held}) == 2:
            break
    owners = {owner(result.ref) for _, result in held}
    assert len(owners) == 2, "the requests never reached both replicas"

    deploy(serve_harness, replicas=1, wait=False)  # a config update: Serve stops one replica
    wait_for(lambda: encoder_states().get("STOPPING", 0) == 1, 60, "a replica stopping")
    time.sleep(3)  # past Serve's wait for ongoing packs (0.5 s), the router's hold (1 s) and cache check (1 s)
    assert encoder_states().get("STOPPING", 0) == 1  # still there: it waits for our unread results

    for pick, result in held:  # every caller reads its result, from either replica
        assert relative_error(read(result), references[pick]) <= 1e-4

    fresh = encode_all(handle, list(range(6)))  # new requests: the replica that stays takes them
    staying = {owner(result.ref) for result in fresh}
    assert len(staying) == 1 and staying <= owners, (staying, owners)
    for pick, result in enumerate(fresh):
        assert relative_error(read(result), references[pick]) <= 1e-4

    del held  # every result of the stopping replica released: it exits well before its budget
    gc.collect()
    released_s = wait_for(lambda: "STOPPING" not in encoder_states(), SHUTDOWN_BUDGET_S / 2, "the stop")
    assert encoder_states() == {"RUNNING": 1}
    print(f"stopping replica exited {released_s:.1f} s after its results were released")
