"""vLLM fed our encoder's embeddings through configs/epd-vllm.yaml generates what vLLM generates from the pixels.

One checkpoint serves both: `configs/epd-vllm.yaml` (our encoder replica, vLLM fed its embeddings by
reference) and vLLM run its own way offline (`vllm.LLM`, its processor and vision tower on the
pixels), for one image, three images and an 8-frame clip. Settings: `gpu` (marked gpu): the
Qwen3-VL-8B random-weight checkpoint at `$VLLM_PARITY_CHECKPOINT` (written here on the GPU when
unset), bf16, 64 greedy tokens; `cpu`: the tiny checkpoint in vLLM-CPU's shape, float32 (run by
`.ci/vllm`).

Three checks. (1) The offline engine fed our served embeddings gives the served ids exactly (same
embeddings, same engine: the handoff alone). (2) The prompt's logprobs from the first vision token
on, fed our embeddings, lie several times closer to vLLM's own from pixels than fed wrong versions
of ours (deepstack zeroed; two same-size images swapped): random weights make greedy continuations
repetitive, and a broken handoff fails here even where ids would not. (3) The served greedy ids
equal vLLM's own from pixels, or part from them only at a near-tie: where vLLM's own top choice
leads the token served by at most twice the largest prompt-logprob shift our embeddings make. In
float32 the ids are equal; in bf16 the two towers round differently, and a random model's
continuation meets near-ties (vLLM-CPU 0.26, the tiny checkpoint in bf16: the three images' ids
part at step 20, where vLLM's own top two differ by 0.008 nats, the clip's at step 3, an exact tie,
while (1) and (2) hold, the latter by 100x). `ids_equal` and `divergence` in the record say which.
In float32 (`cpu`, and `gpu` with `VLLM_PARITY_DTYPE=float32`) (3) asks for equal ids outright.
Records go to `$RESULTS_DIR/vllm_parity_<setting>[_float32].json`.
"""

from __future__ import annotations

import functools
import gc
import io
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

if os.environ.get("REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (an ImportError here fails the vLLM CI step instead of skipping)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed; the vLLM CI step (.ci/vllm) installs it")

import numpy as np
import ray
import torch
from openai import OpenAI
from PIL import Image
from ray import serve
from transformers import AutoProcessor

from benchmarks.common.workload import photo
from deployments.llm.vllm_engine import multi_modal_data
from deployments.wire import GenerateRequest, item_to_wire
from models.protocol import ItemOutput
from models.tiny_checkpoint import save_random_vlm, save_tiny_vlm
from tests.deployments.test_epd import openai_messages
from tests.serve_harness import REMOVE, UNCOMPILED

RESULTS_DIR = Path(os.environ.get("RESULTS_DIR", "/tmp/vlm-encoder-results"))  # not the checkout
MAX_TOKENS = 64
VIDEO_FPS = 4.0
"""Frame rate of the test clip (Qwen3-VL's prompt names each frame group's time)."""
CLOSER = 4.0
"""How many times closer to vLLM's own prompt logprobs ours must be than the wrong embeddings'."""
TEMPORAL_PATCH = 2
"""Qwen3-VL's frames per temporal patch (its video timestamps are per patch)."""
TOP_LOGPROBS = 5
"""Logprobs kept per step of vLLM's own greedy generation (where the served ids part from it)."""


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like image (the benchmarks' workload), decoded: both sides get the same pixels."""
    return Image.open(io.BytesIO(photo(np.random.default_rng(seed), width, height))).convert("RGB")


@dataclass
class Setting:
    name: str
    device: str
    dtype: str
    engine_kwargs: dict
    graphs: dict = field(default_factory=dict)


PROFILE_SMALL = {"image": {"count": 3, "width": 448, "height": 448}, "video": {"count": 1, "num_frames": 8}}
"""vLLM's startup profiles its encoder on these (on CPU the largest image would take minutes)."""
CPU_ENGINE = {"enforce_eager": True, "max_model_len": 4096, "kv_cache_memory_bytes": 256 << 20}
# eager on both engines: the same LLM numerics, and starts without torch.compile
GPU_ENGINE = {"enforce_eager": True, "max_model_len": 8192, "limit_mm_per_prompt": {"image": 3, "video": 1}}
SETTINGS = {
    "cpu": Setting("cpu", "cpu", "float32", {**CPU_ENGINE, "limit_mm_per_prompt": PROFILE_SMALL}, UNCOMPILED),
    # VLLM_PARITY_DTYPE=float32: both towers and LLMs in float32, where bf16 rounding no longer flips near-ties
    "gpu": Setting("gpu", "cuda", os.environ.get("VLLM_PARITY_DTYPE", "bfloat16"), GPU_ENGINE, UNCOMPILED),
}
IMAGES = [picture(448, 448, 1), picture(640, 480, 2), picture(448, 448, 3)]
"""Two of one size (swapped in a control), one of another."""
PROMPTS = {1: IMAGES[:1], 3: IMAGES}
VIDEO_FRAMES = [picture(448, 448, 10 + index) for index in range(8)]
APP = "epd-vllm-parity"


def gpu_memory_utilization(setting: Setting) -> dict:
    """One GPU: the vLLM replica shares it with our encoder replica; two or more: one each."""
    if setting.device != "cuda":
        return {}
    return {"gpu_memory_utilization": 0.6 if torch.cuda.device_count() == 1 else 0.85}


@pytest.fixture(
    scope="module", params=[pytest.param("gpu", marks=pytest.mark.gpu), pytest.param("cpu")], ids=lambda p: p
)
def setting(request) -> Setting:
    return SETTINGS[request.param]


@pytest.fixture(scope="module")
def checkpoint(setting, tmp_path_factory) -> str:
    if setting.name == "cpu":
        directory = tmp_path_factory.mktemp("qwen3-vl-tiny")
        save_tiny_vlm("qwen3-vl", directory, seed=5, for_vllm=True)
        return str(directory)
    given = os.environ.get("VLLM_PARITY_CHECKPOINT")
    if given:
        assert (Path(given) / "config.json").is_file(), f"VLLM_PARITY_CHECKPOINT={given} holds no checkpoint"
        return given
    directory = tmp_path_factory.mktemp("random") / "qwen3-vl-8b"
    save_random_vlm("qwen3-vl-8b", directory, seed=0, device="cuda")
    return str(directory)


def hf_messages(count: int) -> list[dict]:
    """`openai_messages` as the router converts them: the chat template's image placeholders."""
    parts = [{"type": "text", "text": "Describe these pictures."}] + [{"type": "image"}] * count
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]


def video_messages() -> list[dict]:
    return [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]


def frame_seconds() -> list[float]:
    return [index / VIDEO_FPS for index in range(len(VIDEO_FRAMES))]


def deploy(serve_harness, setting: Setting, checkpoint: str, replica: dict) -> str:
    """configs/epd-vllm.yaml on the checkpoint, one router, the replicas' resources as given; its URL."""
    return serve_harness.deploy(
        "configs/epd-vllm.yaml",
        name=APP,
        route_prefix=f"/{APP}",
        deployments={
            "EncoderRouter": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
            "EncoderReplica": {"ray_actor_options": replica},
            "VLLMReplica": {"ray_actor_options": replica},
        },
        model={"family": "qwen3-vl", "path": checkpoint, "device": setting.device, "dtype": setting.dtype},
        graphs=setting.graphs,
        limits={"max_items_per_request": 3},
        router={"request_timeout_s": 900},  # 64 tokens of a CPU engine on a busy machine take minutes
        llm={
            "family": "qwen3-vl",
            "path": checkpoint,
            "device": setting.device,
            "dtype": setting.dtype,
            "max_tokens": MAX_TOKENS,
            # on CPU without configs/epd-vllm.yaml's GPU share, which the build refuses there
            "engine_kwargs": {
                **setting.engine_kwargs,
                **(gpu_memory_utilization(setting) or {"gpu_memory_utilization": REMOVE}),
            },
        },
    )


@pytest.fixture(scope="module")
def served(setting, checkpoint, serve_harness) -> dict:
    """configs/epd-vllm.yaml on the checkpoint: chat ids per prompt, the video's ids, and our
    embeddings of every image and the clip (as the encoder replica served them); the app is
    removed afterwards, so the offline engine has the device to itself."""
    one_gpu = setting.device == "cuda" and torch.cuda.device_count() == 1
    replica = {"num_cpus": 0, "num_gpus": 0.5 if one_gpu else (1 if setting.device == "cuda" else 0)}
    # a GPU start takes 1-2 minutes (the 8B weights, vLLM's profiling); a busy 2-core CPU host many more
    previous = serve_harness.deploy_timeout_s
    serve_harness.deploy_timeout_s = 420 if setting.device == "cuda" else max(previous, 900)
    started = time.perf_counter()
    try:
        url = deploy(serve_harness, setting, checkpoint, replica)
    finally:
        serve_harness.deploy_timeout_s = previous
    found = {"deploy_s": time.perf_counter() - started, "chat": {}}
    try:
        client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=600)
        model = client.models.list().data[-1].id  # the LLM's id (its checkpoint path), as /v1/models lists it
        for count, images in PROMPTS.items():
            reply = client.chat.completions.create(
                model=model, messages=openai_messages(images), max_tokens=MAX_TOKENS, temperature=0
            ).model_dump()
            found["chat"][count] = (reply["choices"][0]["token_ids"], reply["usage"]["prompt_tokens"])
        router = serve.get_app_handle(APP)
        encoded = (
            router.encode.remote(IMAGES).result()
            + router.encode.remote([{"type": "video", "frames": VIDEO_FRAMES}]).result()
        )
        found["embeddings"] = [
            (ItemOutput(e.embedding.clone(), e.deepstack.clone()), tuple(e.grid_thw)) for e in encoded
        ]
        video, grid = found["embeddings"][-1]
        request = GenerateRequest(
            messages=video_messages(),
            embeddings=[ray.put(item_to_wire(video))],
            grids=[grid],
            max_tokens=MAX_TOKENS,
            frame_seconds=[frame_seconds()],
        )
        result = serve.get_deployment_handle("VLLMReplica", APP).generate.remote(request).result()
        found["video"] = (result.token_ids, result.prompt_tokens)
    finally:
        serve_harness.remove(APP)
    wait_for_device(setting)
    return found


def wait_for_device(setting: Setting, timeout_s: float = 180) -> None:
    """Until the app's replicas have given their GPU memory back (vLLM checks free memory as it starts)."""
    if setting.device != "cuda":
        time.sleep(5)  # the replicas' processes end
        return
    want = gpu_memory_utilization(setting)["gpu_memory_utilization"] * torch.cuda.mem_get_info()[1] + (2 << 30)
    deadline = time.monotonic() + timeout_s
    while torch.cuda.mem_get_info()[0] < want:
        assert time.monotonic() < deadline, f"GPU memory not freed within {timeout_s} s: {torch.cuda.mem_get_info()}"
        time.sleep(1)


def image_data(items: list[tuple[ItemOutput, tuple]]) -> dict:
    """`multi_modal_data` for images as the vLLM replica builds it from our embeddings."""
    return multi_modal_data(["image"] * len(items), [i for i, _ in items], [g for _, g in items], [], TEMPORAL_PATCH)


def controls(items: list[tuple[ItemOutput, tuple]]) -> dict[str, list[tuple[ItemOutput, tuple]]]:
    """Wrong versions of ours: deepstack features zeroed; the two same-size images swapped."""
    zeroed = [(ItemOutput(i.tokens, torch.zeros_like(i.deepstack)), g) for i, g in items]
    first, second = (index for index, (_, g) in enumerate(items) if g == items[0][1])
    swapped = list(items)
    swapped[first], swapped[second] = items[second], items[first]
    return {"deepstack_zeroed": zeroed, "images_swapped": swapped}


def one_output(engine, text: str, data: dict, params=None):
    """vLLM's one output for a prompt text and its multi-modal data (greedy `MAX_TOKENS` by default)."""
    from vllm import SamplingParams

    params = params or SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    (out,) = engine.generate({"prompt": text, "multi_modal_data": data}, params, use_tqdm=False)
    return out


def prompt_logprobs(output, start: int) -> np.ndarray:
    """Each prompt token's logprob from position `start` on."""
    ids = output.prompt_token_ids
    return np.array([output.prompt_logprobs[p][ids[p]].logprob for p in range(start, len(ids))])


@pytest.fixture(scope="module")
def reference(setting, checkpoint, served) -> dict:
    """vLLM offline on the same checkpoint, per prompt: its greedy ids from pixels (with each step's
    top logprobs), its ids fed our served embeddings, and the largest shift of a prompt logprob
    (from the first vision token on) between the two feeds; for the 3-image prompt also the prompt
    logprobs fed the wrong versions of ours."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    engine = LLM(
        model=checkpoint,
        dtype=setting.dtype,
        seed=0,
        enable_mm_embeds=True,
        **setting.engine_kwargs,
        **gpu_memory_utilization(setting),
    )
    found = {"start_s": time.perf_counter() - started, "pixels": {}, "pixel_top": {}, "fed": {}, "shift": {}}
    processor = AutoProcessor.from_pretrained(checkpoint)
    vision_start = processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    generate = functools.partial(one_output, engine)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=TOP_LOGPROBS)
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)

    def ids(out) -> tuple[list[int], int]:
        return list(out.outputs[0].token_ids), len(out.prompt_token_ids)

    def text(messages: list[dict]) -> str:
        return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    embeddings = served["embeddings"]
    frames = np.stack([np.asarray(frame) for frame in VIDEO_FRAMES])
    metadata = {
        "fps": VIDEO_FPS,
        "frames_indices": list(range(len(VIDEO_FRAMES))),
        "total_num_frames": len(VIDEO_FRAMES),
        "duration": len(VIDEO_FRAMES) / VIDEO_FPS,
        "do_sample_frames": False,
    }
    video, grid = embeddings[-1]
    feeds = {  # prompt: (text, vLLM's own input, our embeddings as the vLLM replica passes them)
        **{
            count: (text(hf_messages(count)), {"image": images}, image_data(embeddings[:count]))
            for count, images in PROMPTS.items()
        },
        "video": (
            text(video_messages()),
            {"video": (frames, metadata)},
            multi_modal_data(["video"], [video], [grid], [frame_seconds()], TEMPORAL_PATCH),
        ),
    }
    starts = {}
    for key, (prompt, pixels, ours) in feeds.items():
        out = generate(prompt, pixels, greedy)
        found["pixels"][key] = ids(out)
        found["pixel_top"][key] = [{t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs]
        found["fed"][key] = ids(generate(prompt, ours))
        from_pixels = generate(prompt, pixels, scored)
        starts[key] = start = from_pixels.prompt_token_ids.index(vision_start)
        logprobs = {
            "pixels": prompt_logprobs(from_pixels, start),
            "ours": prompt_logprobs(generate(prompt, ours, scored), start),
        }
        found["shift"][key] = float(np.abs(logprobs["ours"] - logprobs["pixels"]).max())
        if key == 3:
            found["logprobs_pixels"], found["logprobs"] = logprobs.pop("pixels"), logprobs
    found["control_ids_equal_pixels"] = {}
    prompt = feeds[3][0]
    for name, wrong in controls(embeddings[:3]).items():
        found["logprobs"][name] = prompt_logprobs(generate(prompt, image_data(wrong), scored), starts[3])
        found["control_ids_equal_pixels"][name] = ids(generate(prompt, image_data(wrong)))[0] == found["pixels"][3][0]
    del generate, engine  # its engine ends here
    gc.collect()
    return found


def distances(reference: dict) -> dict[str, float]:
    """Mean |logprob - vLLM's from pixels| over the 3-image prompt from its first vision token, per feed."""
    return {name: float(np.abs(lp - reference["logprobs_pixels"]).mean()) for name, lp in reference["logprobs"].items()}


def divergence(served_ids: list[int], ids: list[int], top: list[dict], shift: float) -> dict | None:
    """Where the served ids first leave vLLM's own (None: nowhere): the step, how far vLLM's own top
    choice there leads the token served (its logprob gap; inf outside vLLM's top logprobs), and the
    bound such a gap must stay within to be a near-tie our embeddings' rounding may flip (twice the
    largest prompt-logprob shift they make)."""
    step = next((i for i, (a, b) in enumerate(zip(served_ids, ids)) if a != b), None)
    if step is None and len(served_ids) == len(ids):
        return None
    step = min(len(served_ids), len(ids)) if step is None else step
    taken = served_ids[step] if step < len(served_ids) else None
    best = max(top[step].values()) if step < len(top) else float("inf")
    gap = best - top[step][taken] if step < len(top) and taken in top[step] else float("inf")
    return {"step": step, "gap": gap, "bound": 2 * shift}


@pytest.fixture(scope="module")
def record(setting, served, reference):
    """Everything compared, written under RESULTS_DIR once the module's tests have run."""
    served_ids = {**served["chat"], "video": served["video"]}
    found = {
        "test": "tests/deployments/test_vllm_parity.py",
        "setting": setting.name,
        "dtype": setting.dtype,
        "device": torch.cuda.get_device_name() if setting.device == "cuda" else "cpu",
        "vllm": __import__("vllm").__version__,
        "torch": torch.__version__,
        "served_ids": {str(k): v for k, v in served_ids.items()},
        "pixel_ids": {str(k): v for k, v in reference["pixels"].items()},
        "fed_offline_ids": {str(k): v for k, v in reference["fed"].items()},
        "ids_equal": {str(k): served_ids[k] == reference["pixels"][k] for k in served_ids},
        "divergence": {
            str(k): divergence(
                served_ids[k][0], reference["pixels"][k][0], reference["pixel_top"][k], reference["shift"][k]
            )
            for k in served_ids
        },
        "prompt_logprob_shift": {str(k): v for k, v in reference["shift"].items()},
        "logprob_distances": distances(reference),
        "control_ids_equal_pixels": reference["control_ids_equal_pixels"],
        "deploy_s": served["deploy_s"],
        "offline_start_s": reference["start_s"],
    }
    yield found
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = setting.name + ("_float32" if setting.device == "cuda" and setting.dtype == "float32" else "")
    (RESULTS_DIR / f"vllm_parity_{name}.json").write_text(json.dumps(found, indent=2))


@pytest.mark.parametrize("key", [*PROMPTS, "video"], ids=str)
def test_served_greedy_ids_equal_vllm_from_pixels(served, reference, record, key):
    """Equal ids, or ids that part only at a near-tie of vLLM's own greedy choice (bf16: vLLM's tower
    and ours round differently, and a random model's continuation meets near-ties)."""
    ids, prompt_tokens = reference["pixels"][key]
    served_ids, served_prompt = {**served["chat"], "video": served["video"]}[key]
    assert served_prompt == prompt_tokens  # the same prompt, placeholders expanded alike
    parted = record["divergence"][str(key)]
    if record["dtype"] == "float32":  # no bf16 rounding to flip a near-tie: the ids themselves are equal
        assert served_ids == ids, (parted, served_ids, ids)
    assert parted is None or parted["gap"] <= parted["bound"], (parted, served_ids, ids)


def test_offline_vllm_fed_the_served_embeddings_gives_the_served_ids(served, reference):
    assert reference["fed"] == {**served["chat"], "video": served["video"]}


def test_prompt_logprobs_from_ours_are_far_closer_to_vllms_own_than_wrong_embeddings(reference, record):
    found = record["logprob_distances"]
    wrong = min(found["deepstack_zeroed"], found["images_swapped"])
    assert found["ours"] * CLOSER < wrong, found
