"""Packing queued items into packs that fill token budgets: pure functions, no torch.

Rules (property-tested):
- every item lands in exactly one pack;
- a pack holds one modality;
- a pack's tokens fit the largest budget, it holds at most `max_items` items and at most
  `max_segments` attention segments (a lone item may exceed that: it runs eagerly);
- oldest first: packs are formed in arrival order, the oldest waiting item always starts
  the next pack, and later items join it only where they fit (first fit);
- an item larger than the largest budget goes alone, flagged to run eagerly.

`split_items` is the runner's side of the same problem: a pack just over a budget, re-packed
into a few packs of the next smaller budget. A replica merges the packs waiting for its device
(from several routers) by the same rule, each pack a `PackItem` standing for its items.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from .budgets import fitting_budget


@dataclass(frozen=True)
class PackItem:
    """A queued item as the packer sees it."""

    key: Hashable
    """Caller's handle for the item (unique within one call)."""
    modality: str
    """"image" or "video"; packs never mix modalities."""
    output_tokens: int
    """Tokens the item produces (its share of a budget)."""
    segments: int = 1
    """Attention segments it needs (1 per image; a video has one per temporal patch)."""
    count: int = 1
    """Items it stands for, against `max_items` (a whole pack, where a replica merges packs)."""


@dataclass(frozen=True)
class Pack:
    """Items that run together in one forward."""

    items: tuple[PackItem, ...]
    token_budget: int | None
    """The smallest budget that fits the pack; None for an oversize item that runs eagerly."""

    @property
    def tokens(self) -> int:
        return sum(item.output_tokens for item in self.items)

    @property
    def modality(self) -> str:
        return self.items[0].modality

    @property
    def fill(self) -> float:
        """Share of the budget that real tokens use (1.0 for eager packs)."""
        return 1.0 if self.token_budget is None else self.tokens / self.token_budget


def pack_items(
    queue: Sequence[PackItem], ladder: Sequence[int], max_items: int, max_segments: int | None = None
) -> list[Pack]:
    """Pack `queue` (oldest first) into packs for the budget `ladder`."""
    max_segments = max_segments or sum(item.segments for item in queue) or 1
    largest = ladder[-1]
    remaining = list(queue)
    packs: list[Pack] = []
    while remaining:
        first = remaining.pop(0)
        if first.output_tokens > largest:
            packs.append(Pack((first,), None))
            continue
        chosen, tokens, segments, count, rest = [first], first.output_tokens, first.segments, first.count, []
        for item in remaining:
            fits = (
                item.modality == first.modality
                and count + item.count <= max_items
                and tokens + item.output_tokens <= largest
                and segments + item.segments <= max_segments
            )
            if fits:
                chosen.append(item)
                tokens += item.output_tokens
                segments += item.segments
                count += item.count
            else:
                rest.append(item)
        remaining = rest
        packs.append(Pack(tuple(chosen), fitting_budget(ladder, tokens)))
    return packs


def split_items(tokens: Sequence[int], capacity: int, max_parts: int) -> list[list[int]] | None:
    """Item indices first-fit-decreasing into 2..`max_parts` parts of <= `capacity` tokens each
    (each part's indices ascending); None when the items fit one part, need more than
    `max_parts`, or one item alone exceeds `capacity`."""
    parts: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(tokens)), key=lambda i: -tokens[i]):
        for part, load in enumerate(loads):
            if load + tokens[index] <= capacity:
                parts[part].append(index)
                loads[part] += tokens[index]
                break
        else:
            if tokens[index] > capacity or len(parts) == max_parts:
                return None
            parts.append([index])
            loads.append(tokens[index])
    return [sorted(part) for part in parts] if len(parts) >= 2 else None
