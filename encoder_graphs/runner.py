"""The encoder runner (`EncoderRunner`): one encoder's serving path (`serving.py`) and its warm-up
(`warmup.py`), wired over one set of parts built once (`parts.py`); neither side knows the other.

Startup: `prepare()` (seconds; from then on every pack runs eagerly on its exact layout), then
`warm_up()` (a background thread in a replica) switches graphs live one at a time. `run(pixel_values,
specs)` runs one pack (`PackServer.run`), safe to call while the warm-up runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from models.protocol import EncoderOutput, PrecompiledRegions, VisionEncoder

from .config import GraphConfig, Ladder
from .entry import GraphEntry, GraphKey
from .parts import build_parts
from .serving import PackServer, canonical_order
from .warmup import WarmUp, WarmupStatus

__all__ = ["EncoderRunner", "WarmupStatus", "canonical_order"]

logger = logging.getLogger(__name__)


class EncoderRunner(PackServer):
    """Runs packs of one encoder through live graphs (CUDA), padded buffers (CPU) or eagerly, and warms it up."""

    def __init__(
        self,
        encoder: VisionEncoder,
        config: GraphConfig = GraphConfig(),
        ladder: Ladder | None = None,
        compiled_forward: Callable[..., EncoderOutput] | None = None,
        precompiled: PrecompiledRegions | None = None,
    ):
        """`ladder`: the deployment's (default: computed from `config`); `compiled_forward`: a
        compiled `encoder.forward_padded` to use (default with `config.compile` on CUDA: the
        encoder's `compiled_forward`, its repeated layer compiled once by `torch.compile`; tests
        pass dynamo's "eager" backend on CPU); `precompiled`: instead, regions to compile ahead of
        time (default with `config.precompile_regions` on CUDA: `models.protocol.precompiled_regions()`;
        tests pass the "eager" backend's on CPU)."""
        super().__init__(build_parts(encoder, config, ladder, compiled_forward, precompiled))
        self.warmup = WarmUp(self.parts)

    @property
    def entries(self) -> dict[GraphKey, GraphEntry]:
        """The budget graphs by (token_budget, max_seqlen)."""
        return self.table.entries

    # ---- startup ----

    def prepare(self, progress: Callable[[str], None] = logger.info) -> None:
        """Memory check (CUDA graphs: raises `GraphMemoryError`) and the eager path checked on a
        reference pack; seconds. Afterwards every pack runs (eagerly until graphs are live)."""
        self.warmup.prepare(progress)

    def warm_up(
        self, progress: Callable[[str], None] = logger.info, stop: threading.Event | None = None
    ) -> WarmupStatus:
        """Costs, compile, graphs (each live once checked), the exact route; until full speed or
        `stop`. Safe to run in a background thread while `run` serves packs."""
        return self.warmup.run(progress, stop or threading.Event())

    def warmup_status(self) -> WarmupStatus:
        return self.warmup.status()

    def live_budgets(self) -> tuple[int, ...]:
        """Ladder budgets whose packs replay a live graph (the router may prefer such replicas)."""
        return self.table.live_budgets()

    # ---- reporting ----

    def describe(self) -> dict:
        """Budgets, graphs, warm-up and stats for `/v1/models` and logs."""
        return {
            "budgets": list(self.ladder.budgets),
            "graph_budgets": list(self.table.budgets),
            "live_budgets": list(self.live_budgets()),
            "max_items_per_pack": self.ladder.max_items,
            "max_segments_per_pack": self.ladder.max_segments,
            "cuda_graphs": self.use_graphs,
            "compiled_exact_route": self.exact.live,
            "compiled_exact_min_rows": self.exact.min_rows if self.exact.live else None,
            "graphs": len(self.table.entries),
            "graphs_enabled": self.table.enabled_count(),
            "graphs_live": self.table.live_count(),
            "warmup": self.warmup_status().as_dict(),
            "recurring_graphs": len(self.recurring.entries),
            "startup_costs_ms": {
                route: [[tokens, round(ms, 3)] for tokens, ms in points]
                for route, points in list(self.costs.startup.items())
            },
            "learned_cold_ms": None if self.costs.cold_ms is None else round(self.costs.cold_ms, 2),
            # a copy first: a pack on the worker thread may add a key meanwhile
            "learned_route_scale": {
                f"{route}@{budget}": round(v, 3) for (route, budget), v in list(self.costs.route_scale.items())
            },
            "memory": self.memory.summary() if self.use_graphs else None,
            "stats": self.stats.snapshot(),
        }
