"""Token budgets and attention-length buckets: pure functions, no torch.

A budget counts output tokens (after the spatial merge). A graph is specialised to a
(token_budget, max_seqlen) pair; `max_seqlen` is counted in input patches (the attention
segment length) and bucketed so that a pack of small items never pays for the kernel grid
of the largest possible item.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence


class BudgetConfigError(ValueError):
    """A token-budget configuration that cannot work; the message says how to fix it."""


def auto_ladder(
    min_tokens: int,
    max_tokens: int,
    growth: float = 2.0,
    fine_from: int | None = None,
    fine_steps: int = 1,
    finer: tuple[int, int, int] | None = None,
) -> tuple[int, ...]:
    """Budgets growing by `growth` from `min_tokens` up to and including `max_tokens`; from
    `fine_from` tokens up, each doubling split into `fine_steps` equal steps (1/`fine_steps` of
    the power-of-two multiple of `fine_from` the budget is in: 1024, 1152, ..., 2048, 2304, ...),
    so no pack above `fine_from` pads more than 1/`fine_steps` of its budget. `finer` (from,
    until, steps): budgets in [from, until) take `steps` steps per doubling of `from` instead,
    whether or not `fine_from` is below `from`."""
    if min_tokens < 1:
        raise BudgetConfigError(f"smallest budget must be >= 1 token, got {min_tokens}")
    if max_tokens < min_tokens:
        raise BudgetConfigError(
            f"max_budget_tokens={max_tokens} is below the model's smallest item ({min_tokens} tokens); "
            f"set max_budget_tokens >= {min_tokens}"
        )
    if growth <= 1.0:
        raise BudgetConfigError(f"budget growth must be > 1, got {growth}")
    if fine_steps < 1 or (fine_from is not None and fine_from < 1):
        raise BudgetConfigError(
            f"fine_budget_steps must be >= 1 and fine_budget_tokens >= 1, got {fine_steps} and {fine_from}"
        )
    if finer is not None and (finer[2] < 1 or not 0 < finer[0] < finer[1]):
        raise BudgetConfigError(
            f"finer_budget_range must be two budgets, the first > 0 and below the second, and "
            f"finer_budget_steps >= 1; got {finer[:2]} and {finer[2]}"
        )
    budgets = [min_tokens]
    while budgets[-1] < max_tokens:
        last = budgets[-1]
        if finer is not None and finer[0] <= last < finer[1]:
            base, steps = finer[0], finer[2]
        else:
            base, steps = fine_from, fine_steps
        if base is not None and steps > 1 and last >= base:
            octave = base << ((last // base).bit_length() - 1)  # base * 2^k <= last
            step = max(1, octave // steps)
        else:
            step = max(int(last * growth) - last, 1)
        budgets.append(min(last + step, max_tokens))
    return tuple(budgets)


def validate_ladder(budgets: Sequence[int], max_items_per_pack: int) -> tuple[int, ...]:
    """Sorted unique budgets; every item of a pack must be able to get >= 1 token of the smallest."""
    if not budgets:
        raise BudgetConfigError("the budget list is empty; give at least one token budget")
    if any(b < 1 for b in budgets):
        raise BudgetConfigError(f"token budgets must be >= 1, got {sorted(budgets)}")
    ladder = tuple(sorted(set(budgets)))
    if max_items_per_pack < 1:
        raise BudgetConfigError(f"max_items_per_pack must be >= 1, got {max_items_per_pack}")
    # Invariant: max_items_per_pack <= smallest budget, so a full pack of the smallest items fits.
    if max_items_per_pack > ladder[0]:
        raise BudgetConfigError(
            f"max_items_per_pack={max_items_per_pack} exceeds the smallest token budget {ladder[0]}; "
            f"lower max_items_per_pack to <= {ladder[0]} or raise the smallest budget"
        )
    return ladder


def fitting_budget(ladder: Sequence[int], tokens: int) -> int | None:
    """The smallest budget >= `tokens`, or None when the pack is larger than every budget."""
    index = bisect_left(ladder, tokens)
    return ladder[index] if index < len(ladder) else None


def seqlen_buckets(min_seqlen: int, max_seqlen: int, growth: int = 2) -> tuple[int, ...]:
    """Attention-length buckets: powers of `growth` times `min_seqlen`, capped by `max_seqlen`."""
    buckets = [min(min_seqlen, max_seqlen)]
    while buckets[-1] < max_seqlen:
        buckets.append(min(buckets[-1] * growth, max_seqlen))
    return tuple(buckets)


def segment_capacity(budget_rows: int, max_seqlen: int, density: int, cap: int) -> int:
    """Attention segments a graph of `budget_rows` rows and bucket `max_seqlen` holds:
    `density` per `max_seqlen` of rows (at least `density`), at most `cap`.

    A varlen kernel launches a grid over every segment slot times `max_seqlen / 128` query
    blocks, so empty slots cost in proportion to slots x max_seqlen; with slots proportional to
    rows / max_seqlen the empty part of the grid stays proportional to the graph's rows."""
    if density < 1 or cap < 1:
        raise BudgetConfigError(f"segment density and capacity must be >= 1, got {density} and {cap}")
    return min(cap, density * max(1, -(-budget_rows // max_seqlen)))


def buckets_for_budget(buckets: Sequence[int], budget_rows: int) -> tuple[int, ...]:
    """The buckets a graph of `budget_rows` input rows can use (no segment exceeds the pack)."""
    usable = [b for b in buckets if b < budget_rows]
    return (*usable, budget_rows) if not usable or usable[-1] != budget_rows else tuple(usable)


def sample_budgets(budgets: Sequence[int], count: int) -> tuple[int, ...]:
    """At most `count` budgets spread evenly on a log scale from the smallest to the largest
    (both included): where a cost that grows smoothly with tokens is measured and interpolated."""
    if count < 2 or len(budgets) <= count:
        return tuple(budgets) if count >= len(budgets) else (budgets[-1],)
    low, high = math.log(budgets[0]), math.log(budgets[-1])
    wanted = [math.exp(low + (high - low) * i / (count - 1)) for i in range(count)]
    return tuple(sorted({min(budgets, key=lambda b: abs(math.log(b) - math.log(w))) for w in wanted}))
