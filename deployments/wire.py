"""What crosses between the service's processes: packs, encoded items, generate requests and results.

Light on purpose: a router, an LLM replica or a caller's driver imports this module without the
graph runner or transformers, and torch only when a tensor is actually made.

An encoded item is stored in the encoder replica's object store as a plain dict of numpy arrays
(`item_to_wire`), so that reading one (`ray.get`) runs numpy's own unpickling and nothing of
ours: no torch import, no code of this project inside Ray's deserialization, which holds Ray's
locks while it runs. The arrays a reader gets are read-only views of the store's shared pages;
`item_from_wire` makes tensors of them after `ray.get` has returned (views, or private copies).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from models.protocol import ItemOutput, ItemSpec

WIRE_DTYPES = ("bfloat16", "float16", "float32")
"""Tensor dtypes that travel; bfloat16, which numpy lacks, as its raw 16-bit words (`uint16`)."""


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """A settings dtype ("auto": bfloat16 on CUDA, float32 on CPU) as a torch dtype."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, dtype)


# ---- tensors ----


def to_wire(tensor: torch.Tensor | None):
    """A CPU tensor as `(dtype name, array or list of arrays)`: numpy's bytes go out of band when
    pickled (one copy into the store, none out), where a pickled tensor would go through the pickle
    stream with its whole storage (a view of a pack carries the pack). A view whose slices along the
    first dim are each contiguous (an item's deepstack levels cut from a pack's `[levels, tokens,
    hidden]`) goes as those slices, not copied into one block first."""
    if tensor is None or tensor.device.type != "cpu":
        return tensor
    name = str(tensor.dtype).removeprefix("torch.")
    if not tensor.is_contiguous() and 1 < tensor.shape[0] <= 16 and all(part.is_contiguous() for part in tensor):
        return (name, [_array(part) for part in tensor])
    return (name, _array(tensor.contiguous()))


def _array(tensor: torch.Tensor) -> np.ndarray:
    import torch

    return (tensor.view(torch.uint16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


def from_wire(packed, copy: bool = False) -> torch.Tensor | None:
    """`to_wire`'s inverse. Without `copy` the tensor is a view of the arrays (the object store's
    read-only pages: never to be written); with it, memory of its own (one copy; levels sent as
    slices are stacked into it)."""
    if packed is None:
        return None
    import torch

    if isinstance(packed, torch.Tensor):
        return packed.clone() if copy else packed
    name, arrays = packed
    if isinstance(arrays, list):
        array = np.stack(arrays)  # fresh memory already
    else:
        array = np.array(arrays) if copy else arrays  # numpy's copy: one memcpy on this thread
    if not array.flags.writeable:
        _quiet_read_only_views()
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if name == "bfloat16" else tensor


_QUIET = []


def _quiet_read_only_views() -> None:
    """torch has no read-only tensors and warns on every view of read-only memory; our readers of
    such views (the router's HTTP responses, the LLM's copy to its device) never write them. Only
    processes that make such views (ours: a caller's `EncodeResult` always copies) get the filter."""
    if not _QUIET:
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        _QUIET.append(True)


# ---- encoded items ----


def item_to_wire(output: ItemOutput) -> dict:
    """What an encoder replica stores for one item: `{"tokens": array, "deepstack": array, list of
    arrays (one per level) or None, "dtype": "bfloat16" | "float16" | "float32"}`; bfloat16 arrays
    hold the raw words as `uint16`. Plain numpy, so any reader can take it (see the module doc)."""
    dtype, tokens = to_wire(output.tokens)
    deepstack = to_wire(output.deepstack)
    return {"tokens": tokens, "deepstack": None if deepstack is None else deepstack[1], "dtype": dtype}


def item_from_wire(value: dict, copy: bool = False) -> ItemOutput:
    """An `ItemOutput` from what `ray.get` returned for an item. `copy`: tensors of the caller's own
    (write freely); otherwise views of the object store's read-only pages, shared with every other
    reader of the item (the service's own readers only read them)."""
    from models.protocol import ItemOutput

    dtype = value["dtype"]
    deepstack = value["deepstack"]
    return ItemOutput(
        from_wire((dtype, value["tokens"]), copy),
        None if deepstack is None else from_wire((dtype, deepstack), copy),
    )


def item_nbytes(value: dict) -> int:
    """Bytes of an item's arrays."""
    deepstack = value["deepstack"]
    levels = deepstack if isinstance(deepstack, list) else [] if deepstack is None else [deepstack]
    return value["tokens"].nbytes + sum(level.nbytes for level in levels)


# ---- packs ----


@dataclass
class PackRequest:
    """One pack on its way to an encoder replica."""

    pack_id: int
    modality: str
    pixels: list[torch.Tensor]
    """uint8 resized items (`[3, h, w]` or `[T, 3, h, w]`; InternVL: `[tiles, 3, h, w]`), in pack order."""
    specs: list[ItemSpec]
    requests: int = 1
    """Distinct requests whose items the pack holds."""
    router: str = ""
    """The sending router's id."""
    router_waiting_tokens: int = 0
    """Tokens that router had not yet placed on any replica (queued, or waiting for a slot) when
    this pack got its slot: load the replicas' own counts miss, which the autoscaler adds."""
    router_report: int = 0
    """That figure's sequence number at its router: orders its figures across replicas."""

    @property
    def tokens(self) -> int:
        return sum(spec.output_tokens for spec in self.specs)

    def __reduce__(self):  # pixels as numpy: a pickled tensor costs 6x more router CPU per byte
        pixels = [to_wire(p) for p in self.pixels]
        # The router's figures as state: a replica of an earlier version ignores them.
        state = {
            "router": self.router,
            "router_waiting_tokens": self.router_waiting_tokens,
            "router_report": self.router_report,
        }
        return (_pack_from_wire, (self.pack_id, self.modality, pixels, self.specs, self.requests), state)


def _pack_from_wire(pack_id: int, modality: str, pixels: list, specs: list[ItemSpec], requests: int = 1) -> PackRequest:
    return PackRequest(pack_id, modality, [from_wire(p) for p in pixels], specs, requests)


@dataclass
class PackResult:
    """An encoded pack: per-item references into the replica's object store, and where the time went."""

    outputs: list
    """`ray.ObjectRef` of each item's wire form (`item_to_wire`), in pack order: callers, the router
    and the LLM replica pass these along, and whoever needs the tensors reads them from there."""
    item_bytes: list[int]
    replica: str
    """The replica's actor id (its objects are lost if it dies)."""
    queue_s: float
    """Waiting in the replica for the device."""
    forward_s: float
    """Normalize, patchify, encode and copy to host (the whole forward it was merged into)."""
    merged: int = 1
    """Packs in that forward."""


# ---- the LLM ----


@dataclass
class GenerateRequest:
    """What the router sends the LLM: the chat messages (images as placeholders) and embedding references."""

    messages: list[dict]
    """HF chat-template messages; image parts are `{"type": "image"}` (the vLLM replica's: also `{"type": "video"}`)."""
    embeddings: list[Any]
    """One Ray ObjectRef (an item's wire form) per image or video, in message order."""
    grids: list[tuple[int, int, int]]
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    frame_seconds: list[list[float]] = field(default_factory=list)
    """Per video, in message order: each sampled frame's time in seconds (empty: 2 frames a second)."""


@dataclass
class GenerateResult:
    token_ids: list[int]
    text: str
    prompt_tokens: int
    vision_tokens: int
    finish_reason: str
    handoff: dict = field(default_factory=dict)
    """Embedding handoff for this request: bytes fetched and milliseconds spent."""
