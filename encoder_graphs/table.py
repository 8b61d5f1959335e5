"""The budget graphs of a runner (`GraphTable`): their layouts, the static buffers they share, where a
pack fits, and which are live."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from models.protocol import ItemSpec, PackCapacityError, PackLayout, TensorSpec, VisionEncoder

from .budgets import buckets_for_budget, fitting_budget, segment_capacity, seqlen_buckets
from .buffers import StaticBuffers
from .config import GraphConfig, Ladder
from .entry import DISABLED, GraphEntry, GraphKey
from .stats import RunnerStats

logger = logging.getLogger(__name__)


def input_specs(encoder: VisionEncoder, layout: PackLayout) -> dict[str, TensorSpec]:
    """The static inputs of a graph of `layout`: pixel rows and the encoder's metadata."""
    rows = layout.token_budget * encoder.merge_unit
    pixels = TensorSpec((rows, encoder.patch_dim), encoder.dtype)
    return {"pixel_values": pixels, **encoder.metadata_specs(layout)}


def output_specs(encoder: VisionEncoder, layout: PackLayout) -> dict[str, TensorSpec]:
    """The static outputs of a graph of `layout`: tokens, deepstack maps, a finite flag per token."""
    out = {"tokens": TensorSpec((layout.token_budget, encoder.out_hidden), encoder.dtype)}
    if encoder.num_deepstack:
        shape = (encoder.num_deepstack, layout.token_budget, encoder.out_hidden)
        out["deepstack"] = TensorSpec(shape, encoder.dtype)
    out["finite"] = TensorSpec((layout.token_budget,), torch.bool)
    return out


class GraphTable:
    """The (budget, max_seqlen) entries of one encoder over shared static buffers."""

    def __init__(self, encoder: VisionEncoder, config: GraphConfig, ladder: Ladder, stats: RunnerStats):
        self.encoder = encoder
        self.ladder = ladder
        self.stats = stats
        largest_rows = ladder.budgets[-1] * encoder.merge_unit
        doubling = encoder.graph_seqlen_buckets(largest_rows) is None
        # Graphs per budget are bounded unless buckets double; then only the coarse budgets get
        # graphs on CUDA (on CPU no graph is captured, so every budget keeps its layout).
        self.budgets = ladder.coarse if doubling and encoder.device.type == "cuda" else ladder.budgets
        """Budgets that have graphs (ascending); a pack takes the smallest that fits it."""
        doubled = seqlen_buckets(config.min_seqlen_bucket, largest_rows)
        layouts = []
        for budget in self.budgets:
            rows = budget * encoder.merge_unit
            buckets = buckets_for_budget(doubled, rows) if doubling else encoder.graph_seqlen_buckets(rows)
            for seqlen in buckets:
                slots = segment_capacity(rows, seqlen, config.segment_density, ladder.max_segments)
                layouts.append(encoder.pack_layout(budget, seqlen, slots))
        ins = {(lay.token_budget, lay.max_seqlen): input_specs(encoder, lay) for lay in layouts}
        outs = {(lay.token_budget, lay.max_seqlen): output_specs(encoder, lay) for lay in layouts}
        self.inputs = StaticBuffers(ins.values(), encoder.device)
        self.outputs = StaticBuffers(outs.values(), encoder.device)
        self.entries: dict[GraphKey, GraphEntry] = {
            key: GraphEntry(key, lay, self.inputs.views(ins[key]), self.outputs.views(outs[key]))
            for key, lay in zip(ins, layouts)
        }
        self.by_budget = {
            budget: sorted((e for e in self.entries.values() if e.key[0] == budget), key=lambda e: e.key[1])
            for budget in self.budgets
        }

    @property
    def static_bytes(self) -> int:
        return self.inputs.nbytes + self.outputs.nbytes

    def fitting_budget(self, tokens: int) -> int | None:
        """The smallest graph budget that holds `tokens`, or None (larger than every budget)."""
        return fitting_budget(self.budgets, tokens)

    def candidates(self, budget: int, longest: int) -> list[GraphEntry]:
        """Live graphs of `budget` whose bucket holds a `longest`-patch frame, smallest first."""
        return [e for e in self.by_budget[budget] if e.key[1] >= longest and e.live]

    def needed(self, budget: int, longest: int) -> GraphEntry | None:
        """The graph a pack of `budget` with a `longest`-patch frame would use, live or still to
        be built (None: none can serve it)."""
        return next((e for e in self.by_budget[budget] if e.key[1] >= longest and e.enabled), None)

    def place(self, specs: Sequence[ItemSpec], budget: int) -> tuple[GraphEntry, dict[str, torch.Tensor]] | None:
        """(entry, host metadata) of the first live graph from `budget` up whose buffers hold the
        pack, or None. A pack with more segments than its own budget's graphs hold moves up."""
        longest = max(s.frame_patches for s in specs)
        for larger in self.budgets[self.budgets.index(budget) :]:
            for entry in self.candidates(larger, longest):
                try:
                    return entry, self.encoder.pack_metadata(specs, entry.layout)
                except PackCapacityError:
                    continue
        return None

    def disable(self, entry: GraphEntry, why: str) -> None:
        """Refuse a budget graph for good (counted, logged); its packs go elsewhere."""
        entry.state = DISABLED
        self.stats.disabled_graphs += 1
        logger.warning("disabled graph budget=%d max_seqlen=%d: %s", *entry.key, why)

    def live_count(self) -> int:
        return sum(e.live for e in self.entries.values())

    def enabled_count(self) -> int:
        return sum(e.state != DISABLED for e in self.entries.values())

    def costs_measured(self) -> bool:
        """Whether graphs carry replay timings (CUDA graphs): plans then weigh routes by cost."""
        return any(not math.isnan(e.replay_ms) for e in self.entries.values())

    def live_budgets(self) -> tuple[int, ...]:
        """Ladder budgets whose packs replay a live graph whatever their segments: every enabled
        graph of the graph budget they fit is live."""
        ready = {
            budget
            for budget, entries in self.by_budget.items()
            if any(e.live for e in entries) and all(e.live for e in entries if e.enabled)
        }
        return tuple(b for b in self.ladder.budgets if self.fitting_budget(b) in ready)
