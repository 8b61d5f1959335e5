"""The servers the deployment comparison starts, each as a user would run it on two GPUs, and how to
tell when one is ready and to stop it: ours (`serve run` of an E/PD config), vLLM with data
parallelism 2, and vLLM's own encoder disaggregation (an encoder-only instance that stores each
image's embedding through its example connector, a prefill-decode instance that loads it)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
OURS = {"ours": "epd-vllm.yaml", "ours-colocated": "epd-vllm-colocated.yaml"}
"""Our systems' configs: encoder and LLM on a GPU each, or both on every GPU (`llm.colocate`)."""
SYSTEMS = (*OURS, "vllm-dp2", "vllm-epd")
MAX_MODEL_LEN = 16384
VLLM_ARGS = [
    "--served-model-name", "model", "--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", "0.85",
    "--limit-mm-per-prompt", json.dumps({"image": 4}),
    "--compilation-config", json.dumps({"cudagraph_mm_encoder": True}),
]  # fmt: skip
"""Every vLLM server's: ViT CUDA graphs on (the V1 model runner, `VLLM_USE_V2_MODEL_RUNNER=0`, replays them)."""
EPD_ENCODER_ARGS = [
    "--mm-encoder-only",
    "--enforce-eager",
    "--no-enable-prefix-caching",
    "--max-num-batched-tokens",
    "65536",
]
"""vLLM's encoder-only instance as its disaggregated-encoder guide asks (`--enforce-eager` and no prefix caching
required, which also turns its ViT graphs off; with prefix caching its scheduler asserts on a model without KV)."""


@dataclass
class Running:
    """A started system: its processes (each in its own group), the chat URL, the model name, the fields
    every request adds, and for vLLM's EPD the encoder instance each request visits first."""

    processes: list[subprocess.Popen]
    url: str
    model: str = ""
    extra: dict = field(default_factory=dict)
    encode_url: str | None = None
    serve_log: Path | None = None
    """Ours: `serve run`'s output, where a failed deployment shows (the process itself keeps running)."""


def deploy_failure(log: Path | None) -> str | None:
    """Why Serve failed to deploy the application, where `serve run`'s log says it did."""
    if log is None or not log.exists():
        return None
    lines = log.read_text(errors="replace").splitlines()
    for index, line in enumerate(lines):
        if "Deploying app" in line and "failed" in line:
            reason = lines[index + 1] if index + 1 < len(lines) else line
            return re.sub(r"\x1b\[[0-9;]*m|\(ServeController pid=\d+\)", "", reason).strip()
    return None


def ours_config(base: Path, checkpoint: str, out: Path, port: int, system: str, max_tokens: int) -> Path:
    """`base` (an E/PD config) serving the checkpoint on both sides, answers of `max_tokens` at most, and
    vLLM's `max_model_len` the vLLM servers' (a config's own smaller one, a small checkpoint's, is kept)."""
    config = yaml.safe_load(base.read_text())
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    args["model"]["path"] = args["llm"]["path"] = checkpoint
    if args["llm"].get("engine") == "vllm":
        engine = args["llm"].setdefault("engine_kwargs", {})
        engine["max_model_len"] = min(MAX_MODEL_LEN, engine.get("max_model_len") or MAX_MODEL_LEN)
    args["llm"]["max_tokens"] = max_tokens
    path = out / f"{system}-config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def vllm_server(checkpoint: str, port: int, more: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", checkpoint, "--port", str(port)]
    env = {**env, "VLLM_USE_V2_MODEL_RUNNER": "0"}  # vLLM 0.26's V2 runner never replays encoder graphs
    return popen(command + VLLM_ARGS + more, env, log_path)


def popen(command: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    logfile = open(log_path, "w")
    return subprocess.Popen(
        command, stdout=logfile, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
    )


def start_system(system: str, args, out: Path, log, probe_body) -> Running:
    """Starts `system` and waits until it answers a chat with an image (ours: every encoder graph live)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if system in OURS:
        config = ours_config(
            args.config or ROOT / "configs" / OURS[system], args.checkpoint, out, 8000, system, args.max_tokens
        )
        command = [sys.executable, "-m", "ray.serve.scripts", "run", str(config)]
        log_path = out / f"server-{system}.log"
        running = Running([popen(command, env, log_path)], "http://127.0.0.1:8000", serve_log=log_path)
    elif system == "vllm-dp2":
        server = vllm_server(args.checkpoint, 8100, ["--data-parallel-size", "2"], env, out / f"server-{system}.log")
        running = Running([server], "http://127.0.0.1:8100", extra={"return_token_ids": True})
    else:  # vllm-epd: encoder-only instance on GPU 0, prefill-decode on GPU 1, embeddings through shared memory
        storage = f"/dev/shm/vllm-ec-{os.getpid()}"
        transfer = {"ec_connector": "ECExampleConnector", "ec_connector_extra_config": {"shared_storage_path": storage}}
        encoder = vllm_server(
            args.checkpoint,
            8200,
            [*EPD_ENCODER_ARGS, "--ec-transfer-config", json.dumps({**transfer, "ec_role": "ec_producer"})],
            {**env, "CUDA_VISIBLE_DEVICES": "0"},
            out / f"server-{system}-encoder.log",
        )
        decoder = vllm_server(
            args.checkpoint,
            8100,
            ["--ec-transfer-config", json.dumps({**transfer, "ec_role": "ec_consumer"})],
            {**env, "CUDA_VISIBLE_DEVICES": "1"},
            out / f"server-{system}.log",
        )
        running = Running([encoder, decoder], "http://127.0.0.1:8100", extra={"return_token_ids": True})
        running.encode_url = "http://127.0.0.1:8200"
    try:
        running.model = wait_ready(system, running, args.startup_timeout, log, probe_body)
    except BaseException:
        stop_system(running)
        raise
    return running


def encode_body(body: dict) -> dict:
    """What vLLM's EPD proxy sends its encoder instance first: the request, one token, not streamed."""
    return {k: v for k, v in body.items() if k not in ("stream", "stream_options")} | {"max_tokens": 1}


def wait_ready(system: str, running: Running, timeout: float, log, probe_body) -> str:
    """The chat model's name once the system answers a chat with an image (`probe_body(model)`)."""
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        for process in running.processes:
            if process.poll() is not None:
                raise RuntimeError(f"{system}: a server exited with {process.returncode}")
        if failure := deploy_failure(running.serve_log):
            raise RuntimeError(f"{system}: Serve could not deploy it: {failure}")
        try:
            ids = [m["id"] for m in httpx.get(f"{running.url}/v1/models", timeout=5).json()["data"]]
            body = probe_body(ids[-1])
            if running.encode_url is not None:
                httpx.post(f"{running.encode_url}/v1/chat/completions", json=encode_body(body), timeout=60)
            if httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=60).status_code == 200:
                if system not in OURS or encoder_warm(running.url, ids[0]):
                    log(f"{system}: ready after {time.monotonic() - start:.0f} s")
                    return ids[-1]
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(2)
    raise TimeoutError(f"{system}: not ready within {timeout} s")


def encoder_warm(url: str, encoder_id: str) -> bool:
    import httpx

    warmup = httpx.get(f"{url}/v1/models/{encoder_id}", timeout=10).json().get("encoder", {}).get("replica_warmup", {})
    return bool(warmup) and all(w.get("full_speed") for w in warmup.values())


def stop_system(running: Running) -> None:
    for process in running.processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
    for process in running.processes:
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def keep_serve_logs(system: str, out: Path, sessions: Path = Path("/tmp/ray/session_latest")) -> Path | None:
    """Our systems' Serve logs (controller, proxy, each replica) as one archive beside the results, so a
    failed rate can be read after the host is gone; None for vLLM's systems or where Ray kept none."""
    logs = sessions / "logs" / "serve"
    if system not in OURS or not logs.is_dir():
        return None
    archive = out / f"serve-logs-{system}.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(logs, arcname=f"serve-logs-{system}")
    return archive


def prefill_budgets(system: str, out: Path) -> list[int]:
    """The `max_num_batched_tokens` every vLLM engine of `system` logged at start (its servers' logs;
    ours: `serve run`'s, which carries the replicas'), so that a comparison shows its engines' scheduler
    budgets side by side: an engine with a smaller one prefills long prompts in more steps."""
    found = []
    for log in (out / f"server-{system}.log", out / f"server-{system}-encoder.log"):  # vLLM's EPD: two servers
        if log.exists():
            found += [int(m) for m in re.findall(r"max_num_batched_tokens=(\d+)", log.read_text(errors="replace"))]
    return found
