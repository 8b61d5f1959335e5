"""Property tests of the budget ladder, budget fitting and packing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from encoder_graphs.budgets import (
    BudgetConfigError,
    auto_ladder,
    buckets_for_budget,
    fitting_budget,
    sample_budgets,
    segment_capacity,
    seqlen_buckets,
    validate_ladder,
)
from encoder_graphs.config import GraphConfig, Ladder, budget_ladder
from encoder_graphs.packing import PackItem, pack_items, split_items
from encoder_graphs.selfcheck import sample_frame, synthetic_specs
from models import from_preset


@given(st.integers(1, 5000), st.integers(1, 70000), st.sampled_from([1.25, 1.5, 2.0, 3.0]))
def test_auto_ladder_grows_from_smallest_item_to_maximum(min_tokens, max_tokens, growth):
    if max_tokens < min_tokens:
        with pytest.raises(BudgetConfigError, match=f"set max_budget_tokens >= {min_tokens}"):
            auto_ladder(min_tokens, max_tokens, growth)
        return
    ladder = auto_ladder(min_tokens, max_tokens, growth)
    assert ladder[0] == min_tokens and ladder[-1] == max_tokens
    assert all(b < c <= max(int(b * growth), b + 1) for b, c in zip(ladder, ladder[1:]))


def test_auto_ladder_doubles_by_default():
    assert auto_ladder(64, 8192) == (64, 128, 256, 512, 1024, 2048, 4096, 8192)
    assert auto_ladder(64, 1000) == (64, 128, 256, 512, 1000)


def test_fine_ladder_splits_each_doubling_above_its_start():
    ladder = auto_ladder(64, 8192, 2.0, 1024, 8)
    assert ladder[:6] == (64, 128, 256, 512, 1024, 1152)
    assert {1664, 2048, 2304, 4096, 4608, 8192} <= set(ladder) and len(ladder) == 29
    assert auto_ladder(64, 8192, 2.0, 1024, 1) == auto_ladder(64, 8192)


@given(
    st.integers(1, 3000),
    st.integers(1, 40000),
    st.integers(1, 4096),
    st.integers(1, 16),
    st.data(),
)
def test_fine_ladder_bounds_the_padding_of_every_pack_above_its_start(min_tokens, max_tokens, fine_from, steps, data):
    if max_tokens < min_tokens:
        return
    ladder = auto_ladder(min_tokens, max_tokens, 2.0, fine_from, steps)
    assert ladder[0] == min_tokens and ladder[-1] == max_tokens and list(ladder) == sorted(set(ladder))
    tokens = data.draw(st.integers(min_tokens, max_tokens))
    budget = fitting_budget(ladder, tokens)
    previous = max((b for b in ladder if b < tokens), default=None)
    if previous is not None and previous >= fine_from:
        # The step from the budget below is 1/steps of a power-of-two multiple of fine_from that
        # is <= that budget, so the padding is < budget/steps (plus 1 for rounding).
        assert budget - tokens < budget / steps + 1


def test_finer_range_takes_its_own_steps_per_doubling():
    ladder = auto_ladder(64, 8192, 2.0, 128, 8, (1024, 4096, 16))
    assert ladder == tuple(
        sorted(
            {
                *auto_ladder(64, 1024, 2.0, 128, 8),
                *range(1024, 2048, 64),
                *range(2048, 4096, 128),
                *auto_ladder(4096, 8192, 2.0, 128, 8),
            }
        )
    )
    assert {1600, 3200, 2176} <= set(ladder) and 1664 in ladder and 4160 not in ladder
    # The default config: 8 x 448x448 of Qwen3-VL (1568 tokens) pads to 1600, not 1664.
    assert fitting_budget(budget_ladder(GraphConfig(), 64).budgets, 1568) == 1600
    assert fitting_budget(budget_ladder(GraphConfig(finer_budget_range=None), 64).budgets, 1568) == 1664
    assert budget_ladder(GraphConfig(), 64).coarse == auto_ladder(64, 8192)


def test_finer_range_holds_below_the_fine_ladder_too():
    # fine steps from 2048 only, or none at all: the range still takes its 16 steps
    assert {1088, 1600, 2176, 3968} <= set(auto_ladder(64, 8192, 2.0, 2048, 8, (1024, 4096, 16)))
    doubling_around = auto_ladder(64, 8192, 2.0, None, 1, (1024, 4096, 16))
    assert doubling_around[:5] == (64, 128, 256, 512, 1024) and doubling_around[-2:] == (4096, 8192)
    assert len(doubling_around) == 5 + 32 + 1


@pytest.mark.parametrize("finer", [(4096, 1024, 16), (0, 1024, 16), (1024, 4096, 0)])
def test_finer_range_config_errors_name_the_settings(finer):
    with pytest.raises(BudgetConfigError, match="finer_budget_range must be two budgets"):
        auto_ladder(64, 8192, 2.0, 128, 8, finer)


@pytest.mark.parametrize("steps, start", [(0, 1024), (8, 0)])
def test_fine_ladder_config_errors_name_the_settings(steps, start):
    with pytest.raises(BudgetConfigError, match="fine_budget_steps must be >= 1 and fine_budget_tokens >= 1"):
        auto_ladder(64, 8192, 2.0, start, steps)


@given(st.lists(st.integers(1, 10000), min_size=1, max_size=12), st.integers(1, 64))
def test_validate_ladder_sorts_and_enforces_items_per_pack(budgets, max_items):
    if max_items > min(budgets):
        with pytest.raises(BudgetConfigError, match=f"lower max_items_per_pack to <= {min(budgets)}"):
            validate_ladder(budgets, max_items)
        return
    ladder = validate_ladder(budgets, max_items)
    assert list(ladder) == sorted(set(budgets))


def test_validate_ladder_rejects_empty_and_non_positive():
    with pytest.raises(BudgetConfigError, match="empty"):
        validate_ladder([], 1)
    with pytest.raises(BudgetConfigError, match=">= 1"):
        validate_ladder([0, 64], 1)


@given(st.lists(st.integers(1, 10000), min_size=1, max_size=12, unique=True), st.integers(0, 12000))
def test_fitting_budget_is_the_smallest_that_fits(budgets, tokens):
    ladder = tuple(sorted(budgets))
    found = fitting_budget(ladder, tokens)
    fitting = [b for b in ladder if b >= tokens]
    assert found == (min(fitting) if fitting else None)


@given(st.integers(1, 4096), st.integers(1, 70000))
def test_seqlen_buckets_cover_every_length(min_seqlen, max_seqlen):
    buckets = seqlen_buckets(min_seqlen, max_seqlen)
    assert buckets[-1] == max_seqlen and list(buckets) == sorted(set(buckets))
    for rows in (1000, max_seqlen):
        usable = buckets_for_budget(buckets, rows)
        assert usable[-1] == rows and all(b <= rows for b in usable)


@given(st.integers(1, 70000), st.integers(1, 70000), st.integers(1, 16), st.integers(1, 512))
def test_segment_capacity_keeps_empty_slots_proportional_to_rows(rows, max_seqlen, density, cap):
    slots = segment_capacity(rows, max_seqlen, density, cap)
    assert 1 <= slots <= cap
    assert slots == cap or slots >= density  # never below the density, unless capped
    assert slots == cap or slots * max_seqlen < density * (rows + max_seqlen)  # grid ~ rows, not slots x seqlen
    assert slots == cap or slots * max_seqlen >= density * rows  # density segments per max_seqlen of rows


def test_segment_capacity_rejects_nonpositive():
    with pytest.raises(BudgetConfigError):
        segment_capacity(1024, 256, 0, 8)


items_strategy = st.lists(
    st.tuples(st.sampled_from(["image", "video"]), st.integers(1, 3000), st.integers(1, 12), st.integers(1, 4)),
    min_size=0,
    max_size=60,
)


@settings(max_examples=300)
@given(
    items_strategy,
    st.lists(st.integers(4, 2048), min_size=1, max_size=6, unique=True),
    st.integers(1, 16),
    st.integers(1, 40),
)
def test_packing_invariants(raw_items, budgets, max_items, max_segments):
    ladder = tuple(sorted(budgets))
    max_items = min(max_items, ladder[0])
    queue = [  # `count` > 1: a whole pack, as a replica merges them
        PackItem(i, modality, tokens, segments if modality == "video" else 1, count)
        for i, (modality, tokens, segments, count) in enumerate(raw_items)
    ]
    packs = pack_items(queue, ladder, max_items, max_segments)

    # every item exactly once
    assert sorted(item.key for pack in packs for item in pack.items) == list(range(len(queue)))
    first_keys = []
    for pack in packs:
        assert len({item.modality for item in pack.items}) == 1
        assert len(pack.items) == 1 or sum(item.count for item in pack.items) <= max_items
        assert len(pack.items) == 1 or sum(item.segments for item in pack.items) <= max_segments
        keys = [item.key for item in pack.items]
        assert keys == sorted(keys)  # arrival order inside a pack
        first_keys.append(keys[0])
        if pack.token_budget is None:
            assert len(pack.items) == 1 and pack.tokens > ladder[-1]
        else:
            assert pack.tokens <= pack.token_budget
            assert pack.token_budget == fitting_budget(ladder, pack.tokens)
    # oldest first: each pack starts with the oldest item not in an earlier pack
    placed: set[int] = set()
    for pack, first in zip(packs, first_keys):
        assert first == min(set(range(len(queue))) - placed)
        placed.update(item.key for item in pack.items)


def test_small_items_share_a_pack_and_oversize_goes_alone():
    queue = [
        PackItem("a", "image", 100),
        PackItem("big", "image", 9000),
        PackItem("b", "image", 200),
        PackItem("v", "video", 300),
        PackItem("c", "image", 50),
    ]
    packs = pack_items(queue, (64, 256, 1024), max_items=8)
    assert [[i.key for i in p.items] for p in packs] == [["a", "b", "c"], ["big"], ["v"]]
    assert [p.token_budget for p in packs] == [1024, None, 1024]


@given(st.integers(1, 700), st.integers(65, 9000))
@settings(max_examples=200, deadline=None)
def test_the_coarse_ladder_is_budgets_of_the_ladder_ending_at_the_largest(smallest_item, max_budget):
    """Where an encoder's graphs take a bucket per doubling, its graphs sit on the coarse budgets:
    they must be budgets the router packs against, and the largest one too."""
    config = GraphConfig(max_budget_tokens=max_budget, min_budget_tokens=64)
    if smallest_item > max_budget:
        with pytest.raises(BudgetConfigError, match="set max_budget_tokens"):
            budget_ladder(config, smallest_item)
        return
    ladder = budget_ladder(config, smallest_item)
    assert set(ladder.coarse) <= set(ladder.budgets) and ladder.coarse[-1] == ladder.budgets[-1] == max_budget
    assert ladder.max_items <= ladder.budgets[0] and ladder.max_segments == 2 * ladder.max_items
    assert len(ladder.coarse) <= len(auto_ladder(ladder.budgets[0], max_budget))


def test_a_handed_ladder_that_cannot_work_is_refused():
    with pytest.raises(BudgetConfigError, match="coarse ladder"):
        Ladder((64, 128), (64,), 16, 32)  # the largest budget must have graphs
    with pytest.raises(BudgetConfigError, match="lower max_items_per_pack"):
        Ladder((64, 128), (64, 128), 100, 200)


@given(st.lists(st.integers(1, 200), min_size=1, max_size=40), st.integers(1, 400), st.integers(2, 4))
@settings(max_examples=300, deadline=None)
def test_a_split_places_every_item_once_within_capacity(tokens, capacity, max_parts):
    parts = split_items(tokens, capacity, max_parts)
    if parts is None:
        return
    assert 2 <= len(parts) <= max_parts
    assert sorted(i for part in parts for i in part) == list(range(len(tokens)))
    assert all(part == sorted(part) and sum(tokens[i] for i in part) <= capacity for part in parts)


def test_a_split_refuses_one_part_too_many_parts_or_an_item_over_capacity():
    assert split_items([10, 10], 64, 3) is None  # one part holds both
    assert split_items([60, 60, 60, 60], 64, 3) is None  # four parts needed
    assert split_items([100, 10], 64, 3) is None
    assert split_items([40, 30, 30], 64, 3) == [[0], [1, 2]]


def test_sampled_budgets_span_the_ladder_on_a_log_scale():
    ladder = budget_ladder(GraphConfig(), 64).budgets
    sampled = sample_budgets(ladder, 5)
    assert sampled[0] == ladder[0] and sampled[-1] == ladder[-1] and len(sampled) == 5
    assert set(sampled) <= set(ladder) and sample_budgets((64, 256), 5) == (64, 256)


def test_packs_of_several_routers_merge_at_the_replica_counting_their_items():
    """A waiting pack is one item of the packer standing for its items (`count`)."""
    waiting = [
        PackItem(0, "image", 64, 2, count=2),
        PackItem(1, "video", 64, 2),
        PackItem(2, "image", 64, 1, count=5),  # 2 + 5 items > max_items 6
        PackItem(3, "image", 64, 1, count=3),
        PackItem(4, "image", 64, 1),  # 192 tokens with 0 and 3: the 256 budget
    ]
    first = pack_items(waiting, (128, 256), max_items=6, max_segments=8)[0]
    assert [item.key for item in first.items] == [0, 3, 4] and first.token_budget == 256


def test_a_budgets_last_bucket_is_timed_on_frames_twice_the_bucket_below():
    """Under Triton a budget's buckets are 1024, 4096 and its rows: the rows bucket is timed on
    frames of 8192 (a 1920x1080 photo has 8160), not on one frame of all 32768 rows."""
    buckets = [1024, 4096, 32768]
    assert [sample_frame(buckets, b) for b in buckets] == [1024, 4096, 8192]
    assert [sample_frame([256, 512, 1024], b) for b in (256, 512, 1024)] == [256, 512, 1024]  # doubling ladders
    specs = synthetic_specs(from_preset("qwen3-vl-tiny"), 8192, 32768, 64, frame=sample_frame(buckets, 32768))
    assert max(s.input_patches for s in specs) <= 8192 and sum(s.input_patches for s in specs) > 8192 * 3
