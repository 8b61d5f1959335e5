"""The application's configuration: one pydantic model, validated from the YAML `args`.

Every field has a description (it shows in errors and in `python -m deployments.config`).
Defaults give the embedded CPU default: the tiny Qwen3-VL tower with random weights.
Serve options of each deployment (replicas, `ray_actor_options`, autoscaling) are not here:
override them in the YAML's `deployments:` section, as for any Ray Serve application.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from encoder_graphs.config import GraphConfig, Ladder, budget_ladder
from models.presets import PRESETS, resolve_preset

MiB = 1 << 20


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
"""A Hugging Face hub id (`org/name`, or a bare legacy `name`)."""


def served_name(path: str) -> str:
    """The name clients see for a checkpoint: a hub id as is; a local directory by its own name, so
    that no server path is shown (a hub cache snapshot, `models--org--name/snapshots/<hash>`, by its
    repository id). The name is read from the text alone, the same on every node."""
    if HUB_ID.fullmatch(path):
        return path
    directory = PurePosixPath(path.rstrip("/"))
    if directory.parent.name == "snapshots" and directory.parent.parent.name.startswith("models--"):
        return directory.parent.parent.name.removeprefix("models--").replace("--", "/")
    return directory.name or "checkpoint"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSettings(_Strict):
    """Which vision tower to serve and where."""

    family: Literal["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "internvl"] | None = Field(
        "qwen3-vl", description="Model family; with `preset: tiny` it picks the tiny tower; checked against `path`."
    )
    preset: str | None = Field(
        "tiny", description=f"Random-weight preset: 'tiny' or one of {sorted(PRESETS)}. Ignored when `path` is set."
    )
    path: str | None = Field(
        None,
        description="Local checkpoint directory or hub id (full VLM or vision-only). Clients see a hub id as "
        "is and a directory by its name only.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Tower dtype; auto: bfloat16 on CUDA, float32 on CPU."
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where encoder replicas run the tower.")
    attention: Literal["auto", "cudnn", "fa3", "flash", "triton"] = Field(
        "auto",
        description="CUDA varlen attention kernel: cudnn (cuDNN's, through nvidia-cudnn-frontend, the "
        "`cudnn` extra; Hopper or newer; FlashAttention-2 for short segments), fa3 (FlashAttention-3 as vLLM "
        "ships it, triton for small images: Hopper, vLLM installed), flash (FlashAttention-2 only), triton "
        "(ours, a head-wide tile: models/triton_attention.py) or auto (triton on Hopper or newer, else cudnn "
        "where it can serve, else flash). Equal unpadded segments run dense cuDNN SDPA under each (under "
        "triton: in CUDA graphs only, and not long ones at Qwen3-VL's head dim; under fa3 also only under "
        "1025 patches).",
    )
    switch_interval_ms: float = Field(
        0.2,
        ge=0.01,
        le=100,
        allow_inf_nan=False,
        description="The encoder replica process's GIL switch interval (`sys.setswitchinterval`). Each torch "
        "op of a forward releases the GIL and takes it back; at Python's default 5 ms, a busy event loop or "
        "the background compile holds it meanwhile and small ops wait hundreds of times longer than they run.",
    )

    @model_validator(mode="after")
    def _check_preset(self) -> ModelSettings:
        if self.path is None:
            name = self.preset if self.preset in PRESETS else f"{self.family}-{self.preset}"
            if name not in PRESETS:
                raise ValueError(
                    f"unknown preset {self.preset!r} for family {self.family!r}; use one of {sorted(PRESETS)}"
                )
        return self

    @property
    def model_id(self) -> str:
        """The name clients see in responses."""
        if self.path is not None:
            return served_name(self.path)
        return self.preset if self.preset in PRESETS else f"{self.family}-{self.preset}"


class ReplicaSettings(_Strict):
    """When an encoder replica takes traffic, as it starts (Serve's options of the deployment, such as
    `graceful_shutdown_timeout_s`, which bounds how long a stopping replica waits for its results to
    be read, are in the YAML's `deployments:` section)."""

    warm_up_before_ready: Literal["cached", "always", "never"] = Field(
        "cached",
        description="Whether a replica finishes its warm-up (compile, graphs) before Serve routes to it. cached: "
        "where its compile cache already holds this deployment's compiled artifacts (without `graphs.compile`: a "
        "warm-up record), so the warm-up is seconds and does not compete with serving; a cold replica serves "
        "eagerly while it warms up. always: every replica (a cold one then takes the whole compile before it "
        "serves). never: serve eagerly at once, warm up in the background.",
    )
    warm_up_wait_s: float = Field(
        120.0,
        gt=0,
        allow_inf_nan=False,
        description="Longest a replica waits for its warm-up before it takes traffic anyway (the warm-up goes on "
        "in the background).",
    )


class RouterSettings(_Strict):
    """How the router packs requests and protects itself."""

    max_wait_ms: float = Field(10.0, ge=0, description="Longest an item waits for a fuller pack before it is sent.")
    target_fill: float = Field(
        0.9, gt=0, le=1, description="A pack is sent at once when it fills this share of the largest budget."
    )
    max_queued_tokens: int = Field(
        1 << 18, gt=0, description="Tokens queued or in flight above which new requests get 503 + Retry-After."
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After header value on 503.")
    request_timeout_s: float = Field(120.0, gt=0, description="A request not done by then fails with 504.")
    pack_retries: int = Field(1, ge=0, description="Times a pack is resent when its encoder replica dies.")
    handle_hold_s: float = Field(
        5.0,
        ge=0,
        description="Seconds the router keeps its reference to each result it hands a Python handle caller "
        "(works around ray-project/ray#58080, which can free a result before the caller reads it). The "
        "object store keeps each result at least this long: tokens/s x this x bytes a token (32 KiB for "
        "Qwen3-VL-8B with its deepstack).",
    )
    cache_bytes: int = Field(
        256 * MiB, ge=0, description="Embedding cache size per router replica (0 turns the cache off)."
    )
    cache_sharing: Literal["tenant", "shared"] = Field(
        "tenant",
        description="Which requests share embedding-cache entries and in-flight dedup (a hit is visible in "
        "a response's latency, so whoever shares an entry can learn that another sent that image). tenant: "
        "requests that present the same `tenant_header` value, split further by a request's `cache_salt`; "
        "every handle caller is one tenant (they hold the cluster token); a request with neither a tenant "
        "nor a salt is never served from the cache. shared: all requests (split by `cache_salt` only).",
    )
    tenant_header: str = Field(
        "authorization",
        min_length=1,
        description="The HTTP header whose value names a request's tenant for `cache_sharing: tenant` (used "
        "hashed, never logged). Callers can claim any value unless a gateway in front authenticates it.",
    )
    expose_detail: bool = Field(
        False,
        description="`/v1/models/{id}` also shows operators' detail (packing, cache and queue counters, decode "
        "pool, each replica's work) to any HTTP client, refreshed at most once a second; off: only the model, "
        "its budgets and its replicas' warm-up. The handle's `detail()` always gives it.",
    )
    decode_workers: int = Field(
        4,
        gt=0,
        description="Decode worker processes per router replica (image and video parsing, resizing), plus one "
        "kept for small images.",
    )
    decode_timeout_s: float = Field(
        5.0, gt=0, description="Longest one item may take to inspect or decode; its worker is then killed (413)."
    )
    max_decode_queue: int = Field(
        256, gt=0, description="Items waiting for a decode worker above which new requests get 503 at once."
    )
    body_timeout_s: float = Field(
        10.0, gt=0, description="Longest a client may take to send its request body (408 after)."
    )
    packs_in_flight_per_replica: int = Field(
        2,
        gt=0,
        description="Packs this router keeps in flight per encoder replica, at most its share of the "
        "replicas' `max_ongoing_requests` among the routers; the rest wait in the router, where later "
        "requests join their packs.",
    )
    log_requests: bool = Field(False, description="Log one line per HTTP request (Serve's access log).")


class Limits(_Strict):
    """Input limits, checked in this order before anything large is allocated."""

    max_request_bytes: int = Field(64 * MiB, gt=0, description="Largest HTTP request body.")
    max_items_per_request: int = Field(64, gt=0, description="Most items in one request.")
    max_item_bytes: int = Field(20 * MiB, gt=0, description="Largest encoded image or video of one item.")
    allowed_image_formats: list[str] = Field(
        ["JPEG", "MPO", "PNG", "WEBP", "GIF", "BMP", "TIFF"], description="Pillow format names accepted."
    )
    max_image_pixels: int = Field(
        40_000_000, gt=0, description="Largest width*height, read from the header before decoding."
    )
    max_video_frames: int = Field(256, gt=0, description="Most frames of one video (given or sampled).")
    allowed_video_containers: list[Literal["mp4", "matroska", "avi"]] = Field(
        ["mp4", "matroska", "avi"],
        description="Video file containers accepted (mp4 includes mov; matroska includes webm). "
        "No other FFmpeg demuxer or protocol is ever tried.",
    )
    max_video_decode_frames: int = Field(
        4096, gt=0, description="Most frames decoded to reach a video file's last sampled frame (checked first)."
    )
    max_video_decode_pixels: int = Field(
        2_000_000_000, gt=0, description="Most pixels decoded for one video file (frames decoded x frame size)."
    )
    max_frame_list_pixels: int = Field(
        256 * 1920 * 1080,
        gt=0,
        description="Most pixels of one video sent as frames: every frame's width x height summed, from the "
        "headers (each is decoded and kept, unlike a video file's skipped frames); 256 full-HD frames fit.",
    )
    max_jpeg_scans: int = Field(
        100, gt=0, description="Most scans in a JPEG (progressive files have ~10; repeated scans decode slowly)."
    )
    jpeg_draft: bool = Field(
        True,
        description="Decode a JPEG at 1/2-1/8 scale when the model downscales it at least that much anyway.",
    )
    max_tokens_per_item: int = Field(16384, gt=0, description="Most output tokens of one item.")
    max_tokens_per_request: int = Field(65536, gt=0, description="Most output tokens of one request.")


class LLMSettings(_Strict):
    """The downstream LLM of encoder disaggregation (language side only; the tower is on the encoders)."""

    family: Literal["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "internvl"] = Field(
        "qwen3-vl", description="Model family; must match the encoder's."
    )
    preset: str = Field(
        "tiny", description="Random-weight preset: 'tiny' or a real size of the family. Ignored when `path` is set."
    )
    path: str | None = Field(
        None,
        description="Full VLM checkpoint (dir or hub id) with its tokenizer. Clients see a hub id as is and a "
        "directory by its name only.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bf16 on CUDA, fp32 on CPU."
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where LLM replicas run.")
    seed: int = Field(0, description="Seed of the preset's random weights.")
    max_tokens: int = Field(512, gt=0, description="Largest max_tokens a request may ask for.")
    engine: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="transformers: its `generate`, one request at a time (the reference); vllm: vLLM's async "
        "engine with continuous batching, fed the embeddings (needs vLLM installed and `path`).",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="vllm only: more `AsyncEngineArgs` (max_model_len, gpu_memory_utilization, enforce_eager, "
        "limit_mm_per_prompt, ...); `model`, `dtype` and `enable_mm_embeds` are set from the fields above. "
        "What is not set takes `vllm serve`'s defaults for the GPU (max_num_batched_tokens, max_num_seqs).",
    )
    max_prompt_tokens: int = Field(
        8192,
        gt=0,
        description="Longest prompt (text and vision tokens) a chat request may have: counted by the router "
        "with the LLM's tokenizer once its images are inspected, before any is decoded (413 above). Unset "
        "with the vllm engine and `engine_kwargs.max_model_len`: that less `max_tokens`, so every prompt the "
        "engine could answer in full is taken.",
    )
    colocate: bool = Field(
        False,
        description="One deployment, `ColocatedReplica`, runs an encoder and this LLM in each replica (one GPU "
        "each) instead of `EncoderReplica`s beside LLM replicas: every GPU encodes and generates, where a split "
        "leaves the LLM part of the GPUs while the encoders idle on little vision. Set its `num_replicas`, or "
        "autoscale it with the token policy's `target_generations_per_replica` (docs/autoscaling.md); vLLM's "
        "`gpu_memory_utilization` must leave the encoder its memory.",
    )

    @property
    def model_id(self) -> str:
        """The name chat clients use (`model`) and `/v1/models` lists."""
        if self.path is not None:
            return served_name(self.path)
        return self.preset if self.preset in PRESETS else f"{self.family}-{self.preset}"

    @model_validator(mode="before")
    @classmethod
    def _prompt_limit_from_context(cls, data: Any) -> Any:
        """vLLM's `max_model_len` less the longest answer, where `max_prompt_tokens` is not given: a fixed
        default below the engine's context would refuse prompts `vllm serve` on the same settings answers."""
        if not isinstance(data, dict) or data.get("engine") != "vllm" or "max_prompt_tokens" in data:
            return data
        context = (data.get("engine_kwargs") or {}).get("max_model_len")
        answer = data.get("max_tokens", cls.model_fields["max_tokens"].default)
        if isinstance(context, int) and isinstance(answer, int) and context > answer > 0:
            return {**data, "max_prompt_tokens": context - answer}
        return data

    @model_validator(mode="after")
    def _check_preset(self) -> LLMSettings:
        if self.engine == "vllm":
            if self.path is None:
                raise ValueError(
                    "llm.engine 'vllm' serves a checkpoint: set llm.path (and model.path) to the same VLM "
                    "checkpoint; for a tiny one vLLM can run: models.tiny_checkpoint.save_tiny_vlm(..., for_vllm=True)"
                )
            reserved = sorted({"model", "dtype", "enable_mm_embeds"} & set(self.engine_kwargs))
            if reserved:
                raise ValueError(f"llm.engine_kwargs may not set {reserved}: use llm.path and llm.dtype")
        elif self.engine_kwargs:
            raise ValueError("llm.engine_kwargs is for llm.engine 'vllm'; the transformers engine takes none")
        if self.path is None:
            name = self.preset if self.preset in PRESETS else f"{self.family}-{self.preset}"
            if name not in PRESETS or PRESETS[name].family != self.family:
                choices = sorted(n for n, p in PRESETS.items() if p.family == self.family)
                raise ValueError(f"unknown llm preset {self.preset!r} for family {self.family!r}; use one of {choices}")
        return self


MAX_COLOCATED_SHARE = 0.85
"""The largest share of a GPU vLLM may take beside an encoder (`llm.colocate`): an 8B tower's weights,
graphs and packs need ~6-10 GB, 7-12% of an 80 GB GPU."""


class AppConfig(_Strict):
    """Arguments of `deployments.app:build_app` (the YAML's `args`)."""

    model: ModelSettings = Field(default_factory=ModelSettings, description="The vision tower.")
    graphs: GraphConfig = Field(
        default_factory=GraphConfig, description="Token budgets, CUDA graphs, compilation and warm-up."
    )
    replica: ReplicaSettings = Field(
        default_factory=ReplicaSettings, description="When an encoder replica takes traffic, as it starts."
    )
    router: RouterSettings = Field(default_factory=RouterSettings, description="Packing and backpressure.")
    limits: Limits = Field(default_factory=Limits, description="Input limits.")
    llm: LLMSettings | None = Field(
        None, description="Downstream LLM (enables /v1/chat/completions); None: encoder only."
    )

    @model_validator(mode="after")
    def _check_families(self) -> AppConfig:
        if self.llm is not None and self.llm.engine == "vllm" and self.model.path is None:
            raise ValueError(
                "llm.engine 'vllm' serves llm.path's weights: the encoders must run that checkpoint's tower; "
                f"set model.path to it too (now model.preset={self.model.preset!r})"
            )
        if self.llm is not None and self.llm.colocate:
            if self.llm.device != self.model.device:
                raise ValueError(
                    f"llm.colocate runs the LLM in the encoder replicas: llm.device {self.llm.device!r} must be "
                    f"model.device {self.model.device!r}"
                )
            share = self.llm.engine_kwargs.get("gpu_memory_utilization")
            if share is not None and (
                isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1
            ):
                raise ValueError(
                    f"llm.engine_kwargs.gpu_memory_utilization: a share of the GPU in (0, 1], not {share!r}"
                )
            if (
                self.llm.engine == "vllm"
                and self.llm.device == "cuda"
                and (share is None or share > MAX_COLOCATED_SHARE)
            ):
                raise ValueError(
                    f"llm.colocate with vLLM: set llm.engine_kwargs.gpu_memory_utilization to at most "
                    f"{MAX_COLOCATED_SHARE} (now {share if share is not None else 'unset: vLLM takes 0.9'}), so that "
                    "the encoder in the same replica keeps its weights, graphs and activations on the GPU"
                )
        if self.llm is not None and self.model.path is None and self.llm.path is None:
            if self.llm.family != self.model.family:
                raise ValueError(
                    f"llm.family {self.llm.family!r} differs from model.family {self.model.family!r}; "
                    "the LLM must take the encoder's embeddings: use the same family"
                )
        return self


def smallest_item_tokens(config: AppConfig) -> int:
    """Output tokens of the model's smallest item: a preset's from its numbers; a checkpoint's
    from its processor (which imports transformers)."""
    model = config.model
    if model.path is None:
        return resolve_preset(model.family, model.preset or "tiny").min_item_tokens
    from models import load_preprocessor

    return load_preprocessor(None, model.family, model.path)[1].min_item_tokens


def deployment_ladder(config: AppConfig) -> Ladder:
    """The budget ladder of the deployment, computed once here and handed to the router and
    every encoder replica."""
    return budget_ladder(config.graphs, smallest_item_tokens(config))


def reference_markdown() -> str:
    """Every key of `AppConfig` with its default and description, as a Markdown table (the
    reference in docs/configuration.md; a test keeps the two equal)."""
    schema = AppConfig.model_json_schema()
    rows = ["| key | default | description |", "|---|---|---|"]
    for section, field in AppConfig.model_fields.items():
        default = field.get_default(call_default_factory=True)
        instance = LLMSettings() if default is None else default  # llm: null unless set; its keys' defaults
        section_default = "`null`" if default is None else ""
        rows.append(f"| **`{section}`** | {section_default} | {_cell(schema['properties'][section]['description'])} |")
        for key, prop in schema["$defs"][type(instance).__name__]["properties"].items():
            value = getattr(instance, key)
            rows.append(f"| `{section}.{key}` | `{_default(value)}` | {_cell(prop.get('description', ''))} |")
    return "\n".join(rows)


def _default(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value) if value is not None else "null"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


REFERENCE_START = "<!-- config-reference:start -->\n"
REFERENCE_END = "\n<!-- config-reference:end -->"
"""The markers around the generated table in a Markdown file (docs/configuration.md)."""


def with_reference(text: str) -> str:
    """`text` with what lies between its reference markers replaced by `reference_markdown()`."""
    start, end = text.find(REFERENCE_START), text.find(REFERENCE_END)
    if start < 0 or end < start:
        raise ValueError(f"no {REFERENCE_START.strip()} ... {REFERENCE_END.strip()} markers, in that order")
    return text[: start + len(REFERENCE_START)] + reference_markdown() + text[end:]


def main(argv: list[str] | None = None) -> int:
    """Print the configuration reference, or rewrite it between a Markdown file's markers."""
    parser = argparse.ArgumentParser(description="Print the configuration reference (a Markdown table).")
    parser.add_argument("--write", type=Path, metavar="FILE", help="rewrite the table between FILE's markers instead")
    args = parser.parse_args(argv)
    if args.write is None:
        print(reference_markdown())
        return 0
    try:
        args.write.write_text(with_reference(args.write.read_text()))
    except (OSError, ValueError) as error:
        parser.exit(1, f"{args.write}: {error}\n")
    return 0


if __name__ == "__main__":  # python -m deployments config-reference [--write docs/configuration.md]
    sys.exit(main())
