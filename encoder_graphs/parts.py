"""The parts one runner's serving path and its warm-up share (`RunnerParts`), built once
(`build_parts`): the graph table and its buffers, the routes, the costs, the capture, the stats,
the device lock, and the little state the two pass each other (`Demand`, the warm-up record).
Neither side knows the other: each takes these parts, and `EncoderRunner` wires them."""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from models.protocol import EncoderOutput, PrecompiledRegions, VisionEncoder, precompiled_regions

from .cache_trust import signer
from .capture import GraphCapture
from .compile_cache import CompileCache, cache_key, environment
from .config import GraphConfig, Ladder, budget_ladder
from .entry import GraphKey
from .exact_route import ExactRoute
from .execute import EntryIO, Forwards
from .memory import MemoryReport
from .plan import Planner
from .recurring import RecurringGraphs
from .route_costs import RouteCosts
from .stats import RunnerStats
from .table import GraphTable
from .warmup_record import RecordKeeper


class Demand:
    """Packs served before their graph was live, per graph they needed (the warm-up builds the most
    needed first), until the warm-up reaches full speed. Read and written under the device lock."""

    def __init__(self, table: GraphTable):
        self.table = table
        self.counts: Counter[GraphKey] = Counter()
        self.full_speed = False
        """Every graph built or refused, every configured route live: no demand is noted from then on."""

    def note(self, budget: int, longest: int) -> None:
        """A pack that fits `budget` was served before its graph was live: build that one sooner."""
        needed = self.table.needed(budget, longest)
        if needed is not None and not needed.live:
            self.counts[needed.key] += 1


@dataclass
class RunnerParts:
    """Everything a runner's packs and its warm-up work on; `capture` None: no CUDA graphs."""

    encoder: VisionEncoder
    config: GraphConfig
    ladder: Ladder
    use_graphs: bool
    stats: RunnerStats
    memory: MemoryReport
    table: GraphTable
    forwards: Forwards
    io: EntryIO
    costs: RouteCosts
    exact: ExactRoute
    capture: GraphCapture | None
    recurring: RecurringGraphs
    planner: Planner
    compile_cache: CompileCache | None
    record: RecordKeeper
    """The warm-up record: loaded and saved by the warm-up, removed by a failed first-pack check."""
    demand: Demand
    device_lock: threading.RLock = field(default_factory=threading.RLock)
    """Held by every pack and by each warm-up step that touches the device's shared state
    (see `warmup.py`); a replica takes it around its device-side preprocessing too."""
    precompiled: PrecompiledRegions | None = None
    """The regions compiled ahead of time (`GraphConfig.precompile_regions`): loaded from and saved
    to the compile cache by the warm-up, which alone may compile new variants."""

    @property
    def device(self) -> torch.device:
        return self.encoder.device

    @property
    def checks(self) -> bool:
        """Whether graphs are checked against eager (a padded budget run without graphs is only
        where it is compiled; uncompiled, it is the eager path itself)."""
        return self.config.self_check and (self.use_graphs or self.forwards.compiled is not None)


def build_parts(
    encoder: VisionEncoder,
    config: GraphConfig = GraphConfig(),
    ladder: Ladder | None = None,
    compiled_forward: Callable[..., EncoderOutput] | None = None,
    precompiled: PrecompiledRegions | None = None,
) -> RunnerParts:
    """The parts for `encoder` (see `EncoderRunner` for the arguments); allocates the static buffers."""
    device = encoder.device
    if precompiled is None and compiled_forward is None and config.precompile_regions and device.type == "cuda":
        precompiled = precompiled_regions()
    if precompiled is not None:
        if compiled_forward is not None:
            raise ValueError("give a compiled forward or regions to precompile, not both")
        compiled_forward = encoder.compiled_forward(precompiled)
    ladder = ladder or budget_ladder(config, encoder.min_item_tokens)
    use_graphs = config.cuda_graphs and device.type == "cuda"
    stats = RunnerStats()
    memory = MemoryReport()
    table = GraphTable(encoder, config, ladder, stats)
    memory.static_buffer_bytes = table.static_bytes
    if compiled_forward is None and config.compile and device.type == "cuda":
        compiled_forward = encoder.compiled_forward(functools.partial(torch.compile, dynamic=True))
    forwards = Forwards(encoder.forward_padded, compiled_forward)
    io = EntryIO(encoder, forwards, stats)
    costs = RouteCosts(device)
    exact = ExactRoute(encoder, forwards, stats)
    capture = GraphCapture(device, memory) if use_graphs else None
    recurring = RecurringGraphs(encoder, config, table, io, capture, costs, stats, memory)
    planner = Planner(table, costs, exact)
    cache = None
    if config.compile_cache is not None:
        cache = _compile_cache(encoder, config, ladder, table, use_graphs, precompiled)
    checks = config.self_check and (use_graphs or compiled_forward is not None)
    settings = {"tolerance": config.self_check_tolerance, "compiled": compiled_forward is not None}
    record = RecordKeeper(cache if checks else None, settings, config.reuse_checks)
    return RunnerParts(
        encoder, config, ladder, use_graphs, stats, memory, table, forwards, io, costs, exact, capture, recurring,
        planner, cache, record, Demand(table), precompiled=precompiled,
    )  # fmt: skip


def _compile_cache(
    encoder: VisionEncoder,
    config: GraphConfig,
    ladder: Ladder,
    table: GraphTable,
    use_graphs: bool,
    precompiled: PrecompiledRegions | None,
) -> CompileCache:
    layouts = {
        "dynamic": True,
        "regions": "layer" if precompiled is None else f"layer-aot-{precompiled.backend}",
        "graphs": sorted(table.entries),
        "max_segments": ladder.max_segments,
        "segment_density": config.segment_density,
        "cuda_graphs": use_graphs,
        "compile_exact": config.compile_exact,
    }
    key = cache_key(encoder.compile_identity(), layouts, environment(encoder.device))
    return CompileCache(config.compile_cache, key, signer(config.compile_cache_key_file, config.compile_cache))
