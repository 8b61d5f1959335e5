"""How a pack runs (`Planner`): one graph, a split over smaller graphs, or eagerly, and why.

Plans are pure decisions over the graph table's state and the route costs: planning mutates
nothing; the runner applies what a plan implies (forgetting the routes it beat).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from models.protocol import ItemSpec

from .entry import GraphEntry, replay_cost
from .packing import split_items
from .route_costs import RouteCosts, RouteKey, attention_shapes
from .table import GraphTable

MAX_SPLIT = 3
"""Most graph replays one pack may be split into when that is cheaper than one padded graph."""


@dataclass(frozen=True)
class EagerPlan:
    """Run the pack on its exact layout without a graph."""

    reason: str
    """Why (one of `stats.EAGER_REASONS`)."""


@dataclass(frozen=True)
class GraphPart:
    """Items that replay one graph together."""

    indices: tuple[int, ...]
    """The pack's items in this part, ascending."""
    entry: GraphEntry
    metadata: dict[str, torch.Tensor]
    """Host metadata of these items in the entry's layout."""


@dataclass(frozen=True)
class GraphPlan:
    """Replay one graph (one part) or several (a split)."""

    parts: tuple[GraphPart, ...]
    beaten: tuple[RouteKey, ...] = ()
    """Routes this plan was chosen over by cost: each forgets a little of what it learned."""
    new_shape: bool = False
    """The pack has an attention shape no exact-layout route ran yet (its cold cost was beaten)."""


Plan = EagerPlan | GraphPlan


class ExactOffer(Protocol):
    def takes(self, specs: Sequence[ItemSpec]) -> bool:
        """Whether the compiled exact-layout route serves this pack."""
        ...


@dataclass(frozen=True)
class SplitPart:
    """One part of a candidate split: its items, the budget its tokens fit, its longest frame."""

    indices: tuple[int, ...]
    budget: int
    longest: int


def split_plan(table: GraphTable, specs: Sequence[ItemSpec], budget: int) -> list[SplitPart] | None:
    """The pack's items first-fit-decreasing into packs of the next smaller graph budget, when that
    gives 2..`MAX_SPLIT` parts that each have a live graph; else None. A pack just over a budget
    otherwise pays for up to 2x padding."""
    index = table.budgets.index(budget)
    if index == 0 or len(specs) < 2:
        return None
    parts = split_items([s.output_tokens for s in specs], table.budgets[index - 1], MAX_SPLIT)
    if parts is None:
        return None
    plan = []
    for indices in parts:
        longest = max(specs[i].frame_patches for i in indices)
        part_budget = table.fitting_budget(sum(specs[i].output_tokens for i in indices))
        if not table.candidates(part_budget, longest):
            return None
        plan.append(SplitPart(tuple(indices), part_budget, longest))
    return plan


class Planner:
    """Chooses each pack's route from the live graphs and the costs measured so far."""

    def __init__(self, table: GraphTable, costs: RouteCosts, exact: ExactOffer):
        self.table = table
        self.costs = costs
        self.exact = exact

    def plan(self, specs: Sequence[ItemSpec], tokens: int, budget: int | None) -> Plan:
        """The cheapest route for a pack of `tokens` whose fitting graph budget is `budget`."""
        if budget is None:
            return EagerPlan("oversize")
        longest = max(s.frame_patches for s in specs)
        own = self.table.candidates(budget, longest)
        if not own:
            return EagerPlan("warming" if self.table.needed(budget, longest) else "no_graph")
        new = self.costs.has_new_shape(attention_shapes(specs))
        route, cost = "eager_ms", self.costs.eager_estimate_ms("eager_ms", budget, tokens, new)
        if self.exact.takes(specs):
            exact = self.costs.eager_estimate_ms("exact_ms", budget, tokens, new)
            if exact < cost:
                route, cost = "exact_ms", exact
        best: Plan = EagerPlan("cost")
        # The budget's smallest graph bounds every single-graph plan from below: no host metadata
        # is built for a plan that cannot beat eager.
        if replay_cost(own[0]) < cost:
            single = self.table.place(specs, budget)
            if single is None:
                best = EagerPlan("capacity")
            elif replay_cost(single[0]) < cost:
                best, cost = GraphPlan((GraphPart(tuple(range(len(specs))), *single),)), replay_cost(single[0])
        split = split_plan(self.table, specs, budget)
        if split is not None:
            best = self._split_if_cheaper(specs, budget, split, cost) or best
        if isinstance(best, GraphPlan):
            beaten = ((route, budget),) + ((("split", budget),) if split and len(best.parts) == 1 else ())
            best = GraphPlan(best.parts, beaten, new)
        return best

    def _split_if_cheaper(self, specs, budget: int, split: list[SplitPart], cost: float) -> GraphPlan | None:
        """The split as a plan when it costs less than `cost`, scaled by what splits at this
        budget were measured to cost over their parts' startup timings."""
        scale = self.costs.route_scale.get(("split", budget), 1.0)
        # Cheapest first: the parts' own budgets bound the split's cost from below...
        if scale * sum(replay_cost(self.table.candidates(p.budget, p.longest)[0]) for p in split) >= cost:
            return None
        placed = [self.table.place([specs[i] for i in p.indices], p.budget) for p in split]
        # ...but a part with more segments than its budget's graphs hold moves up a budget:
        # price the graphs it really lands in.
        if not all(placed) or scale * sum(replay_cost(entry) for entry, _ in placed) >= cost:
            return None
        return GraphPlan(tuple(GraphPart(p.indices, *where) for p, where in zip(split, placed)))
