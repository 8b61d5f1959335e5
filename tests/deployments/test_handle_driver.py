"""The Python handle from a separate driver process, attached as the README says (RAY_ADDRESS): many
requests without a crash, results held after their references are dropped and collected, and equal
to what HTTP safetensors returns for the same items."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import ray

from tests.serve_harness import ROOT

DRIVER = r"""
import asyncio, gc, io, json, sys
import httpx, numpy as np, ray, torch
from PIL import Image
from ray import serve
from safetensors.torch import load

url, app, requests = sys.argv[1], sys.argv[2], int(sys.argv[3])
ray.init(log_to_driver=False)  # RAY_ADDRESS names the cluster, as the router's log says
handle = serve.get_app_handle(app)
rng = np.random.default_rng(0)
files = []
for size in [(64, 48), (120, 96), (200, 160), (96, 300)]:
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).save(buffer, "PNG")
    files.append(buffer.getvalue())

async def main():
    kept, done = [], 0
    async def caller(worker):
        nonlocal done
        for n in range(worker, requests, 16):
            items = [files[n % 4], files[(n + 1) % 4]][: 1 + n % 2]
            results = await handle.encode.remote(items, cache=False)
            await asyncio.gather(*(r.fetch() for r in results))
            if n < 8:
                kept.append((items, [(r.embedding, r.deepstack) for r in results]))
            done += 1
    await asyncio.gather(*(caller(w) for w in range(16)))
    return kept, done

kept, done = asyncio.run(main())
gc.collect()  # the results and their references are gone; the tensors must stay readable
worst = 0.0
with httpx.Client(timeout=120) as client:
    for items, tensors in kept:
        body = {"items": [{"type": "image", "image": __import__("base64").b64encode(f).decode()} for f in items],
                "encoding_format": "safetensors", "cache": False}
        reply = load(client.post(url + "/v1/encode", json=body).content)
        for i, (embedding, deepstack) in enumerate(tensors):
            pairs = [(embedding, reply[f"{i}.embedding"])]
            if deepstack is not None:
                pairs += [(deepstack[k], reply[f"{i}.deepstack.{k}"]) for k in range(deepstack.shape[0])]
            for ours, http in pairs:
                diff = (ours.float() - http.float()).abs().max() / http.float().abs().max().clamp_min(1e-6)
                worst = max(worst, diff.item())
print(json.dumps({"requests": done, "kept": len(kept), "worst": worst}))
"""


def run_driver(serve_harness, app: str, url: str, requests: int) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, url, app, str(requests)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"driver exited with {done.returncode}:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "device,requests,tolerance",
    [("cpu", 200, 1e-5), pytest.param("cuda", 1000, 2e-2, marks=pytest.mark.gpu)],
)
def test_handle_from_a_separate_driver_process(device, requests, tolerance, serve_harness):
    app = f"driver-{device}"
    options = {"ray_actor_options": {"num_cpus": 0, "num_gpus": 1 if device == "cuda" else 0}}
    url = serve_harness.deploy(
        "configs/local.yaml",
        name=app,
        route_prefix=f"/{app}",
        deployments={"EncoderReplica": options},
        model={"device": device},
    )
    summary = run_driver(serve_harness, app, url, requests)
    assert summary["requests"] == requests and summary["kept"] == 8
    assert summary["worst"] <= tolerance, summary
