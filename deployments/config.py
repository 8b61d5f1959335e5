"""The application's configuration: one pydantic model, validated from the YAML `args`.

Every field has a description (it shows in errors and in `python -m deployments.config`).
Defaults give the embedded CPU default: the tiny Qwen3-VL tower with random weights.
Serve options of each deployment (replicas, `ray_actor_options`, autoscaling) are not here:
override them in the YAML's `deployments:` section, as for any Ray Serve application.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from encoder_graphs.runner import GraphConfig
from models import attention
from models.presets import PRESETS

MiB = 1 << 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSettings(_Strict):
    """Which vision tower to serve and where."""

    family: Literal["qwen2-vl", "qwen2.5-vl", "qwen3-vl"] | None = Field(
        "qwen3-vl", description="Model family; with `preset: tiny` it picks the tiny tower; checked against `path`."
    )
    preset: str | None = Field(
        "tiny", description=f"Random-weight preset: 'tiny' or one of {sorted(PRESETS)}. Ignored when `path` is set."
    )
    path: str | None = Field(None, description="Local checkpoint directory or hub id (full VLM or vision-only).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Tower dtype; auto: bfloat16 on CUDA, float32 on CPU."
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where encoder replicas run the tower.")
    attention: Literal["auto", "cudnn", "flash", "triton"] = Field(
        attention.DEFAULT_BACKEND,
        description="CUDA varlen attention kernel: cudnn (cuDNN's, through nvidia-cudnn-frontend, the "
        "`cudnn` extra; Hopper or newer; FlashAttention-2 for short segments), flash (FlashAttention-2 "
        "only), triton (ours, a head-wide tile: models/triton_attention.py) or auto (triton on Hopper or "
        "newer, else cudnn where it can serve, else flash). Equal unpadded segments run dense cuDNN SDPA "
        "under each (under triton: in CUDA graphs only, and not long ones at Qwen3-VL's head dim).",
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
            return self.path
        return self.preset if self.preset in PRESETS else f"{self.family}-{self.preset}"


class GraphSettings(_Strict):
    """Token budgets and CUDA graphs (see encoder_graphs.config.GraphConfig)."""

    max_budget_tokens: int = Field(8192, gt=0, description="Largest token budget; larger packs run eagerly.")
    budgets: list[int] | None = Field(
        None, description="Explicit budget list (output tokens); default: the automatic ladder."
    )
    min_budget_tokens: int = Field(64, gt=0, description="Smallest budget of the automatic ladder.")
    budget_growth: float = Field(
        2.0, gt=1.0, description="Ratio between consecutive automatic budgets below fine_budget_tokens."
    )
    fine_budget_tokens: int = Field(128, gt=0, description="From this budget up, doublings are split finer.")
    fine_budget_steps: int = Field(
        8, ge=1, description="Budgets per doubling above fine_budget_tokens (1: plain doubling; see GraphConfig)."
    )
    finer_budget_range: tuple[int, int] | None = Field(
        (1024, 4096),
        description="Budgets from the first up to the second take finer_budget_steps per doubling (null: none).",
    )
    finer_budget_steps: int = Field(16, ge=1, description="Budgets per doubling inside finer_budget_range.")
    max_items_per_pack: int | None = Field(None, gt=0, description="Items per pack (<= smallest budget).")
    max_segments_per_pack: int | None = Field(None, gt=0, description="Attention segments any graph holds.")
    segment_density: int = Field(8, gt=0, description="Segments a graph holds per max_seqlen of its rows.")
    min_seqlen_bucket: int = Field(256, gt=0, description="Smallest max_seqlen bucket (patches).")
    cuda_graphs: bool = Field(True, description="Capture CUDA graphs (CUDA only).")
    self_check: bool = Field(True, description="Check every graph against eager at startup.")
    memory_fraction: float = Field(0.8, gt=0, le=1, description="Share of free GPU memory graphs may use.")
    compile: bool = Field(False, description="torch.compile the forward before capture (slower startup).")
    compile_exact: bool = Field(
        True,
        description="With compile: packs run without a graph use the compiled forward on their exact layout "
        "(no padding; equal-size items, or any under attention 'triton'); two more compiles at startup.",
    )
    recurring_graphs: int = Field(
        16, ge=0, description="Most graphs of recurring packs' exact layouts kept (LRU); 0: off."
    )
    recurring_after: int = Field(
        2, ge=1, description="A pack (its items' grids, in any order) gets its own graph when seen this often."
    )

    @model_validator(mode="after")
    def _finer_range_ascends(self) -> GraphSettings:
        if self.finer_budget_range is not None and not 0 < self.finer_budget_range[0] < self.finer_budget_range[1]:
            raise ValueError(
                "finer_budget_range must be two budgets, the first > 0 and below the second; "
                f"got {list(self.finer_budget_range)}"
            )
        return self

    def to_config(self) -> GraphConfig:
        values = self.model_dump()
        values["budgets"] = tuple(values["budgets"]) if values["budgets"] else None
        return GraphConfig(**values)


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
    cache_bytes: int = Field(
        256 * MiB, ge=0, description="Embedding cache size per router replica (0 turns the cache off)."
    )


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
    max_tokens_per_item: int = Field(16384, gt=0, description="Most output tokens of one item.")
    max_tokens_per_request: int = Field(65536, gt=0, description="Most output tokens of one request.")


class LLMSettings(_Strict):
    """The downstream LLM of encoder disaggregation (language side only; the tower is on the encoders)."""

    family: Literal["qwen2-vl", "qwen2.5-vl", "qwen3-vl"] = Field(
        "qwen3-vl", description="Model family; must match the encoder's."
    )
    preset: str = Field(
        "tiny", description="Random-weight preset: 'tiny' or a real size of the family. Ignored when `path` is set."
    )
    path: str | None = Field(None, description="Full VLM checkpoint (dir or hub id) with its tokenizer.")
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
        "limit_mm_per_prompt, ...); `model`, `dtype` and `enable_mm_embeds` are set from the fields above.",
    )

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


class AppConfig(_Strict):
    """Arguments of `deployments.app:build_app` (the YAML's `args`)."""

    model: ModelSettings = Field(default_factory=ModelSettings, description="The vision tower.")
    graphs: GraphSettings = Field(default_factory=GraphSettings, description="Budgets and CUDA graphs.")
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
        if self.llm is not None and self.model.path is None and self.llm.path is None:
            if self.llm.family != self.model.family:
                raise ValueError(
                    f"llm.family {self.llm.family!r} differs from model.family {self.model.family!r}; "
                    "the LLM must take the encoder's embeddings: use the same family"
                )
        return self
