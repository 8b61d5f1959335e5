"""The InternVL adapter (InternVL2.5, InternVL3, InternVL3.5): fixed tiles, dense attention per tile.

An item is `grid_thw = (tiles, side, side)` in patches (448 px tiles of 14 px patches: 32 x 32),
so every attention segment is one tile of `side**2` patches plus the class token. A pack is a
run of tiles; a padded pack is more tiles, of zeros. There is no per-pack metadata at all: the
tower (`InternVLVisionTower`) cuts the pixel rows into tiles and attends within each with plain
SDPA, so one forward serves any pack of the same number of rows, as one dense call.

The rows of a pack are read as consecutive tiles whatever the items' grids say; every item the
processors produce is whole tiles, so each gets exactly its own features. A synthetic item of
another grid (the runner's self-check packs) still runs, the same way in every path, so padded
and exact runs of it agree.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import ClassVar

import torch
import transformers
from transformers import InternVLConfig, InternVLForConditionalGeneration
from transformers.models.got_ocr2.image_processing_got_ocr2 import GotOcr2ImageProcessor
from transformers.models.internvl.modeling_internvl import InternVLModel
from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

from .internvl_tower import InternVLVisionTower
from .layout import exact_layout, pack_rows
from .presets import INTERNVL_DOWNSAMPLE_RATIO
from .protocol import EncoderOutput, ItemSpec, PackLayout, TensorSpec
from .regions import Region, module_region, region_forward
from .tiling import TilePreprocessor

IMAGE_TOKEN = "<IMG_CONTEXT>"
"""The placeholder a prompt repeats once per output token of an image."""


class InternVLEncoder:
    """transformers' InternVL vision tower and projector behind the `VisionEncoder` protocol."""

    family: ClassVar[str] = "internvl"
    vlm_class: ClassVar[type] = InternVLForConditionalGeneration
    image_processor_class: ClassVar[type] = GotOcr2ImageProcessor
    video_processor_class: ClassVar[type] = InternVLVideoProcessor
    checkpoint_model_types: ClassVar[tuple[str, ...]] = ("internvl",)
    """`model_type` of the VLM config; a vision-only checkpoint keeps it (the projector's sizes are there)."""
    checkpoint_prefixes: ClassVar[dict[str, str]] = {
        "model.vision_tower.": "vision_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "vision_tower.": "vision_tower.",  # checkpoints saved before transformers' `model.` prefix
        "multi_modal_projector.": "multi_modal_projector.",
    }
    """Checkpoint key prefix -> tower key prefix, for the full VLM and vision-only checkpoints alike."""
    num_deepstack = 0

    def __init__(
        self, tower: InternVLVisionTower, preprocessor: TilePreprocessor, name: str, attention: object = "auto"
    ):
        """`attention` is accepted for the loaders' common signature: every tile attends densely
        with SDPA, so there is no kernel to choose."""
        self.name = name
        self.tower = tower.eval().requires_grad_(False)
        self.tower.vision_tower.config._attn_implementation = "sdpa"
        self.preprocessor = preprocessor
        self._layers: Region | None = None
        if (preprocessor.patch_size, preprocessor.merge_unit) != (tower.patch_size, tower.merge_unit):
            raise ValueError(
                f"processor patch size / merge unit {preprocessor.patch_size}/{preprocessor.merge_unit} does not "
                f"match the tower's {tower.patch_size}/{tower.merge_unit}"
            )
        if preprocessor.tile_patches != tower.tile_patches:
            raise ValueError(
                f"processor tiles of {preprocessor.tile_size} pixels do not match the tower's "
                f"{tower.config.vision_config.image_size}"
            )
        self.merge_unit = tower.merge_unit
        self.patch_dim = tower.config.vision_config.num_channels * tower.patch_size**2
        self.min_item_tokens = preprocessor.min_item_tokens

    # ---- building (called by `models.loading`) ----

    @classmethod
    def vlm_config(cls, preset) -> InternVLConfig:
        """The full VLM config of a preset (the tower needs it too: the projector's sizes)."""
        if preset.text_config is None:
            raise ValueError(f"preset {preset.name!r} has no language-model config; InternVL's projector needs one")
        return InternVLConfig(
            vision_config=preset.vision_config,
            text_config=preset.text_config,
            image_token_id=preset.special_tokens[IMAGE_TOKEN],
            tie_word_embeddings=preset.tie_word_embeddings,
            downsample_ratio=INTERNVL_DOWNSAMPLE_RATIO,
        )

    @classmethod
    def preset_tower_config(cls, preset) -> InternVLConfig:
        return cls.vlm_config(preset)

    @classmethod
    def checkpoint_tower_config(cls, config: dict, full_vlm: bool) -> InternVLConfig:
        return InternVLConfig.from_dict(config)

    @classmethod
    def build_tower(cls, config: InternVLConfig, dtype: torch.dtype, device: torch.device | str) -> InternVLVisionTower:
        with torch.device(device):
            return InternVLVisionTower._from_config(config, dtype=dtype)

    @classmethod
    def make_preprocessor(cls, image_processor, video_processor, config: InternVLConfig) -> TilePreprocessor:
        patch_size = config.vision_config.patch_size
        patch_size = patch_size[0] if isinstance(patch_size, (list, tuple)) else patch_size
        return TilePreprocessor(image_processor, video_processor, patch_size, round(1 / config.downsample_ratio) ** 2)

    @classmethod
    def transformers_reference(
        cls, encoder: InternVLEncoder, dtype: torch.dtype, device: torch.device | str
    ) -> InternVLModel:
        """transformers' `InternVLModel` holding the encoder's tower and projector weights, run as users
        run it (`get_image_features`, sdpa). Its language model is one small layer of the same width:
        `get_image_features` never runs it, and the real one would not fit beside an 8B tower."""
        config = copy.deepcopy(encoder.tower.config)
        text = config.text_config
        config.text_config = type(text)(
            hidden_size=text.hidden_size,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            vocab_size=16,
        )
        config._attn_implementation = "sdpa"
        with torch.device(device):
            model = InternVLModel._from_config(config, dtype=dtype)
        model.vision_tower.load_state_dict(encoder.tower.vision_tower.state_dict(), strict=True)
        model.multi_modal_projector.load_state_dict(encoder.tower.multi_modal_projector.state_dict(), strict=True)
        return model.eval().requires_grad_(False)

    # ---- facts about the tower ----

    @property
    def dtype(self) -> torch.dtype:
        return next(self.tower.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.tower.parameters()).device

    @property
    def out_hidden(self) -> int:
        return self.tower.out_hidden

    # ---- what the graph runner asks ----

    def graph_seqlen_buckets(self, budget_rows: int) -> tuple[int, ...] | None:
        """One bucket: every attention segment is one tile."""
        return (self.tower.tile_patches,)

    def synthetic_item(self, patches: int) -> ItemSpec:
        """An image of whole tiles (at least one)."""
        return self.preprocessor.spec("image", max(1, patches // self.tower.tile_patches))

    def exact_segments(self, specs: Sequence[ItemSpec]) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def exact_in_one_call(self, specs: Sequence[ItemSpec]) -> bool:
        return True  # one dense SDPA call over all the pack's tiles

    def capturing(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def compiled_forward(self, compile: Callable[[Callable], Callable]) -> Callable[..., EncoderOutput]:
        if self._layers is None:  # the encoder layers the tower runs, one region for all of them
            tower = self.tower
            self._layers = module_region(tower.vision_tower.encoder.layer[: tower.layers])
        self._layers.compile(compile)
        return region_forward(self.forward_padded)

    def compile_identity(self) -> dict[str, str]:
        config = hashlib.sha256(self.tower.config.to_json_string(use_diff=False).encode()).hexdigest()[:16]
        return {
            "family": self.family,
            "name": self.name,
            "tower_config": config,
            "attention": "sdpa",
            "dtype": str(self.dtype).removeprefix("torch."),
            "transformers": transformers.__version__,  # the tower's forward is its modelling code
        }

    # ---- layouts and metadata ----

    def pack_layout(self, token_budget: int, max_seqlen: int, max_segments: int) -> PackLayout:
        """Any segment count and `max_seqlen` serve: attention is dense per tile, sized by the rows."""
        return PackLayout(token_budget, max_seqlen, max_segments)

    def exact_layout(self, specs: Sequence[ItemSpec]) -> PackLayout:
        """The unpadded layout of exactly these items (used by the eager path)."""
        return exact_layout(specs)

    def metadata_specs(self, layout: PackLayout) -> dict[str, TensorSpec]:
        return {}

    def pack_metadata(self, specs: Sequence[ItemSpec], layout: PackLayout) -> dict[str, torch.Tensor]:
        """No metadata: only a check that the items fit the layout's rows."""
        pack_rows(specs, layout, self.merge_unit)
        return {}

    # ---- forwards ----

    def forward_padded(
        self,
        pixel_values: torch.Tensor,
        metadata: Mapping[str, torch.Tensor],
        layout: PackLayout,
        exact_segments: bool = False,
    ) -> EncoderOutput:
        """Static-shape forward over the rows (`exact_segments` changes nothing: every pack already
        runs as one dense batch of tiles). no_grad, not inference_mode (see `QwenVisionEncoder`)."""
        with torch.no_grad():
            return EncoderOutput(tokens=self.tower(pixel_values))

    def forward_eager(
        self,
        pixel_values: torch.Tensor,
        specs: Sequence[ItemSpec],
        forward: Callable[..., EncoderOutput] | None = None,
    ) -> EncoderOutput:
        layout = self.exact_layout(specs)
        return (forward or self.forward_padded)(pixel_values.to(self.device), {}, layout, True)
