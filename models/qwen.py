"""The Qwen vision-tower adapter shared by Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

The transformers tower runs unchanged but for a few submodules, each computing the same
function faster with the same weights and state-dict keys (the patch embedding's Conv3d runs as
the identical matmul, `PatchLinear`; a tanh-GELU MLP takes its GELU in the matmul epilogue,
`GeluEpilogueMLP`; a gated MLP runs gate and up as one matmul, `FusedGateUpMLP`): we only
precompute what its `forward` would compute
on the host (`cu_seqlens`, rotary `position_ids`, ...), lay it out in padded fixed-size
buffers, and pass it in as the keyword arguments transformers' `vision_utils.get_*`
helpers accept. Each family subclass adds its own metadata (window attention, learned
position-embedding interpolation) in one method, so the dependence on those keyword names
lives in one place per family.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from functools import lru_cache
from typing import ClassVar

import numpy as np
import torch
import transformers
from transformers.activations import GELUTanh
from transformers.vision_utils import get_vision_position_ids

from . import attention
from .attention import AttentionBackend
from .layout import exact_layout, pack_rows, padded_cu_seqlens, padded_rows, segment_lengths
from .presets import vlm_token_ids
from .processing import ResizeRules, VisionPreprocessor
from .protocol import EncoderOutput, ItemSpec, PackLayout, TensorSpec
from .regions import Region, module_region, region_forward


class PatchLinear(torch.nn.Module):
    """The patch embedding's Conv3d run as the matmul it is.

    The conv's kernel equals its stride and its input is exactly one patch
    (`[N, C, T, P, P]`), so it is a linear map of the flattened patch; cuDNN runs this Conv3d in
    bf16 with a generic (non tensor-core) kernel, the matmul on tensor cores. Same parameters,
    same state-dict keys; output shaped like the conv's (`[N, out, 1, 1, 1]`).
    """

    def __init__(self, conv: torch.nn.Conv3d):
        super().__init__()
        self.weight = conv.weight
        self.bias = conv.bias
        self.out_channels = conv.out_channels
        self.kernel_size = conv.kernel_size

    @staticmethod
    def applies_to(module: torch.nn.Module) -> bool:
        return (
            isinstance(module, torch.nn.Conv3d)
            and tuple(module.kernel_size) == tuple(module.stride)
            and tuple(module.padding) == (0, 0, 0)
            and tuple(module.dilation) == (1, 1, 1)
            and module.groups == 1
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        if tuple(patches.shape[2:]) != tuple(self.kernel_size):
            raise ValueError(f"patches of shape {tuple(patches.shape)} are not single {self.kernel_size} patches")
        out = torch.nn.functional.linear(patches.flatten(1), self.weight.flatten(1), self.bias)
        return out.view(-1, self.out_channels, 1, 1, 1)


class GeluEpilogueMLP(torch.nn.Module):
    """`fc2(gelu_tanh(fc1(x)))` with the GELU computed in fc1's cuBLASLt epilogue on CUDA.

    Qwen3-VL's vision MLP (`hidden_act: gelu_pytorch_tanh`) otherwise writes its
    `[rows, intermediate]` pre-activation, reads it back for the GELU and writes it again:
    an extra 141 MB of memory traffic per layer at 8192 rows of Qwen3-VL-8B.
    `torch._addmm_activation(..., use_gelu=True)` is the tanh GELU on CUDA (inductor keeps it as
    one kernel); the CPU keeps transformers' own modules (there it would be the erf GELU).
    Same submodules, same state-dict keys.
    """

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        self.linear_fc1 = mlp.linear_fc1
        self.linear_fc2 = mlp.linear_fc2
        self.act_fn = mlp.act_fn

    @staticmethod
    def applies_to(module: torch.nn.Module) -> bool:
        fc1, fc2 = getattr(module, "linear_fc1", None), getattr(module, "linear_fc2", None)
        act = getattr(module, "act_fn", None)
        return (
            isinstance(fc1, torch.nn.Linear)
            and isinstance(fc2, torch.nn.Linear)
            and fc1.bias is not None
            and isinstance(act, GELUTanh)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        fc1 = self.linear_fc1
        if hidden.is_cuda and hidden.dim() == 2:
            inner = torch._addmm_activation(fc1.bias, hidden, fc1.weight.t(), use_gelu=True)
        else:
            inner = self.act_fn(fc1(hidden))
        return self.linear_fc2(inner)


class FusedGateUpMLP(torch.nn.Module):
    """`down(act(gate(x)) * up(x))` with gate and up as one matmul over their stacked weights.

    One wide matmul keeps the tensor cores busier than two narrow ones, and the result is
    bit-identical. The stacked `gate_up_proj` is the only storage: gate and up as views of it
    would be aliased parameters, for which torch.compile builds synthetic bases (slower
    compiles). `state_dict()` still shows, and `load_state_dict()` still takes, transformers'
    `gate_proj.*` and `up_proj.*` keys.
    """

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.split = gate.out_features
        self.gate_up_proj = torch.nn.Linear(
            gate.in_features,
            2 * self.split,
            bias=gate.bias is not None,
            device=gate.weight.device,
            dtype=gate.weight.dtype,
        ).requires_grad_(gate.weight.requires_grad)
        with torch.no_grad():
            self.gate_up_proj.weight.copy_(torch.cat([gate.weight, up.weight]))
            if gate.bias is not None:
                self.gate_up_proj.bias.copy_(torch.cat([gate.bias, up.bias]))
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn
        self.register_state_dict_post_hook(self._transformers_keys)
        self.register_load_state_dict_pre_hook(self._fused_keys)

    @staticmethod
    def _transformers_keys(module, state_dict, prefix, local_metadata) -> None:
        for name in ("weight", "bias"):
            fused = state_dict.pop(f"{prefix}gate_up_proj.{name}", None)
            if fused is not None:
                state_dict[f"{prefix}gate_proj.{name}"] = fused[: module.split]
                state_dict[f"{prefix}up_proj.{name}"] = fused[module.split :]

    @staticmethod
    def _fused_keys(module, state_dict, prefix, *args) -> None:
        for name in ("weight", "bias"):
            gate, up = f"{prefix}gate_proj.{name}", f"{prefix}up_proj.{name}"
            if gate in state_dict and up in state_dict:
                state_dict[f"{prefix}gate_up_proj.{name}"] = torch.cat([state_dict.pop(gate), state_dict.pop(up)])

    @staticmethod
    def applies_to(module: torch.nn.Module) -> bool:
        layers = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(layer, torch.nn.Linear) for layer in layers):
            return False
        gate, up, _ = layers
        return gate.weight.shape == up.weight.shape and (gate.bias is None) == (up.bias is None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).split(self.split, -1)
        return self.down_proj(self.act_fn(gate) * up)


def use_patch_linear(tower: torch.nn.Module) -> None:
    """Swap the tower's patch-embedding Conv3d for `PatchLinear` (in place; weights shared)."""
    embed = getattr(tower, "patch_embed", None)
    if embed is not None and PatchLinear.applies_to(getattr(embed, "proj", None)):
        embed.proj = PatchLinear(embed.proj)


def use_fused_mlps(tower: torch.nn.Module) -> int:
    """Swap every block's MLP for `GeluEpilogueMLP` (Qwen3-VL; weights shared) or
    `FusedGateUpMLP` (Qwen2.5-VL; gate and up copied into one stacked weight) where it applies,
    in place. Returns how many were swapped."""
    swapped = 0
    for block in getattr(tower, "blocks", []):
        mlp = getattr(block, "mlp", None)
        for fused in (GeluEpilogueMLP, FusedGateUpMLP):
            if fused.applies_to(mlp):
                block.mlp = fused(mlp)
                swapped += 1
                break
    return swapped


@lru_cache(maxsize=4096)
def _position_ids(grid_thw: tuple[int, int, int], merge_size: int) -> np.ndarray:
    """One item's `[patches, 2]` rotary position ids (numpy: `padded_rows` copies them per pack)."""
    return get_vision_position_ids(torch.tensor([grid_thw]), merge_size).numpy()


class QwenVisionEncoder:
    """A transformers Qwen vision tower behind the `VisionEncoder` protocol."""

    family: ClassVar[str]
    tower_class: ClassVar[type]
    config_class: ClassVar[type]
    vlm_config_class: ClassVar[type]
    """The full VLM's config class (vision + language)."""
    vlm_class: ClassVar[type]
    """The full VLM (`...ForConditionalGeneration`)."""
    image_processor_class: ClassVar[type]
    video_processor_class: ClassVar[type]
    resize_rules: ClassVar[ResizeRules]
    checkpoint_model_types: ClassVar[tuple[str, ...]]
    """`model_type` of the full VLM config and of its vision config, as saved by transformers."""
    checkpoint_prefixes: ClassVar[dict[str, str]] = {"model.visual.": "", "visual.": ""}
    """A full VLM checkpoint's key prefix (newer, older) -> the tower's."""

    # ---- building (called by `models.loading`) ----

    @classmethod
    def vlm_config(cls, preset):
        """The full VLM config (vision + language) of a preset."""
        return cls.vlm_config_class(
            vision_config=preset.vision_config,
            text_config=preset.text_config,
            tie_word_embeddings=preset.tie_word_embeddings,
            **vlm_token_ids(preset.special_tokens),
        )

    @classmethod
    def preset_tower_config(cls, preset):
        return cls.config_class(**preset.vision_config)

    @classmethod
    def checkpoint_tower_config(cls, config: dict, full_vlm: bool):
        return cls.config_class(**(config["vision_config"] if full_vlm else config))

    @classmethod
    def build_tower(cls, config, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
        # Built under the target dtype (not `.to(dtype)` afterwards) so that rotary `inv_freq`
        # buffers stay float32, as with transformers' own `from_pretrained`.
        with torch.device(device):
            return cls.tower_class._from_config(config, dtype=dtype)

    @classmethod
    def make_preprocessor(cls, image_processor, video_processor, config) -> VisionPreprocessor:
        return VisionPreprocessor(image_processor, video_processor, cls.resize_rules)

    @classmethod
    def transformers_reference(
        cls, encoder: QwenVisionEncoder, dtype: torch.dtype, device: torch.device | str
    ) -> torch.nn.Module:
        """A fresh tower of the encoder's class and config holding its weights, as users run it:
        untouched modules (the Conv3d patch embedding) and sdpa attention."""
        config = copy.deepcopy(encoder.tower.config)
        config._attn_implementation = "sdpa"
        tower = cls.build_tower(config, dtype, device)
        tower.load_state_dict(encoder.tower.state_dict(), strict=True)
        return tower.eval().requires_grad_(False)

    def __init__(
        self,
        tower: torch.nn.Module,
        preprocessor: VisionPreprocessor,
        name: str,
        attention: str | AttentionBackend = "auto",
    ):
        """`attention`: a backend, or its config name resolved on the tower's device."""
        self.name = name
        self.tower = tower.eval().requires_grad_(False)
        use_patch_linear(self.tower)
        use_fused_mlps(self.tower)
        if not isinstance(attention, AttentionBackend):
            attention = AttentionBackend.resolve(attention, self.device)
        self.attention = attention
        """The attention kernels this encoder's tower runs (registered under its own name)."""
        self.tower.config._attn_implementation = attention.register()
        self.preprocessor = preprocessor
        config = tower.config
        self.spatial_merge_size = config.spatial_merge_size
        self.merge_unit = config.spatial_merge_size**2
        self.patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.num_deepstack = 0
        self.min_item_tokens = preprocessor.min_item_tokens
        self._regions: list[Region] | None = None
        if preprocessor.patch_size != config.patch_size or preprocessor.merge_size != config.spatial_merge_size:
            raise ValueError(
                f"processor patch/merge size {preprocessor.patch_size}/{preprocessor.merge_size} does not match "
                f"the tower's {config.patch_size}/{config.spatial_merge_size}"
            )

    # ---- facts about the tower ----

    @property
    def dtype(self) -> torch.dtype:
        return next(self.tower.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.tower.parameters()).device

    @property
    def out_hidden(self) -> int:
        return self.tower.config.out_hidden_size

    # ---- what the graph runner asks ----

    def graph_seqlen_buckets(self, budget_rows: int) -> tuple[int, ...] | None:
        return self.attention.graph_seqlen_buckets(budget_rows)

    def synthetic_item(self, patches: int) -> ItemSpec:
        """A square image of whole merge windows."""
        merge = self.spatial_merge_size
        side = max(merge, math.isqrt(patches) // merge * merge)
        return ItemSpec("image", (1, side, side), side * side, side * side // self.merge_unit)

    def exact_segments(self, specs: Sequence[ItemSpec]) -> AbstractContextManager[None]:
        return attention.exact_segments(segment_lengths(specs))

    def exact_in_one_call(self, specs: Sequence[ItemSpec]) -> bool:
        return self.attention.exact_in_one_call([s.frame_patches for s in specs])

    def capturing(self) -> AbstractContextManager[None]:
        return attention.for_graph()

    def compile_identity(self) -> dict[str, str]:
        config = hashlib.sha256(self.tower.config.to_json_string(use_diff=False).encode()).hexdigest()[:16]
        return {
            "family": self.family,
            "name": self.name,
            "tower_config": config,
            "attention": self.attention.implementation,
            "dtype": str(self.dtype).removeprefix("torch."),
            "transformers": transformers.__version__,  # the tower's forward is its modelling code
        }

    def compiled_forward(self, compile: Callable[[Callable], Callable]) -> Callable[..., EncoderOutput]:
        if self._regions is None:
            self._regions = self._layer_regions()
        for region in self._regions:
            region.compile(compile)
        return region_forward(self.forward_padded)

    def _layer_regions(self) -> list[Region]:
        """What `compiled_forward` compiles (once): the blocks, one region for all of them, and
        the mergers (transformers' loop calls them, their `forward` routed through the regions)."""
        return [module_region(self.tower.blocks), module_region(self._mergers())]

    def _mergers(self) -> list[torch.nn.Module]:
        return [self.tower.merger]

    # ---- layouts and metadata ----

    def pack_layout(self, token_budget: int, max_seqlen: int, max_segments: int) -> PackLayout:
        rows = token_budget * self.merge_unit
        padding = -(-rows // max_seqlen)
        return PackLayout(token_budget, max_seqlen, max_segments + padding)

    def exact_layout(self, specs: Sequence[ItemSpec]) -> PackLayout:
        """The unpadded layout of exactly these items (used by the eager path)."""
        return exact_layout(specs)

    def metadata_specs(self, layout: PackLayout) -> dict[str, TensorSpec]:
        rows = layout.token_budget * self.merge_unit
        return {
            "position_ids": TensorSpec((rows, 2), torch.int64),
            "cu_seqlens": TensorSpec((layout.max_segments + 1,), torch.int32),
        }

    def pack_metadata(self, specs: Sequence[ItemSpec], layout: PackLayout) -> dict[str, torch.Tensor]:
        rows = pack_rows(specs, layout, self.merge_unit)
        lengths = segment_lengths(specs)
        positions = [_position_ids(s.grid_thw, self.spatial_merge_size) for s in specs]
        return {
            "position_ids": padded_rows(positions, rows, (2,), torch.int64),
            "cu_seqlens": padded_cu_seqlens(lengths, rows, layout.max_seqlen, layout.max_segments),
        }

    def _tower_kwargs(self, metadata: Mapping[str, torch.Tensor], layout: PackLayout) -> dict:
        """Keyword arguments that make the transformers tower skip its own host-side helpers."""
        return {
            "position_ids": metadata["position_ids"],
            "cu_seqlens": metadata["cu_seqlens"],
            "max_seqlen": layout.max_seqlen,
        }

    # ---- forwards ----

    def _output(self, result) -> EncoderOutput:
        return EncoderOutput(tokens=result.pooler_output)

    def forward_padded(
        self,
        pixel_values: torch.Tensor,
        metadata: Mapping[str, torch.Tensor],
        layout: PackLayout,
        exact_segments: bool = False,
    ) -> EncoderOutput:
        """`exact_segments`: the pack is unpadded (exact layouts only: eager, the compiled exact
        route, or a recurring pack's own graph; never a padded budget graph), so attention over
        its segments may run each run of equal ones as a dense batch, with the lengths the
        caller set by `exact_segments(specs)` (the varlen kernel where none are set)."""
        kwargs = self._tower_kwargs(metadata, layout)
        if exact_segments:
            kwargs[attention.EXACT_SEGMENTS] = attention.ExactSegments(metadata["cu_seqlens"])
        # no_grad, not inference_mode: torch.compile of views under inference_mode fails in AOT
        # functionalization (pytorch/pytorch#169477, #180823).
        with torch.no_grad():
            result = self._run_tower(pixel_values, kwargs)
        return self._output(result)

    def _run_tower(self, pixel_values: torch.Tensor, kwargs: dict):
        """The tower's forward on precomputed metadata (`_tower_kwargs`)."""
        return self.tower(pixel_values, grid_thw=None, **kwargs)

    def forward_eager(
        self,
        pixel_values: torch.Tensor,
        specs: Sequence[ItemSpec],
        forward: Callable[..., EncoderOutput] | None = None,
    ) -> EncoderOutput:
        layout = self.exact_layout(specs)
        metadata = {
            name: tensor.to(self.device, non_blocking=True)
            for name, tensor in self.pack_metadata(specs, layout).items()
        }
        # The segment lengths, known here on the host without a sync: attention runs each run of
        # equal segments (one image, a video's frames, same-size images) as a dense batch.
        with self.exact_segments(specs):
            return (forward or self.forward_padded)(pixel_values.to(self.device), metadata, layout, True)
