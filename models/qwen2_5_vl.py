"""Qwen2.5-VL: window attention in most blocks, full attention in `fullatt_block_indexes`.

The tower permutes merged-token units into window order (`window_index`), runs windowed
blocks on `cu_window_seqlens`, and un-permutes after the merger. In a padded pack the
padding units keep their place at the end of the permutation and form their own windows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import lru_cache

import numpy as np
import torch
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig, Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2_5_VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.vision_utils import get_vision_window_index

from .layout import padded_cu_seqlens, padded_rows
from .protocol import ItemSpec, PackLayout, TensorSpec
from .qwen import QwenVisionEncoder
from .qwen2_vl import QWEN2_RESIZE_RULES


@lru_cache(maxsize=4096)
def _item_windows(grid_thw: tuple[int, int, int], merge_size: int, window_size: int, patch_size: int):
    """(window order of the item's merged units as a numpy array, window lengths in patches) for
    one item."""
    index, cu_windows = get_vision_window_index(
        torch.tensor([grid_thw]), spatial_merge_size=merge_size, window_size=window_size, patch_size=patch_size
    )
    return index.numpy(), (cu_windows[1:] - cu_windows[:-1]).tolist()


class Qwen2_5_VLEncoder(QwenVisionEncoder):
    family = "qwen2.5-vl"
    tower_class = Qwen2_5_VisionTransformerPretrainedModel
    config_class = Qwen2_5_VLVisionConfig
    vlm_config_class = Qwen2_5_VLConfig
    vlm_class = Qwen2_5_VLForConditionalGeneration
    image_processor_class = Qwen2VLImageProcessor
    video_processor_class = Qwen2VLVideoProcessor
    resize_rules = QWEN2_RESIZE_RULES
    checkpoint_model_types = ("qwen2_5_vl", "qwen2_5_vl_vision")

    @property
    def window_patches(self) -> int:
        """Patches in one full window: the longest window-attention segment."""
        side = self.tower.config.window_size // self.tower.config.patch_size
        return side * side

    def _window_capacity(self, rows: int, frames: int) -> int:
        # A square-ish frame of U merged units on side-w windows has about U/w^2 + 2*sqrt(U)/w + 1
        # windows; twice U/w^2 plus two per frame covers common shapes. Thin strips can need more:
        # such packs fail `pack_metadata` with PackCapacityError and run eagerly.
        units = rows // self.merge_unit
        window_units = self.tower.config.window_size // self.tower.config.patch_size // self.spatial_merge_size
        padding = -(-rows // self.window_patches)
        return 2 * -(-units // window_units**2) + 2 * frames + padding

    def pack_layout(self, token_budget: int, max_seqlen: int, max_segments: int) -> PackLayout:
        layout = super().pack_layout(token_budget, max_seqlen, max_segments)
        capacity = self._window_capacity(token_budget * self.merge_unit, max_segments)
        return replace(layout, max_window_segments=capacity)

    def exact_layout(self, specs: Sequence[ItemSpec]) -> PackLayout:
        windows = sum(len(self._windows(s)[1]) for s in specs)
        return replace(super().exact_layout(specs), max_window_segments=windows)

    def window_lengths(self, spec: ItemSpec) -> list[int]:
        """The item's window-attention segment lengths (patches), in window order."""
        return list(self._windows(spec)[1])

    def _windows(self, spec: ItemSpec):
        config = self.tower.config
        return _item_windows(spec.grid_thw, self.spatial_merge_size, config.window_size, config.patch_size)

    def metadata_specs(self, layout: PackLayout) -> dict[str, TensorSpec]:
        units = layout.token_budget
        return {
            **super().metadata_specs(layout),
            "window_index": TensorSpec((units,), torch.int64),
            "cu_window_seqlens": TensorSpec((layout.max_window_segments + 1,), torch.int32),
        }

    def pack_metadata(self, specs: Sequence[ItemSpec], layout: PackLayout) -> dict[str, torch.Tensor]:
        metadata = super().pack_metadata(specs, layout)
        indices, lengths, offset = [], [], 0
        for spec in specs:
            index, window_lengths = self._windows(spec)
            indices.append(index + offset)
            lengths.extend(window_lengths)
            offset += spec.output_tokens
        # Padding units stay in place, after every real unit.
        indices.append(np.arange(offset, layout.token_budget))
        rows = layout.token_budget * self.merge_unit
        chunk = min(self.window_patches, layout.max_seqlen)
        metadata["window_index"] = padded_rows(indices, layout.token_budget, (), torch.int64)
        metadata["cu_window_seqlens"] = padded_cu_seqlens(lengths, rows, chunk, layout.max_window_segments)
        return metadata

    def _tower_kwargs(self, metadata: Mapping[str, torch.Tensor], layout: PackLayout) -> dict:
        return {
            **super()._tower_kwargs(metadata, layout),
            "window_index": metadata["window_index"],
            "cu_window_seqlens": metadata["cu_window_seqlens"],
            "max_window_seqlen": min(self.window_patches, layout.max_seqlen),
        }
