"""The seam between model code (`models/`) and the model-agnostic graph manager (`encoder_graphs/`).

`encoder_graphs` talks to a vision tower only through `VisionEncoder` and the frozen
dataclasses below. Everything a graph needs is either a static shape (from `PackLayout`)
or a host tensor computed before replay (from `VisionEncoder.pack_metadata`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from . import precompiled
from .precompiled import RegionMiss as RegionMiss  # the runner catches it; encoder_graphs imports protocol only

Modality = Literal["image", "video"]


@dataclass(frozen=True)
class ItemSpec:
    """One image or video as the tower sees it, known before the tower runs."""

    modality: Modality
    """"image" or "video"; a pack holds one modality."""
    grid_thw: tuple[int, int, int]
    """Patch grid (temporal, height, width) exactly as the processor's `*_grid_thw`."""
    input_patches: int
    """Rows of `pixel_values` the item occupies (t * h * w)."""
    output_tokens: int
    """Merged tokens the tower returns for it (input_patches // merge_unit)."""

    @property
    def frame_patches(self) -> int:
        """Patches in one temporal slice: the length of one attention segment."""
        return self.grid_thw[1] * self.grid_thw[2]

    @property
    def segments(self) -> int:
        """Attention segments: one per temporal slice (InternVL: per tile)."""
        return self.grid_thw[0]


@dataclass(frozen=True)
class PackLayout:
    """Static shape of one padded pack: what a captured graph is specialised to."""

    token_budget: int
    """Output tokens (after the spatial merge) the pack can hold."""
    max_seqlen: int
    """Longest attention segment (patches) allowed; padding is chunked to <= this."""
    max_segments: int
    """Capacity of the full-attention `cu_seqlens` buffer (real + padding segments). Unused
    slots are not free: a varlen kernel's grid grows with them."""
    max_window_segments: int = 0
    """Capacity of the window-attention `cu_window_seqlens` buffer (0: no window attention)."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one static input buffer."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class EncoderOutput:
    """Merged tokens for a whole (possibly padded) pack, item after item."""

    tokens: torch.Tensor
    """`[rows, out_hidden]`, items in pack order, padding rows after the last item."""
    deepstack: torch.Tensor | None = None
    """`[num_deepstack, rows, out_hidden]` (Qwen3-VL), same row order; None otherwise."""


@dataclass
class ItemOutput:
    """The tower's output for one item, sliced from a pack."""

    tokens: torch.Tensor
    """`[output_tokens, out_hidden]`."""
    deepstack: torch.Tensor | None = None
    """`[num_deepstack, output_tokens, out_hidden]` (Qwen3-VL) or None."""

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors."""
        return self.tokens.nbytes + (0 if self.deepstack is None else self.deepstack.nbytes)


def segment_lengths(specs: Sequence[ItemSpec]) -> list[int]:
    """Attention segment lengths of items in pack order: one per frame (temporal patch)."""
    return [s.frame_patches for s in specs for _ in range(s.segments)]


def segment_groups(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Runs of consecutive equal lengths as `(count, length)`, in order; empty segments dropped.
    On an exact layout each run is one dense attention batch."""
    groups: list[tuple[int, int]] = []
    for length in lengths:
        if length <= 0:
            continue
        if groups and groups[-1][1] == length:
            groups[-1] = (groups[-1][0] + 1, length)
        else:
            groups.append((1, length))
    return groups


class PackCapacityError(ValueError):
    """The items do not fit a layout (more segments or tokens than its buffers hold)."""


class PrecompiledRegions(Protocol):
    """The `compile` a runner hands `VisionEncoder.compiled_forward` to precompile its regions
    (`models.precompiled.PrecompiledRegions`): each region AOT-compiled per guard set, its variants
    serialized into the compile cache and loaded on later starts without tracing."""

    backend: str
    compiling: bool
    """Whether a guard miss compiles a new variant (the warm-up) or raises `RegionMiss` (serving)."""

    def __call__(self, function: Callable[..., object]) -> Callable[..., object]: ...

    @property
    def new(self) -> bool:
        """Whether a variant was compiled since the last `load`."""
        ...

    def load(self, blobs: Mapping[str, Sequence[bytes]]) -> int:
        """Load serialized variants by region name (unknown names ignored); raises on any that does
        not load or whose traced sources changed, keeping none of them. The number loaded."""
        ...

    def serialized(self) -> dict[str, list[bytes]]:
        """Every region's variants, serialized, by region name."""
        ...


def precompiled_regions(backend: str = "inductor") -> PrecompiledRegions:
    """A new set of precompiled regions compiling with dynamo's `backend` (tests: "eager")."""
    return precompiled.PrecompiledRegions(backend)


@runtime_checkable
class VisionEncoder(Protocol):
    """A vision tower that can run padded packs with precomputed metadata."""

    family: str
    """Model family id, e.g. "qwen2.5-vl"."""
    merge_unit: int
    """Input patches per output token (spatial_merge_size ** 2)."""
    patch_dim: int
    """Width of one `pixel_values` row (channels * temporal_patch * patch * patch)."""
    out_hidden: int
    """Width of one output token."""
    num_deepstack: int
    """Deepstack feature maps returned per item (0 when the family has none)."""
    min_item_tokens: int
    """Output tokens of the smallest image the processor produces (budget ladders start here)."""
    dtype: torch.dtype
    device: torch.device

    def graph_seqlen_buckets(self, budget_rows: int) -> tuple[int, ...] | None:
        """The `max_seqlen` buckets (ascending) of the graphs of a budget of `budget_rows` input rows,
        or None for one bucket per doubling (then only the ladder's coarse budgets get graphs)."""
        ...

    def pack_layout(self, token_budget: int, max_seqlen: int, max_segments: int) -> PackLayout:
        """The static layout for packs of up to `token_budget` tokens, frames of <= `max_seqlen`
        patches and <= `max_segments` frames (attention segments) in all."""
        ...

    def exact_layout(self, specs: Sequence[ItemSpec]) -> PackLayout:
        """The unpadded layout of exactly these items (no padding rows or segments)."""
        ...

    def metadata_specs(self, layout: PackLayout) -> Mapping[str, TensorSpec]:
        """Static metadata buffers a graph for `layout` needs (pixels excluded)."""
        ...

    def pack_metadata(self, specs: Sequence[ItemSpec], layout: PackLayout) -> dict[str, torch.Tensor]:
        """Host tensors matching `metadata_specs(layout)` for these items; no device work.

        Raises PackCapacityError when the items do not fit the layout."""
        ...

    def forward_padded(
        self,
        pixel_values: torch.Tensor,
        metadata: Mapping[str, torch.Tensor],
        layout: PackLayout,
        exact_segments: bool = False,
    ) -> EncoderOutput:
        """Static-shape forward over `token_budget * merge_unit` pixel rows. No host sync:
        safe to capture in one CUDA graph once the metadata lives in static buffers.
        `exact_segments`: the rows are an exact layout whose items the caller named with
        `exact_segments(specs)` around this call (never a padded budget graph)."""
        ...

    def forward_eager(
        self,
        pixel_values: torch.Tensor,
        specs: Sequence[ItemSpec],
        forward: Callable[..., EncoderOutput] | None = None,
    ) -> EncoderOutput:
        """Unpadded forward for any items on their exact layout (used above the largest budget,
        when measured costs favour it, and as the reference the startup self-check compares
        graphs with). `forward`: a stand-in for `forward_padded` with its signature (the
        runner passes its compiled one); default `forward_padded`."""
        ...

    def synthetic_item(self, patches: int) -> ItemSpec:
        """An image the processor could produce, of about `patches` input patches (no more where it
        can): the sample items of the runner's startup checks and timings."""
        ...

    def exact_segments(self, specs: Sequence[ItemSpec]) -> AbstractContextManager[None]:
        """A context in which `forward_padded(..., exact_segments=True)` runs these items' exact layout."""
        ...

    def exact_in_one_call(self, specs: Sequence[ItemSpec]) -> bool:
        """Whether attention over these items' exact layout is one launch per layer (outside a graph)."""
        ...

    def capturing(self) -> AbstractContextManager[None]:
        """A context in which forwards pick their kernels for a CUDA graph (its warm-up and capture)."""
        ...

    def compile_identity(self) -> Mapping[str, str]:
        """What a compile of `forward_padded` depends on besides torch, the GPU and the layouts."""
        ...

    def compiled_forward(
        self, compile: Callable[[Callable[..., object]], Callable[..., object]]
    ) -> Callable[..., EncoderOutput]:
        """`forward_padded` with the tower's repeated layer compiled by `compile` once for all
        layers (`models.regions`), compiled only in the calling thread: `forward_padded` itself
        stays uncompiled, the reference the runner checks against."""
        ...
