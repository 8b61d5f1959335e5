"""Qwen3-VL: learned position embeddings resampled per grid, and deepstack features.

The tower adds `pos_embed` resampled to each item's grid (bilinear, as gather indices and
weights computed on the host) and returns one extra merged feature map per deepstack layer.
Padding rows get zero interpolation weights, so they add nothing.

The tower runs through `Qwen3VLEncoder._run_tower`, a copy of transformers' forward on the
tower's own modules in which each residual add is fused with the layer norm after it (one
Triton kernel on CUDA, `models/triton_norm.py`), which saves a read and a write of the hidden
state per norm. Tests hold it to transformers' own tower.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from types import SimpleNamespace

import torch
from transformers.models.qwen2_vl import image_processing_qwen2_vl
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen3_vl import video_processing_qwen3_vl
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig, Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLVisionModel
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from .layout import padded_rows
from .processing import InvalidItemError, ResizeRules
from .protocol import EncoderOutput, ItemSpec, PackLayout, TensorSpec
from .qwen import QwenVisionEncoder
from .regions import Region

try:  # Triton ships with torch's CUDA wheels; CPU-only installs run the plain ops
    from . import triton_norm
    from .triton_norm import add_layer_norm
except ImportError:
    triton_norm = add_layer_norm = None


def qwen3_video_rule(num_frames, height, width, factor, temporal_factor, min_pixels, max_pixels):
    """Qwen3-VL's video resize budgets pixels over the whole clip (and refuses 1-frame clips)."""
    if num_frames < temporal_factor:
        raise InvalidItemError(f"video has {num_frames} frame(s); Qwen3-VL needs at least {temporal_factor}")
    return video_processing_qwen3_vl.smart_resize(
        num_frames,
        height,
        width,
        temporal_factor=temporal_factor,
        factor=factor,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )


@lru_cache(maxsize=4096)
def _interpolation(grid_thw: tuple[int, int, int], side: int, mode: str, align_corners: bool, merge_size: int):
    """One item's `[patches, taps]` position-embedding gather indices and weights (numpy:
    `padded_rows` copies them per pack)."""
    indices, weights = get_vision_interpolation_indices_and_weights(
        torch.tensor([grid_thw]),
        num_grid_per_side=side,
        mode=mode,
        align_corners=align_corners,
        spatial_merge_size=merge_size,
    )
    return indices.numpy(), weights.numpy()


def residual_layer_norm(
    hidden: torch.Tensor, delta: torch.Tensor, norm: torch.nn.LayerNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(hidden + delta, norm(hidden + delta))`: one Triton kernel on CUDA where it serves
    (`models/triton_norm.py`), the two ops as transformers runs them elsewhere."""
    if hidden.is_cuda and add_layer_norm is not None and triton_norm.supports(hidden, delta, norm.weight, norm.bias):
        return add_layer_norm(hidden, delta, norm.weight, norm.bias, norm.eps)
    summed = hidden + delta
    return summed, norm(summed)


def stem(
    tower: torch.nn.Module,
    pixel_values: torch.Tensor,
    interp_indices: torch.Tensor,
    interp_weights: torch.Tensor,
    position_ids: torch.Tensor,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """What `Qwen3VLVisionModel.forward` runs before its blocks, on precomputed metadata:
    `(hidden, position_embeddings, the first block's norm1 of hidden)`."""
    hidden = tower.patch_embed(pixel_values)
    pos_embeds = (tower.pos_embed(interp_indices) * interp_weights[:, :, None]).sum(1)
    hidden = hidden + pos_embeds.to(hidden.dtype)
    position_embeddings = tower.rotary_pos_emb(hidden, position_ids)
    hidden = hidden.reshape(hidden.shape[0], -1)
    return hidden, position_embeddings, tower.blocks[0].norm1(hidden)


def fused_layer(
    block: torch.nn.Module,
    next_norm: torch.nn.LayerNorm | None,
    hidden: torch.Tensor,
    normed: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block of `Qwen3VLEncoder._run_tower`: `(hidden, normed)` in, the same out, where
    `normed` is the block's `norm1` of `hidden` (the next block's, None after the last block)."""
    attended = block.attn(normed, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings, **kwargs)
    hidden, normed = residual_layer_norm(hidden, attended, block.norm2)
    delta = block.mlp(normed)
    if next_norm is None:
        return hidden + delta, None
    return residual_layer_norm(hidden, delta, next_norm)


class Qwen3VLEncoder(QwenVisionEncoder):
    family = "qwen3-vl"
    tower_class = Qwen3VLVisionModel
    config_class = Qwen3VLVisionConfig
    vlm_config_class = Qwen3VLConfig
    vlm_class = Qwen3VLForConditionalGeneration
    image_processor_class = Qwen2VLImageProcessor
    video_processor_class = Qwen3VLVideoProcessor
    resize_rules = ResizeRules(image=image_processing_qwen2_vl.smart_resize, video=qwen3_video_rule)
    checkpoint_model_types = ("qwen3_vl", "qwen3_vl_vision")

    def __init__(self, tower, preprocessor, name, attention="auto"):
        super().__init__(tower, preprocessor, name, attention)
        self.num_deepstack = len(tower.config.deepstack_visual_indexes)
        self.fused_residual_norms = True
        """Run the tower's residual adds fused with the layer norms after them (`_run_tower`);
        False: transformers' own forward."""
        self._stem = Region(stem)
        self._fused_layer = Region(fused_layer)

    def _interpolation(self, spec: ItemSpec):
        tower = self.tower
        return _interpolation(
            spec.grid_thw,
            tower.num_grid_per_side,
            tower.interpolation_mode,
            tower.interpolation_align_corners,
            self.spatial_merge_size,
        )

    def metadata_specs(self, layout: PackLayout) -> dict[str, TensorSpec]:
        rows = layout.token_budget * self.merge_unit
        taps = self._interpolation(ItemSpec("image", (1, 2, 2), 4, 1))[0].shape[1]
        return {
            **super().metadata_specs(layout),
            "interp_indices": TensorSpec((rows, taps), torch.int64),
            "interp_weights": TensorSpec((rows, taps), torch.float32),
        }

    def pack_metadata(self, specs: Sequence[ItemSpec], layout: PackLayout) -> dict[str, torch.Tensor]:
        metadata = super().pack_metadata(specs, layout)
        rows = layout.token_budget * self.merge_unit
        pieces = [self._interpolation(s) for s in specs]
        taps = self.metadata_specs(layout)["interp_indices"].shape[1]
        metadata["interp_indices"] = padded_rows([p[0] for p in pieces], rows, (taps,), torch.int64)
        metadata["interp_weights"] = padded_rows([p[1] for p in pieces], rows, (taps,), torch.float32)
        return metadata

    def _tower_kwargs(self, metadata: Mapping[str, torch.Tensor], layout: PackLayout) -> dict:
        return {
            **super()._tower_kwargs(metadata, layout),
            "interp_indices": metadata["interp_indices"],
            "interp_weights": metadata["interp_weights"],
        }

    def _run_tower(self, pixel_values: torch.Tensor, kwargs: dict):
        """transformers' `Qwen3VLVisionModel.forward` on precomputed metadata, with each residual
        add fused with the layer norm that follows it (`residual_layer_norm`): the block's
        `h + attn` with its `norm2`, and its `h + mlp` with the next block's `norm1`. Same modules,
        same weights, the same operations in the same order (the fused kernel's float32 reduction
        rounds differently from torch's); what it leaves out is what the encoder never asks for:
        hidden states or attentions recorded per layer, gradient checkpointing, hooks on the
        blocks. `fused_residual_norms` False runs transformers' own forward."""
        if not self.fused_residual_norms:
            return super()._run_tower(pixel_values, kwargs)
        tower = self.tower
        kwargs = dict(kwargs)
        interp_indices, interp_weights = kwargs.pop("interp_indices"), kwargs.pop("interp_weights")
        position_ids, cu_seqlens = kwargs.pop("position_ids"), kwargs.pop("cu_seqlens")
        hidden, position_embeddings, normed = self._stem(
            tower, pixel_values, interp_indices, interp_weights, position_ids
        )
        blocks = tower.blocks
        deepstack = []
        for index, block in enumerate(blocks):
            next_norm = blocks[index + 1].norm1 if index + 1 < len(blocks) else None
            hidden, normed = self._fused_layer(
                block, next_norm, hidden, normed, cu_seqlens, position_embeddings, **kwargs
            )
            if index in tower.deepstack_visual_indexes:
                merger = tower.deepstack_merger_list[tower.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(hidden))
        return SimpleNamespace(pooler_output=tower.merger(hidden), deepstack_features=deepstack)

    def _layer_regions(self) -> list[Region]:
        return [self._stem, self._fused_layer, *super()._layer_regions()]

    def _mergers(self) -> list[torch.nn.Module]:
        return [*self.tower.deepstack_merger_list, self.tower.merger]

    def _output(self, result) -> EncoderOutput:
        return EncoderOutput(tokens=result.pooler_output, deepstack=torch.stack(result.deepstack_features))
