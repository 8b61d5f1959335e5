"""How a runner lays out budgets and graphs (`GraphConfig`), and the budget ladder (`Ladder`).

`GraphConfig` is a standard-library dataclass so that `encoder_graphs` needs no pydantic; the
deployment's pydantic config uses it as a field type directly (pydantic validates standard
dataclasses, reads `__pydantic_config__` and the attribute docstrings as field descriptions, and
runs `__post_init__`, whose errors name the field and the fix).
"""

from __future__ import annotations

from dataclasses import dataclass

from .budgets import BudgetConfigError, auto_ladder, fitting_budget, validate_ladder

DEFAULT_MAX_ITEMS = 64


@dataclass(frozen=True)
class GraphConfig:
    """Token budgets, CUDA graphs, compilation and warm-up of one encoder's runner."""

    __pydantic_config__ = {"extra": "forbid", "use_attribute_docstrings": True}

    max_budget_tokens: int = 8192
    """Largest token budget (output tokens); larger packs run eagerly."""
    budgets: tuple[int, ...] | None = None
    """Explicit budget list (output tokens); null: the automatic ladder from `min_budget_tokens`."""
    min_budget_tokens: int = 64
    """Smallest budget of the automatic ladder (raised to the model's smallest item)."""
    budget_growth: float = 2.0
    """Ratio between consecutive budgets of the automatic ladder below `fine_budget_tokens`."""
    fine_budget_tokens: int = 128
    """From this budget up, the automatic ladder splits each doubling into `fine_budget_steps`."""
    fine_budget_steps: int = 8
    """Budgets per doubling above `fine_budget_tokens` (1: plain doubling): no pack that large pads
    more than 1/`fine_budget_steps` of its budget, since a replay's time grows with its rows,
    padding included. Encoders whose graphs take one `max_seqlen` bucket per doubling capture only
    the ladder's doubling budgets (`Ladder.coarse`); the router packs against the full ladder."""
    finer_budget_range: tuple[int, int] | None = (1024, 4096)
    """Budgets from the first up to (not including) the second take `finer_budget_steps` per
    doubling instead (null: no such range): where packs of a few images land."""
    finer_budget_steps: int = 16
    """Budgets per doubling inside `finer_budget_range`."""
    max_items_per_pack: int | None = None
    """Most items one pack may hold; must be <= the smallest budget. Null: min(64, smallest budget)."""
    max_segments_per_pack: int | None = None
    """Most attention segments (image frames; a video has one per temporal patch) any graph's
    buffers hold. Null: twice the items per pack. Unused slots slow a varlen attention kernel."""
    segment_density: int = 8
    """Each graph holds this many segments per `max_seqlen` of its rows (at least this many, at
    most `max_segments_per_pack`), so empty slots cost in proportion to rows. A pack with more
    segments than its graph holds moves up a budget, or runs eagerly."""
    min_seqlen_bucket: int = 256
    """Smallest attention-length bucket (patches) where buckets double."""
    cuda_graphs: bool = True
    """Capture CUDA graphs (CUDA only; on CPU packs run padded without graphs)."""
    self_check: bool = True
    """Check each graph once against the eager path when it is built (unless a record of an earlier
    warm-up's checks is used: `reuse_checks`), and again on the first real pack it serves; a graph
    that disagrees is disabled and its pack served eagerly."""
    self_check_tolerance: float = 0.05
    """Largest relative error (max abs diff / max abs value) a graph may show against eager."""
    memory_fraction: float = 0.8
    """Share of free GPU memory the graphs and static buffers may take."""
    compile: bool = False
    """`torch.compile` the tower before capture (dynamic shapes; its repeated layer compiled once
    for all layers): fuses the tower's elementwise work at the cost of compile time, spent in the
    background warm-up."""
    compile_exact: bool = True
    """With `compile`: packs without a graph (larger than every budget, or cheaper unpadded) run
    the compiled forward on their exact layout where attention takes one launch per layer; costs
    two more compiles in the warm-up, and is checked against eager there."""
    precompile_regions: bool = False
    """With `compile`: compile the tower's regions ahead of time (`torch.compile(...).aot_compile`)
    in the warm-up and keep them in `compile_cache` (signed, per code version), so that later starts
    load them without dynamo tracing; a pack none of them fits runs uncompiled. Off: dynamo traces
    on every start (the cache then spares inductor's work only). The GPU configs turn it on."""
    compile_cache: str | None = None
    """Directory (shared storage on a cluster) where compiled artifacts are kept, keyed by model,
    layouts, torch, Triton and GPU, so later replicas and restarts load them instead of compiling.
    Null: no cache beyond torch's local one. Only files signed with the service's key are loaded
    (`compile_cache_key_file`); others are ignored and compiled anew."""
    compile_cache_key_file: str | None = None
    """With `compile_cache`: a file holding the key (at least 32 bytes, e.g. `openssl rand -hex 32`)
    that signs the cache's files, the same on every node (a mounted secret), so that replicas on
    all nodes trust what any of them saved. Null: each node generates its own key
    (`$XDG_STATE_HOME/vlm-encoder-serve/compile-cache.key`, mode 0600) and trusts only its own files."""
    reuse_checks: bool = True
    """With `compile_cache`: a start whose cache holds the record of an earlier warm-up of the same
    graphs, code, settings and environment captures each graph without checking and timing it again
    (each is still checked on its first real pack; a mismatch there removes the record); the first
    warm-up writes the record."""
    recurring_graphs: int = 16
    """Most graphs of recurring packs' exact layouts kept (least recently used evicted); 0: off."""
    recurring_after: int = 2
    """A pack gets its own graph the time its key (items' grids, in any order) is seen this often."""

    def __post_init__(self) -> None:
        if self.budgets is not None and not isinstance(self.budgets, tuple):
            object.__setattr__(self, "budgets", tuple(self.budgets))
        positive = ("max_budget_tokens", "min_budget_tokens", "fine_budget_tokens", "segment_density")
        for name in positive + ("min_seqlen_bucket", "fine_budget_steps", "finer_budget_steps", "recurring_after"):
            _require(getattr(self, name) >= 1, name, "must be >= 1", getattr(self, name))
        for name in ("max_items_per_pack", "max_segments_per_pack"):
            value = getattr(self, name)
            _require(value is None or value >= 1, name, "must be >= 1 (or null for the default)", value)
        _require(self.budget_growth > 1, "budget_growth", "must be > 1", self.budget_growth)
        _require(
            self.recurring_graphs >= 0, "recurring_graphs", "must be >= 0 (0 turns them off)", self.recurring_graphs
        )
        _require(0 < self.memory_fraction <= 1, "memory_fraction", "must be in (0, 1]", self.memory_fraction)
        _require(self.self_check_tolerance > 0, "self_check_tolerance", "must be > 0", self.self_check_tolerance)
        if self.budgets is not None:
            _require(len(self.budgets) > 0, "budgets", "is empty: give at least one budget, or null", self.budgets)
            _require(min(self.budgets) >= 1, "budgets", "must all be >= 1", self.budgets)
        finer = self.finer_budget_range
        _require(
            finer is None or 0 < finer[0] < finer[1],
            "finer_budget_range",
            "must be two budgets, the first > 0 and below the second (or null)",
            None if finer is None else list(finer),
        )
        _require(
            self.compile or not self.precompile_regions,
            "precompile_regions",
            "needs graphs.compile: true (it precompiles the compiled regions)",
            self.precompile_regions,
        )
        _require(
            self.compile_cache is None or self.compile_cache != "", "compile_cache", "must be a directory or null", ""
        )
        _require(
            self.compile_cache_key_file is None or self.compile_cache_key_file != "",
            "compile_cache_key_file",
            "must be a file or null",
            "",
        )


def _require(condition: bool, field: str, rule: str, value: object) -> None:
    if not condition:
        raise BudgetConfigError(f"graphs.{field} {rule}; got {value!r}")


@dataclass(frozen=True)
class Ladder:
    """The token budgets of a deployment: computed once (by the app builder), handed to the router,
    which packs against them, and to every encoder replica, which captures graphs for them."""

    budgets: tuple[int, ...]
    """Token budgets, ascending."""
    coarse: tuple[int, ...]
    """The doubling sub-ladder (a subset of `budgets` ending at the largest): the budgets that get
    graphs where an encoder takes one `max_seqlen` bucket per doubling; packs of the others run in
    the next coarse budget's graphs."""
    max_items: int
    """Most items one pack holds (<= the smallest budget, so every item gets >= 1 token)."""
    max_segments: int
    """Most attention segments one pack holds."""

    def __post_init__(self) -> None:
        validate_ladder(self.budgets, self.max_items)
        if tuple(sorted(set(self.budgets))) != self.budgets:
            raise BudgetConfigError(f"ladder budgets must ascend without repeats, got {self.budgets}")
        if not self.coarse or not set(self.coarse) <= set(self.budgets) or self.coarse[-1] != self.budgets[-1]:
            raise BudgetConfigError(
                f"the coarse ladder {self.coarse} must be budgets of {self.budgets} ending at the largest; "
                "build ladders with encoder_graphs.config.budget_ladder"
            )
        if self.max_segments < 1:
            raise BudgetConfigError(f"max_segments must be >= 1, got {self.max_segments}")


def budget_ladder(config: GraphConfig, smallest_item_tokens: int) -> Ladder:
    """The ladder for a model whose smallest item has this many tokens. Pure: the app builder
    calls it once; it raises `BudgetConfigError` naming the fix for a ladder that cannot work."""
    if config.budgets is not None:
        budgets = coarse = tuple(sorted(set(config.budgets)))
    else:
        start = max(min(config.min_budget_tokens, config.max_budget_tokens), smallest_item_tokens)
        finer = None if config.finer_budget_range is None else (*config.finer_budget_range, config.finer_budget_steps)
        budgets = auto_ladder(
            start,
            config.max_budget_tokens,
            config.budget_growth,
            config.fine_budget_tokens,
            config.fine_budget_steps,
            finer,
        )
        doubling = auto_ladder(start, config.max_budget_tokens, config.budget_growth)
        coarse = tuple(sorted({fitting_budget(budgets, b) for b in doubling}))
    max_items = config.max_items_per_pack
    if max_items is None:
        max_items = min(DEFAULT_MAX_ITEMS, min(budgets))
    budgets = validate_ladder(budgets, max_items)
    return Ladder(budgets, coarse, max_items, config.max_segments_per_pack or 2 * max_items)
