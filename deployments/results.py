"""What the Python handle returns: per-item metadata and a reference to the tensors.

The tensors stay in the object store of the encoder replica that made them; the router
only passes references along. A caller reads them from there on first access (`embedding`,
`deepstack`, or `await result.fetch()`), or hands `ref` to its own deployment, which then
reads them itself: no copy passes through the router or the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from .errors import overloaded
from .wire import item_from_wire, item_nbytes

if TYPE_CHECKING:
    import torch

    from models.protocol import ItemOutput

THREAD_COPY_BYTES = 1 << 20
"""`fetch` copies results at least this large in a worker thread, off the caller's event loop."""


@dataclass
class ItemRef:
    """One item's result as a reference (`encode(..., as_refs=True)`)."""

    index: int
    """Position of the item in the request."""
    modality: str
    grid_thw: tuple[int, int, int]
    """Patch grid (t, h, w) exactly as the processor reports it."""
    tokens: int
    """Output tokens (rows of `embedding`)."""
    ref: Any
    """`ray.ObjectRef` of the item's tensors as read-only numpy arrays: `ray.get(ref)` is `{"tokens":
    [tokens, hidden], "deepstack": [levels, tokens, hidden] (or a list of levels) or None, "dtype"}`
    (bfloat16 as raw `uint16` words); `deployments.wire.item_from_wire` makes tensors of it."""
    timing_ms: dict[str, float] = field(default_factory=dict, compare=False, kw_only=True)
    """Where the request's time went in the service, as HTTP's `Server-Timing` header says it."""


@dataclass
class EncodeResult(ItemRef):
    """One item's result; the tensors are read from the encoder replica's object store on first use."""

    _output: ItemOutput | None = field(default=None, repr=False, compare=False)

    def _fetched(self) -> ItemOutput:
        if self._output is None:
            with self._lost_as_503():
                value = ray.get(self.ref)
            self._output = item_from_wire(value, copy=True)
        return self._output

    async def fetch(self) -> EncodeResult:
        """Read the tensors without blocking an event loop (inside async code). Large results are
        copied in a worker thread, so that the caller's event loop keeps serving its other requests."""
        if self._output is None:
            with self._lost_as_503():
                value = await self.ref
            big = item_nbytes(value) >= THREAD_COPY_BYTES
            copy = await asyncio.to_thread(item_from_wire, value, True) if big else item_from_wire(value, True)
            if self._output is None:  # a concurrent fetch may have finished first: keep the copy it gave
                self._output = copy
        return self

    @contextlib.contextmanager
    def _lost_as_503(self):
        """The tensors live with the encoder replica that computed them (Ray 2.56 removed `ray.put`'s
        `_owner`, which could have given them to a longer-lived process): if it died before they were
        read, the caller gets the same 503 an HTTP client gets, not Ray's internal error."""
        try:
            yield
        except (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectReconstructionFailedError) as error:
            raise overloaded(
                f"items[{self.index}]: the encoder replica that computed this result failed before it was "
                "read; send the request again",
                1,
            ) from error

    @property
    def embedding(self) -> torch.Tensor:
        """`[tokens, hidden]` in the tower's dtype."""
        return self._fetched().tokens

    @property
    def deepstack(self) -> torch.Tensor | None:
        """`[num_deepstack, tokens, hidden]` (Qwen3-VL) or None."""
        return self._fetched().deepstack

    def __getstate__(self) -> dict:  # the reference travels, never fetched tensors
        return {**self.__dict__, "_output": None}
