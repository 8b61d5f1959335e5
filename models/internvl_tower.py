"""InternVL's vision tower and projector, run as `InternVLModel.get_image_features` runs them, on patch rows.

`InternVLVisionTower` holds transformers' own `InternVLVisionModel` and
`InternVLMultiModalProjector` (their state-dict keys are the full VLM's, less the `model.`
prefix) and runs their modules in `get_image_features`' order: patch embedding, class token,
position embeddings, the encoder layers up to `vision_feature_layer`, the class token dropped
(`vision_feature_select_strategy: default`), pixel shuffle (`InternVLModel.pixel_shuffle`'s
reshapes, with the tile's sizes as constants), projector. What changes is the input: rows of patches, cut
into tiles of `tile_patches` rows (the last one zero-padded), instead of `[tiles, 3, H, W]`
pixels, so the patch embedding's Conv2d runs as the matmul it is (kernel = stride). Attention
is plain SDPA over `[tiles, heads, 1 + tile_patches, head_dim]`: each tile attends only to
itself, so padding tiles never touch real ones and no varlen metadata exists.
"""

from __future__ import annotations

import torch
from transformers import InternVLConfig
from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector, InternVLVisionModel

RANDOM_EMBEDDING_STD = 0.02
"""Std of the class token and position embeddings drawn for random-weight towers."""


def randomize_embeddings(vision_tower: torch.nn.Module, generator: torch.Generator | None = None) -> None:
    """Draw the class token and position embeddings at random: transformers initialises them to zero,
    which would make a wrong class-token or position handling invisible to tests and benchmarks."""
    embeddings = vision_tower.embeddings
    with torch.no_grad():
        for parameter in (embeddings.cls_token, embeddings.position_embeddings):
            if parameter is not None:
                values = torch.randn(parameter.shape, generator=generator, device="cpu") * RANDOM_EMBEDDING_STD
                parameter.copy_(values.to(parameter.dtype))


def pixel_shuffle(features: torch.Tensor, side: int) -> torch.Tensor:
    """`InternVLModel.pixel_shuffle`'s reshapes for a downsampling to `side` x `side`:
    `[tiles, width, height, channels]` -> `[tiles, side, side, channels * (height / side)^2]`. Its
    own version computes the sizes from `height * scale_factor` and checks `height % scale_factor`,
    which `torch.compile(dynamic=True)` cannot guard (a float modulus on a symbolic size)."""
    tiles, width = features.shape[:2]
    features = features.reshape(tiles, width, side, -1).permute(0, 2, 1, 3)
    return features.reshape(tiles, side, side, -1).permute(0, 2, 1, 3).contiguous()


def _feature_layers(config: InternVLConfig) -> tuple[int, bool]:
    """(encoder layers to run, whether the final layer norm follows) for `vision_feature_layer`:
    -1 is `last_hidden_state` (after the norm); any other index selects `hidden_states`, whose
    entry 0 is the embeddings and entry k the output of layer k (before the norm)."""
    layer = config.vision_feature_layer
    depth = config.vision_config.num_hidden_layers
    if not isinstance(layer, int) or not -(depth + 1) <= layer <= depth:
        raise ValueError(f"vision_feature_layer {layer!r} is not one of the tower's {depth + 1} hidden states")
    if layer == -1:
        return depth, True
    return layer % (depth + 1), False


class InternVLVisionTower(torch.nn.Module):
    """transformers' InternVL vision tower and projector: patch rows in, projected tokens out."""

    def __init__(
        self, config: InternVLConfig, vision_tower: InternVLVisionModel, projector: InternVLMultiModalProjector
    ):
        super().__init__()
        self.config = config
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector
        vision = config.vision_config
        if config.vision_feature_select_strategy != "default":
            raise ValueError(
                f"vision_feature_select_strategy {config.vision_feature_select_strategy!r}: transformers' "
                "InternVL pixel shuffle needs the class token dropped ('default')"
            )
        (height, width), (patch_h, patch_w) = vision.image_size, vision.patch_size
        if height != width or patch_h != patch_w or height % patch_h:
            raise ValueError(f"tiles of {vision.image_size} pixels in {vision.patch_size} patches are not square grids")
        self.patch_size = patch_h
        self.tile_side = height // patch_h
        self.tile_patches = self.tile_side**2
        shuffled = self.tile_side * config.downsample_ratio
        if shuffled != int(shuffled):
            raise ValueError(
                f"downsample_ratio {config.downsample_ratio} does not divide {self.tile_side} patches a side"
            )
        self.shuffled_side = int(shuffled)
        self.merge_unit = round(1 / config.downsample_ratio) ** 2
        self.layers, self.final_norm = _feature_layers(config)

    @classmethod
    def _from_config(cls, config: InternVLConfig, dtype: torch.dtype) -> InternVLVisionTower:
        """A tower of random weights (built on the current default device)."""
        vision = InternVLVisionModel._from_config(config.vision_config, dtype=dtype)
        randomize_embeddings(vision)
        projector = InternVLMultiModalProjector(config).to(dtype)
        return cls(config, vision, projector)

    @property
    def out_hidden(self) -> int:
        return self.multi_modal_projector.linear_2.out_features

    def embed(self, patches: torch.Tensor) -> torch.Tensor:
        """`[tiles, tile_patches, patch_dim]` -> `[tiles, 1 + tile_patches, hidden]`: what
        `InternVLVisionEmbeddings` computes from the tiles' pixels (no interpolation: the tiles are
        the position grid's size)."""
        embeddings = self.vision_tower.embeddings
        conv = embeddings.patch_embeddings.projection
        hidden = torch.nn.functional.linear(patches.to(conv.weight.dtype), conv.weight.flatten(1), conv.bias)
        hidden = torch.cat([embeddings.cls_token.expand(hidden.shape[0], -1, -1), hidden], dim=1)
        if embeddings.position_embeddings is not None:
            hidden = hidden + embeddings.position_embeddings
        return embeddings.dropout(hidden)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """`[rows, patch_dim]` patch rows (consecutive tiles of `tile_patches` rows; a partial last tile
        is zero-padded) -> `[rows // merge_unit, out_hidden]` tokens, tile after tile."""
        rows = patches.shape[0]
        tiles = -(-rows // self.tile_patches)
        if tiles * self.tile_patches != rows:
            patches = torch.nn.functional.pad(patches, (0, 0, 0, tiles * self.tile_patches - rows))
        hidden = self.embed(patches.view(tiles, self.tile_patches, -1))
        for layer in self.vision_tower.encoder.layer[: self.layers]:
            hidden = layer(hidden)
        if self.final_norm:
            hidden = self.vision_tower.layernorm(hidden)
        features = hidden[:, 1:].reshape(tiles, self.tile_side, self.tile_side, -1)
        features = pixel_shuffle(features, self.shuffled_side)
        tokens = self.multi_modal_projector(features.reshape(tiles, -1, features.shape[-1]))
        return tokens.reshape(-1, tokens.shape[-1])[: rows // self.merge_unit]
