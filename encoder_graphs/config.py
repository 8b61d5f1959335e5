"""How a runner lays out budgets and graphs (`GraphConfig`), and the budget ladder it builds."""

from __future__ import annotations

from dataclasses import dataclass

from .budgets import auto_ladder, validate_ladder

DEFAULT_MAX_ITEMS = 64


@dataclass(frozen=True)
class GraphConfig:
    """How a runner lays out budgets and graphs (validated by the deployment's pydantic config)."""

    max_budget_tokens: int = 8192
    """Largest token budget (output tokens); larger packs run eagerly."""
    budgets: tuple[int, ...] | None = None
    """Explicit budget list; None: automatic ladder from `min_budget_tokens`."""
    min_budget_tokens: int = 64
    """Smallest budget of the automatic ladder (raised to the model's smallest item)."""
    budget_growth: float = 2.0
    """Ratio between consecutive budgets of the automatic ladder below `fine_budget_tokens`."""
    fine_budget_tokens: int = 128
    """From this budget up, the automatic ladder splits each doubling into `fine_budget_steps`."""
    fine_budget_steps: int = 8
    """Steps per doubling above `fine_budget_tokens` (1: keep doubling): no pack that large pads
    more than 1/`fine_budget_steps` of its budget. From ~128 tokens up a replay's time grows with
    its rows, padding included, in steps (Qwen3-VL-8B, H100, startup timings of one run: 2.4 ms at
    128 tokens, 3.5 at 256, 5.2 at 512, 9.4 at 1024; `encoder_bench_qwen3_session16.json`). One
    896x896 image (784 tokens) replays in 11.5 ms in the 832-token graph against 14.1 in the 1024
    one; 8 x 448x448 (1568 tokens) ran 16.1 ms in the 1664-token graph, 17.3 on the compiled exact
    route when the next budget was 2048 (`encoder_bench_qwen3_session15.md`). 16 steps: 226
    graphs, ~2% faster large first sightings, ~100 s more startup (`first_sighting_probe_steps*`).
    CUDA runners under attention backends other than "triton" keep the doubling budgets of this
    ladder only: they take a graph per doubling `max_seqlen` bucket, and the 8-step ladder's 50 budgets would be 267
    graphs (`attention.graph_seqlen_buckets`).
    The router packs against the full ladder either way (its pack-fill metric then counts
    against budgets such a replica rounds up)."""
    finer_budget_range: tuple[int, int] | None = (1024, 4096)
    """Budgets from the first up to (not including) the second take `finer_budget_steps` steps
    per doubling instead of `fine_budget_steps` (None: no such range). Where a pack of a few
    images lands, and where a graph's self-check (eager, the compiled exact route and the replay,
    four runs each) still costs well under a second; a graph of 4096-8192 tokens costs 2-6 s
    (Qwen3-VL-8B, H100), which is why 16 steps everywhere added ~100 s (226 graphs)."""
    finer_budget_steps: int = 16
    """Steps per doubling inside `finer_budget_range`: no pack there pads more than 1/16. With 16
    against 8, Qwen3-VL-8B's 8 x 448x448 (1568 tokens) lands in the 1600-token graph instead of
    1664, 1792x1792 (3136) in 3200 instead of 3328, the mixed pack (2080) in 2176 instead of 2304.
    16 more budgets, 162 graphs instead of 114; the self-check took 117 s instead of 89 and the
    captures 6.5 s as before, startup 275 s against 263 on another host
    (`encoder_bench_qwen3_session17_finer.json`, `encoder_bench_qwen3_session16_final.json`)."""
    max_items_per_pack: int | None = None
    """Most items one pack may hold; must be <= the smallest budget. None: min(64, smallest budget)."""
    max_segments_per_pack: int | None = None
    """Most attention segments (image frames; a video has one per temporal patch) any graph's
    buffers hold. None: twice the items per pack. Keep it tight: unused slots slow the
    attention kernel."""
    segment_density: int = 8
    """Each graph holds `segment_density` segments per `max_seqlen` of its rows (at least that
    many, at most `max_segments_per_pack`), so empty slots cost in proportion to rows, not to
    slots x max_seqlen. A pack with more segments than its graph holds moves up to the next
    budget whose graph holds it, or runs eagerly."""
    min_seqlen_bucket: int = 256
    """Smallest attention-length bucket, in patches; buckets double from it."""
    cuda_graphs: bool = True
    """Capture CUDA graphs (CUDA only; on CPU packs run padded without graphs)."""
    self_check: bool = True
    """Replay each graph on a synthetic pack at startup; disable any that disagrees with eager."""
    self_check_tolerance: float = 0.05
    """Largest relative error (max abs diff / max abs value) a graph may show against eager."""
    memory_fraction: float = 0.8
    """Share of free GPU memory the graphs and static buffers may take."""
    compile: bool = False
    """`torch.compile` the padded forward (dynamic shapes, one compile for every budget)
    before capture. Fuses the tower's elementwise work; costs startup time."""
    compile_exact: bool = True
    """With `compile`: packs of equal attention segments that run without a graph (larger
    than every budget, or cheaper unpadded by the measured costs) run through the compiled
    forward on their exact layout (one dense attention batch), not the transformers modules.
    Costs two more compiles at startup (one segment, several; the segment lengths are read at
    run time inside an opaque op, so the same compile also serves recurring graphs of mixed
    packs); the route is checked against eager at startup like the graphs (turned off if
    wrong) and offered only from the smallest size at which its compile was seen to hold. A
    pack that would still need a compile runs uncompiled and is counted
    (`recompile_fallbacks`). Packs of unequal segments take it under attention backend
    "triton" (one launch per layer over all segments); under the others they keep the padded
    graphs or uncompiled eager: each run of equal segments would be one more dense call's host
    time, which outside a graph cost more than it saved on some hosts (see `_compiles_exact`)."""
    recurring_graphs: int = 16
    """Most graphs of recurring packs' exact layouts kept (least recently used evicted); 0: off.
    Each costs its own input buffers (its pixels and metadata: ~18 MiB for 8 x 448x448 of
    Qwen3-VL-8B) and whatever the shared pool grows by while capturing it (both reported)."""
    recurring_after: int = 2
    """A pack gets its own graph the time its key (items' grids, in any order) is seen this often."""


def build_ladder(config: GraphConfig, smallest_item_tokens: int, fine: bool = True) -> tuple[tuple[int, ...], int]:
    """(budget ladder, max items per pack) for a model whose smallest item has this many tokens.
    `fine=False`: the automatic ladder without its fine steps (`fine_budget_steps`, the finer range)."""
    if config.budgets is not None:
        ladder = tuple(config.budgets)
    else:
        start = max(min(config.min_budget_tokens, config.max_budget_tokens), smallest_item_tokens)
        steps = config.fine_budget_steps if fine else 1
        finer = None
        if fine and config.finer_budget_range is not None:
            finer = (*config.finer_budget_range, config.finer_budget_steps)
        ladder = auto_ladder(
            start, config.max_budget_tokens, config.budget_growth, config.fine_budget_tokens, steps, finer
        )
    max_items = config.max_items_per_pack
    if max_items is None:
        max_items = min(DEFAULT_MAX_ITEMS, min(ladder, default=1))
    return validate_ladder(ladder, max_items), max_items
