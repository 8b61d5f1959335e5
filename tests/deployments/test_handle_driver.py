"""The Python handle from an ordinary driver process, attached as the README says (RAY_ADDRESS):
one that never imports torch itself and makes its handle inside `asyncio.run`, reading results
after `fetch()` and straight through `.embedding`, then synchronously with a handle made outside
any loop. Every call completes (a hang dumps the driver's stacks and fails), torch is not imported
while results are deserialized, results stay readable after their references are collected, and
they equal what HTTP safetensors returns for the same items."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import ray

from tests.serve_harness import ROOT

DRIVER = r"""
import asyncio, base64, faulthandler, gc, io, json, sys, time
faulthandler.dump_traceback_later(float(sys.argv[6]), exit=True)  # a hang prints every thread's stack
import httpx, numpy as np, ray
from PIL import Image
from ray import serve

url, app = sys.argv[1], sys.argv[2]
calls, concurrency, sync_calls = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ray.init(log_to_driver=False)  # RAY_ADDRESS names the cluster, as the router's log says
rng = np.random.default_rng(0)
files = []
for size in [(64, 48), (120, 96), (200, 160), (96, 300)]:
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).save(buffer, "PNG")
    files.append(buffer.getvalue())

def items_for(n):
    return [files[n % 4], files[(n + 1) % 4]][: 1 + n % 2]

def read(results):
    return [(r.embedding, r.deepstack) for r in results]

async def main():
    handle = serve.get_app_handle(app)  # made inside the running loop
    first = await handle.encode.remote([files[0]], cache=False)
    await first[0].ref  # the item's arrays, deserialized by Ray: no torch needed for that
    torch_before_read = "torch" in sys.modules
    first[0].embedding
    kept, done = [], 0

    async def caller(worker):
        nonlocal done
        for n in range(worker, calls, concurrency):
            items = items_for(n)
            results = await handle.encode.remote(items, cache=False)
            if n % 2:
                await asyncio.gather(*(r.fetch() for r in results))
            tensors = read(results)  # after fetch() (odd n) or straight from the object store (even n)
            if n < 8:
                kept.append((items, tensors))
            done += 1

    await asyncio.gather(*(caller(w) for w in range(concurrency)))
    return torch_before_read, kept, done

start = time.perf_counter()
torch_before_read, kept, done = asyncio.run(main())
handle = serve.get_app_handle(app)  # made outside any loop
for n in range(sync_calls):
    items = items_for(n)
    tensors = read(handle.encode.remote(items, cache=False).result())
    if n < 4:
        kept.append((items, tensors))
    done += 1
seconds = time.perf_counter() - start
gc.collect()  # the results and their references are gone; the tensors must stay readable

from safetensors.torch import load
worst = 0.0
with httpx.Client(timeout=120) as client:
    for items, tensors in kept:
        body = {"items": [{"type": "image", "image": base64.b64encode(f).decode()} for f in items],
                "encoding_format": "safetensors", "cache": False}
        reply = load(client.post(url + "/v1/encode", json=body).content)
        for i, (embedding, deepstack) in enumerate(tensors):
            pairs = [(embedding, reply[f"{i}.embedding"])]
            if deepstack is not None:
                pairs += [(deepstack[k], reply[f"{i}.deepstack.{k}"]) for k in range(deepstack.shape[0])]
            for ours, http in pairs:
                diff = (ours.float() - http.float()).abs().max() / http.float().abs().max().clamp_min(1e-6)
                worst = max(worst, diff.item())
summary = {"calls": done, "kept": len(kept), "worst": worst, "seconds": round(seconds, 1),
           "torch_before_read": torch_before_read}
print(json.dumps(summary))
"""


def run_driver(app: str, url: str, calls: int, concurrency: int, sync_calls: int, hang_s: float, log=None) -> dict:
    """Run the driver in a fresh process attached to the test's cluster; its summary (fails on a hang,
    with the driver's stacks). `log`: a path that keeps the driver's output."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONPATH": path}
    args = [url, app, str(calls), str(concurrency), str(sync_calls), str(hang_s)]
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, *args], env=env, capture_output=True, text=True, timeout=hang_s + 120
    )
    if log is not None:
        log.write_text(f"{' '.join(args)}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}")
    assert done.returncode == 0, f"driver exited with {done.returncode}:\n{done.stderr[-6000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "device,calls,concurrency,tolerance,hang_s",
    [("cpu", 300, 8, 1e-5, 600), pytest.param("cuda", 1000, 32, 2e-2, 240, marks=pytest.mark.gpu)],
)
def test_an_ordinary_asyncio_driver_gets_every_result(device, calls, concurrency, tolerance, hang_s, serve_harness):
    app = f"driver-{device}"
    options = {"ray_actor_options": {"num_cpus": 0, "num_gpus": 1 if device == "cuda" else 0}}
    url = serve_harness.deploy(
        "configs/local.yaml",
        name=app,
        route_prefix=f"/{app}",
        deployments={"EncoderReplica": options},
        model={"device": device},
    )
    results_dir = os.environ.get("RESULTS_DIR")
    log = None if results_dir is None else ROOT.joinpath(results_dir, f"handle_driver_{device}.log")
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    summary = run_driver(app, url, calls, concurrency, sync_calls=100, hang_s=hang_s, log=log)
    assert summary["calls"] == calls + 100 and summary["kept"] == 12, summary
    assert not summary["torch_before_read"], "reading a result's arrays imported torch inside Ray's deserialization"
    assert summary["worst"] <= tolerance, summary
