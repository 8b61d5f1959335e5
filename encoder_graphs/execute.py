"""Running one entry's static buffers (`EntryIO`): fill, replay (or its forward), copy out; and the
padded forwards the runner's routes call (`Forwards`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from models.protocol import EncoderOutput, ItemOutput, ItemSpec, RegionMiss, VisionEncoder

from .entry import GraphEntry
from .stats import RunnerStats

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def compile_state():
    """The global state every compiled call runs in (warm-up, capture, exact route, recurring
    graphs), whatever the caller's: dynamo guards on grad mode, so a compile made with grad off
    would be missed by a caller with grad on. Not inference mode: compiling views under it fails
    in AOT functionalization."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def would_compile(error: BaseException) -> bool:
    """Whether `error` says the compiled forward would have needed a compile where it may not
    (dynamo's "fail_on_recompile" stance, or a precompiled region's guard miss): the caller runs
    the pack uncompiled instead."""
    return isinstance(error, RegionMiss) or (isinstance(error, RuntimeError) and "fail_on_recompile" in str(error))


@dataclass(frozen=True)
class Forwards:
    """The padded forwards of a runner: the encoder's own and, with `compile`, its compiled one."""

    plain: Callable[..., EncoderOutput]
    compiled: Callable[..., EncoderOutput] | None = None

    @property
    def padded(self) -> Callable[..., EncoderOutput]:
        return self.compiled or self.plain


def split_outputs(out: EncoderOutput, specs: Sequence[ItemSpec]) -> list[ItemOutput]:
    """Per-item views of a pack's outputs (items in pack order)."""
    results, start = [], 0
    for spec in specs:
        end = start + spec.output_tokens
        deepstack = None if out.deepstack is None else out.deepstack[:, start:end]
        results.append(ItemOutput(tokens=out.tokens[start:end], deepstack=deepstack))
        start = end
    return results


def copied(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of `tensor` on `device`, not waited for. From a GPU to the host it lands in page-locked
    memory (torch's caching host allocator keeps the blocks for the next pack): a copy into fresh
    pageable memory faults in every page and moves a large pack's outputs at a fraction of the bus's speed."""
    if device.type == "cpu" and tensor.is_cuda:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)
    return tensor.to(device, copy=True)


def item_outputs(
    out: EncoderOutput, specs: Sequence[ItemSpec], device: torch.device, copy: bool = False
) -> list[ItemOutput]:
    """Per-item outputs on `device`: views of `out` where it already lies there (unless `copy`),
    else one copy (not waited for) laid out item after item, each item's tokens and deepstack
    levels one contiguous block: a reader of one item then takes it as it lies, where a view of
    the pack's `[levels, rows, hidden]` deepstack would have to be gathered first."""
    items = split_outputs(out, specs)
    if not items or (out.tokens.device == device and not copy):
        return items
    pieces = [piece for item in items for piece in (item.tokens, *(() if item.deepstack is None else item.deepstack))]
    flat = torch.cat(pieces)  # the gather is the copy where `out` lies; off a GPU, one copy more
    if flat.device != device:
        flat = copied(flat, device)
    laid, offset = [], 0
    for item in items:
        rows = item.tokens.shape[0]
        tokens, offset = flat[offset : offset + rows], offset + rows
        deepstack = None
        if item.deepstack is not None:
            levels = item.deepstack.shape[0]
            deepstack = flat[offset : offset + levels * rows].view(levels, rows, -1)
            offset += levels * rows
        laid.append(ItemOutput(tokens, deepstack))
    return laid


def moved_items(out: EncoderOutput, specs: Sequence[ItemSpec], device: torch.device) -> list[ItemOutput]:
    """`item_outputs` of `out` on `device`, the copies done."""
    items = item_outputs(out, specs, device)
    if out.tokens.is_cuda and device.type != "cuda":
        torch.cuda.current_stream(out.tokens.device).synchronize()
    return items


class EntryIO:
    """Copies into an entry's static inputs, runs it, and copies its used outputs out."""

    def __init__(self, encoder: VisionEncoder, forwards: Forwards, stats: RunnerStats):
        self.encoder = encoder
        self.forwards = forwards
        self.stats = stats

    def fill(
        self,
        entry: GraphEntry,
        pixel_values: torch.Tensor | Sequence[torch.Tensor],
        metadata: dict[str, torch.Tensor] | None,
    ) -> None:
        """Copy a pack (its rows, or consecutive blocks of them) and its metadata (None: the
        entry's own, kept) into the entry's static inputs; padding rows are zeroed."""
        for name, host in (metadata or {}).items():
            static = entry.inputs[name]
            if static.is_cuda and not host.is_cuda and not host.is_pinned():
                # a copy from pageable memory waits for the stream's earlier work (a graph's replay
                # still running): page-locked, it is queued and the host goes on
                host = host.pin_memory()
            static.copy_(host, non_blocking=True)
        static = entry.inputs["pixel_values"]
        used = 0
        for block in [pixel_values] if isinstance(pixel_values, torch.Tensor) else pixel_values:
            static[used : used + block.shape[0]].copy_(block)
            used += block.shape[0]
        static[used:].zero_()

    def fill_empty(self, entry: GraphEntry) -> None:
        """The entry's buffers as for a pack of no items (all padding): what capture runs on."""
        empty = torch.zeros(0, self.encoder.patch_dim, device=self.encoder.device)
        self.fill(entry, empty, self.encoder.pack_metadata([], entry.layout))

    def compute(self, entry: GraphEntry, inputs: dict[str, torch.Tensor]) -> EncoderOutput:
        """The entry's forward on `inputs` (its own, or others of the same specs)."""
        metadata = {name: t for name, t in inputs.items() if name != "pixel_values"}
        forward = entry.forward or self.forwards.padded
        exact = entry.specs is not None
        hint = self.encoder.exact_segments(entry.specs) if exact else contextlib.nullcontext()
        with compile_state(), hint:
            return forward(inputs["pixel_values"], metadata, entry.layout, *((True,) if exact else ()))

    def forward_into(self, entry: GraphEntry) -> None:
        """The entry's forward on its static inputs, into its static outputs (what a graph captures)."""
        out = self.compute(entry, entry.inputs)
        entry.outputs["tokens"].copy_(out.tokens)
        finite = torch.isfinite(out.tokens).all(dim=-1)
        if out.deepstack is not None:
            entry.outputs["deepstack"].copy_(out.deepstack)
            finite &= torch.isfinite(out.deepstack).all(dim=-1).all(dim=0)
        # Per-row flags computed inside the graph: the host checks the used rows it copies out
        # anyway, instead of scanning the outputs again.
        entry.outputs["finite"].copy_(finite)

    def execute(self, entry: GraphEntry) -> None:
        """Replay the entry's graph, or run its forward (the compiled one never compiles here)."""
        if entry.graph is not None:
            entry.graph.replay()
            return
        compiled = self.forwards.compiled
        if compiled is None or entry.forward not in (None, compiled):
            self.forward_into(entry)
            return
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                self.forward_into(entry)
        except RuntimeError as error:
            if not would_compile(error):
                raise
            self.stats.recompile_fallbacks += 1
            logger.warning("the compiled forward would recompile for budget %s; it runs uncompiled", entry.key)
            entry.forward = self.forwards.plain
            self.forward_into(entry)

    def take(
        self, entry: GraphEntry, specs: Sequence[ItemSpec], device: torch.device
    ) -> tuple[list[ItemOutput], torch.Tensor]:
        """The items' outputs, copied (once) out of the shared static outputs to `device`, and
        whether all of them are finite (a 0-dim tensor computed after the copies; reading it waits)."""
        tokens = sum(s.output_tokens for s in specs)
        deepstack = entry.outputs.get("deepstack")
        used = EncoderOutput(entry.outputs["tokens"][:tokens], None if deepstack is None else deepstack[:, :tokens])
        return item_outputs(used, specs, device, copy=True), entry.outputs["finite"][:tokens].all()

    def launch(
        self,
        entry: GraphEntry,
        metadata: dict[str, torch.Tensor] | None,
        pixel_values: torch.Tensor | Sequence[torch.Tensor],
        specs: Sequence[ItemSpec],
        output_device: torch.device,
    ) -> tuple[list[ItemOutput], torch.Tensor]:
        """Fill, replay and copy out, without waiting for the GPU: the items' outputs and their finite flag."""
        self.fill(entry, pixel_values, metadata)
        self.execute(entry)
        return self.take(entry, specs, output_device)
