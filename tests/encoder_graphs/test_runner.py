"""The runner's packing, buffers, padding, slicing, routes, fallbacks and checks, on CPU."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from encoder_graphs.budgets import BudgetConfigError, fitting_budget
from encoder_graphs.config import GraphConfig, budget_ladder
from encoder_graphs.plan import MAX_SPLIT, split_plan
from encoder_graphs.runner import EncoderRunner, canonical_order
from models import from_preset
from models.protocol import ItemSpec
from tests.helpers import (
    WithForward,
    assert_each_item_is_one_block,
    random_image,
    random_video,
    reference_item,
    reference_tower,
    relative_error,
    warmed,
)


@pytest.fixture(scope="module")
def qwen3():
    encoder = from_preset("qwen3-vl-tiny", seed=4)
    return encoder, reference_tower(encoder)


@pytest.fixture(scope="module")
def qwen25():
    encoder = from_preset("qwen2.5-vl-tiny", seed=4)
    return encoder, reference_tower(encoder)


def make_images(encoder, rng, sizes):
    resized = [encoder.preprocessor.resize_image(random_image(rng, h, w)) for h, w in sizes]
    specs = [encoder.preprocessor.spec("image", 1, *r.shape[-2:]) for r in resized]
    return encoder.preprocessor.pixel_values(resized, "image"), specs


def assert_matches_reference(reference, pixel_values, specs, outputs, tolerance=1e-4):
    row = 0
    for spec, out in zip(specs, outputs):
        expected, expected_deepstack = reference_item(
            reference, pixel_values[row : row + spec.input_patches], spec.grid_thw
        )
        assert out.tokens.shape == expected.shape
        assert relative_error(out.tokens, expected) <= tolerance
        if expected_deepstack is not None:
            assert relative_error(out.deepstack, expected_deepstack) <= tolerance
        row += spec.input_patches


@pytest.mark.parametrize("fixture", ["qwen3", "qwen25"])
def test_runner_outputs_match_transformers_per_item(fixture, request):
    encoder, reference = request.getfixturevalue(fixture)
    runner = warmed(encoder, GraphConfig(max_budget_tokens=1024, max_items_per_pack=16))
    rng = np.random.default_rng(0)
    for count in (1, 3, 8):
        sizes = [(int(rng.integers(30, 400)), int(rng.integers(30, 400))) for _ in range(count)]
        pixels, specs = make_images(encoder, rng, sizes)
        outputs = runner.run(pixels, specs)
        assert_matches_reference(reference, pixels, specs, outputs)
        assert_each_item_is_one_block(outputs)
    clip = encoder.preprocessor.resize_video(random_video(rng, 4, 120, 90))
    spec = encoder.preprocessor.spec("video", 4, *clip.shape[-2:])
    pixels = encoder.preprocessor.pixel_values([clip], "video")
    assert_matches_reference(reference, pixels, [spec], runner.run(pixels, [spec]))
    assert sum(runner.stats.graph_hits.values()) == 4
    assert runner.stats.first_pack_checks >= 1 and runner.stats.first_pack_mismatches == 0
    assert runner.stats.first_pack_check_s > 0 and runner.stats.recurring_capture_s == 0  # nothing recurred


def test_oversize_pack_runs_eagerly_and_is_counted(qwen3):
    encoder, reference = qwen3
    runner = EncoderRunner(encoder, GraphConfig(max_budget_tokens=128, min_budget_tokens=64))
    pixels, specs = make_images(encoder, np.random.default_rng(1), [(700, 900)])
    assert specs[0].output_tokens > 128
    assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    assert runner.stats.eager_fallbacks["oversize"] == 1
    assert not runner.stats.graph_hits


def test_outputs_survive_the_next_run(qwen3):
    encoder, _ = qwen3
    runner = warmed(encoder, GraphConfig(max_budget_tokens=512))
    rng = np.random.default_rng(2)
    pixels_a, specs_a = make_images(encoder, rng, [(300, 300)])
    first = runner.run(pixels_a, specs_a)[0].tokens
    kept = first.clone()
    pixels_b, specs_b = make_images(encoder, rng, [(300, 300)])
    runner.run(pixels_b, specs_b)
    assert torch.equal(first, kept)


def test_stats_count_hits_per_budget_and_padding_waste(qwen3):
    encoder, _ = qwen3
    runner = warmed(encoder, GraphConfig(budgets=(64, 256), max_items_per_pack=8))
    rng = np.random.default_rng(3)
    pixels, specs = make_images(encoder, rng, [(256, 256)])  # 64 tokens: fills the 64 budget
    runner.run(pixels, specs)
    pixels, specs = make_images(encoder, rng, [(256, 256), (256, 320)])  # 64 + 80 = 144 -> 256
    runner.run(pixels, specs)
    stats = runner.stats.snapshot()
    assert stats["graph_hits"] == {64: 1, 256: 1}
    assert stats["padding_waste"] == pytest.approx((256 - 144) / (64 + 256))


def wrong_at(encoder, budget, factor):
    """The encoder's padded forward, its tokens multiplied by `factor` at one token budget (a
    broken graph: NaN, or finite but wrong)."""

    def forward(pixel_values, metadata, layout, exact_segments=False):
        out = encoder.forward_padded(pixel_values, metadata, layout, exact_segments)
        if layout.token_budget == budget:
            out.tokens = out.tokens * factor
        return out

    return forward


def test_a_graph_that_turns_nonfinite_is_disabled_and_its_pack_served_eagerly(qwen3):
    encoder, reference = qwen3
    runner = warmed(WithForward(encoder, wrong_at(encoder, 256, float("nan"))), GraphConfig(budgets=(64, 256, 1024)))
    pixels, specs = make_images(encoder, np.random.default_rng(4), [(256, 256), (256, 320)])  # 144 tokens -> 256
    assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    assert runner.stats.eager_fallbacks["nonfinite"] == 1 and runner.stats.disabled_graphs == 1
    assert runner.describe()["graphs_enabled"] == len(runner.entries) - 1


def test_a_graph_whose_first_real_pack_disagrees_is_disabled_and_the_pack_served_eagerly(qwen3):
    """A graph's first real pack is checked against eager; a finite but wrong graph is caught
    there (counted), never trusted again, and the pack comes back right."""
    encoder, reference = qwen3
    runner = warmed(WithForward(encoder, wrong_at(encoder, 256, 2.0)), GraphConfig(budgets=(64, 256, 1024)))
    pixels, specs = make_images(encoder, np.random.default_rng(4), [(256, 256), (256, 320)])  # 144 tokens -> 256
    assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    assert runner.stats.last.eager_reason == "mismatch"
    assert runner.stats.first_pack_checks == runner.stats.first_pack_mismatches == runner.stats.disabled_graphs == 1
    small_pixels, small = make_images(encoder, np.random.default_rng(5), [(256, 256)])  # 64 tokens: a sound graph
    for _ in range(2):
        assert_matches_reference(reference, small_pixels, small, runner.run(small_pixels, small))
        assert runner.stats.last.graph
    assert runner.stats.first_pack_checks == 2  # once per graph


def test_the_startup_check_disables_a_wrong_compiled_graph_and_eager_takes_over(qwen3):
    """With a compiled forward (here a stand-in that is wrong at budget 256), the warm-up checks
    every graph once against eager before it goes live: budget 256's graphs never serve."""
    encoder, reference = qwen3
    compiled = wrong_at(encoder, 256, float("nan"))
    runner = warmed(encoder, GraphConfig(budgets=(64, 256, 1024), compile_exact=False), compiled_forward=compiled)
    broken = [e for e in runner.entries.values() if e.key[0] == 256]
    assert broken and not any(e.enabled for e in broken)
    assert all(e.live and e.self_check_error < 1e-4 for e in runner.entries.values() if e.key[0] != 256)
    assert runner.stats.disabled_graphs == len(broken)
    pixels, specs = make_images(encoder, np.random.default_rng(4), [(256, 256), (256, 320)])  # 144 tokens -> 256
    outputs = runner.run(pixels, specs)
    assert runner.stats.eager_fallbacks["no_graph"] == 1 and runner.stats.graph_misses[256] == 1
    assert_matches_reference(reference, pixels, specs, outputs)


def test_pack_over_its_budgets_segment_capacity_moves_up_a_budget(qwen3):
    """Graph segment slots scale with rows / max_seqlen; a pack with more segments than its own
    budget's graphs hold runs in the next budget's graph, correctly."""
    encoder, reference = qwen3
    runner = warmed(encoder, GraphConfig(budgets=(64, 256), max_items_per_pack=16))
    assert runner.entries[(64, 256)].layout.max_segments < 20 <= runner.entries[(256, 256)].layout.max_segments
    clip = encoder.preprocessor.resize_video(random_video(np.random.default_rng(5), 40, 32, 32))
    specs = [encoder.preprocessor.spec("video", 40, *clip.shape[-2:])]  # 20 segments of 4 patches: 20 tokens
    assert specs[0].output_tokens <= 64 and specs[0].grid_thw[0] == 20
    pixels = encoder.preprocessor.pixel_values([clip], "video")
    outputs = runner.run(pixels, specs)
    assert runner.stats.graph_hits[256] == 1 and not runner.stats.eager_fallbacks
    assert_matches_reference(reference, pixels, specs, outputs)


def test_pack_over_segment_capacity_falls_back(qwen3):
    """A pack with more attention segments than a graph's buffers hold never runs through it."""
    encoder, reference = qwen3
    runner = warmed(encoder, GraphConfig(budgets=(64,), max_segments_per_pack=16))
    clips = [random_video(np.random.default_rng(i), 40, 32, 32) for i in range(3)]  # 20 segments of 4 patches each
    resized = [encoder.preprocessor.resize_video(c) for c in clips]
    specs = [encoder.preprocessor.spec("video", 40, *r.shape[-2:]) for r in resized]
    assert sum(s.output_tokens for s in specs) <= 64
    assert sum(s.grid_thw[0] for s in specs) > max(e.layout.max_segments for e in runner.entries.values())
    pixels = encoder.preprocessor.pixel_values(resized, "video")
    outputs = runner.run(pixels, specs)
    assert runner.stats.eager_fallbacks["capacity"] == 1
    assert_matches_reference(reference, pixels, specs, outputs)


def test_ladder_config_errors_name_the_fix():
    ladder = budget_ladder(GraphConfig(budgets=(64, 16)), 4)
    assert ladder.budgets == ladder.coarse == (16, 64) and ladder.max_items == 16  # capped at the smallest budget
    with pytest.raises(BudgetConfigError, match="lower max_items_per_pack to <= 16"):
        budget_ladder(GraphConfig(budgets=(16, 64), max_items_per_pack=32), 4)
    with pytest.raises(BudgetConfigError, match="set max_budget_tokens >= 64"):
        budget_ladder(GraphConfig(max_budget_tokens=8, min_budget_tokens=64), 64)
    with pytest.raises(BudgetConfigError, match="graphs.budgets is empty"):
        GraphConfig(budgets=())
    with pytest.raises(BudgetConfigError, match="graphs.budget_growth must be > 1"):
        GraphConfig(budget_growth=1.0)


def test_a_pack_above_1024_tokens_pads_to_a_fine_budget_not_the_next_doubling(qwen3):
    config = GraphConfig(max_budget_tokens=2048)
    assert budget_ladder(config, 4).coarse[-3:] == (512, 1024, 2048)
    encoder, reference = qwen3
    runner = warmed(encoder, config)
    assert runner.ladder == budget_ladder(config, encoder.min_item_tokens)
    assert runner.ladder.budgets[-17:] == tuple(range(1024, 2049, 64))  # the finer range: 16 steps a doubling
    pixels, specs = make_images(encoder, np.random.default_rng(8), [(256, 256)] * 17)
    assert sum(s.output_tokens for s in specs) == 1088
    outputs = runner.run(pixels, specs)
    # No padding; 8 steps' 1152 would be 6%, the doubling ladder's 2048 88%.
    assert runner.stats.graph_hits == {1088: 1}
    assert_matches_reference(reference, pixels, specs, outputs)


def test_a_small_image_pads_to_a_fine_budget_below_1024_tokens(qwen3):
    encoder, reference = qwen3
    runner = warmed(encoder, GraphConfig(max_budget_tokens=1024))
    assert runner.ladder.budgets[:10] == (64, 128, 144, 160, 176, 192, 208, 224, 240, 256)
    pixels, specs = make_images(encoder, np.random.default_rng(9), [(448, 448)])
    assert specs[0].output_tokens == 196
    outputs = runner.run(pixels, specs)
    assert runner.stats.graph_hits == {208: 1}  # 6% padding; the doubling ladder's 256 was 31%
    assert_matches_reference(reference, pixels, specs, outputs)


def runner_with_costs(encoder, replay_ms, eager_ms=1e9, compiled_forward=None, **config):
    """A warmed CPU runner that plans as a GPU one does, from given costs (what the warm-up
    measures on CUDA): per-graph replay times and a flat eager curve; its 'graphs' run through
    the same static buffers."""
    runner = warmed(encoder, GraphConfig(budgets=(64, 128, 256), **config), compiled_forward=compiled_forward)
    for (budget, _), entry in runner.entries.items():
        entry.replay_ms = replay_ms(budget)
    runner.costs.set_startup("eager_ms", [(budget, eager_ms) for budget in runner.ladder.budgets])
    return runner


def test_pack_just_over_a_budget_splits_when_smaller_graphs_cost_less(qwen3):
    encoder, reference = qwen3
    pixels, specs = make_images(encoder, np.random.default_rng(6), [(256, 256), (256, 320), (256, 256)])
    assert [s.output_tokens for s in specs] == [64, 80, 64]  # 208 tokens: budget 256, 19% padding
    runner = runner_with_costs(encoder, lambda budget: budget**2 / 1000)  # 256: 65.5 ms; 2 x 128: 32.8 ms
    outputs = runner.run(pixels, specs)
    assert runner.stats.split_packs == 1 and runner.stats.graph_hits == {128: 2}
    assert_matches_reference(reference, pixels, specs, outputs)  # outputs back in item order

    flat = runner_with_costs(encoder, lambda budget: 1.0)  # one replay costs what two smaller ones cost
    assert_matches_reference(reference, pixels, specs, flat.run(pixels, specs))
    assert flat.stats.split_packs == 0 and flat.stats.graph_hits == {256: 1}

    slow = runner_with_costs(encoder, lambda budget: 50.0, eager_ms=10.0)  # eager beats every plan
    assert_matches_reference(reference, pixels, specs, slow.run(pixels, specs))
    assert slow.stats.eager_fallbacks["cost"] == 1 and not slow.stats.graph_hits


def test_a_split_learns_what_its_parts_cost_back_to_back(qwen3):
    """A split is priced by its parts' startup timings, taken one at a time; back to back they
    may cost more. The split is timed as routes without a graph are, and the excess it learns
    sends the next such pack to the one graph; losing, it is slowly forgotten. On the routes'
    clock each padded forward here costs 100 ms."""
    encoder, reference = qwen3
    pixels, specs = make_images(encoder, np.random.default_rng(6), [(256, 256), (256, 320), (256, 256)])
    clock = RouteClock()

    def costs_100_ms(pixel_values, metadata, layout, exact_segments=False):
        clock.advance(0.1)
        return encoder.forward_padded(pixel_values, metadata, layout, exact_segments)

    runner = runner_with_costs(
        WithForward(encoder, costs_100_ms), lambda budget: {64: 10.0, 128: 30.0, 256: 70.0}[budget]
    )
    runner.costs.clock = clock.perf_counter
    assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    assert runner.stats.split_packs == 1 and runner.stats.graph_hits == {128: 2}
    scale = runner.costs.route_scale[("split", 256)]
    assert scale == pytest.approx(200.0 / 60.0)  # 2 x 100 ms measured against 2 x 30 ms
    assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    assert runner.stats.split_packs == 1 and runner.stats.graph_hits == {128: 2, 256: 1}
    assert 1.0 < runner.costs.route_scale[("split", 256)] < scale  # forgotten a little per loss
    assert runner.describe()["learned_route_scale"]["split@256"] > 1.0


def test_split_is_costed_on_the_graphs_its_parts_really_use(qwen3):
    """A split part with more segments than its own budget's graphs hold moves up a budget; the
    plan must price it there (on the H100 a mixed pack ran 2.5x slower than eager when the split
    was priced at the smaller graphs' cost)."""
    encoder, reference = qwen3
    pre = encoder.preprocessor
    rng = np.random.default_rng(8)
    clips = [pre.resize_video(random_video(rng, 16, 64, 64)) for _ in range(6)]
    specs = [pre.spec("video", 16, *c.shape[-2:]) for c in clips]
    pixels = pre.pixel_values(clips, "video")
    assert [(s.output_tokens, s.grid_thw[0]) for s in specs] == [(32, 8)] * 6  # 192 tokens, 48 segments
    costs = {64: 4.0, 128: 16.4, 256: 65.5}
    runner = runner_with_costs(encoder, costs.__getitem__, eager_ms=50.0)
    # The split (4 + 2 videos, budgets 128 + 64 by tokens) only fits the 256 and 128 graphs by
    # segment slots: it costs 81.9 ms there, not the 20.4 ms of its token budgets.
    assert split_plan(runner.table, specs, 256) is not None
    assert [runner.table.place(part, budget)[0].key[0] for part, budget in ((specs[:4], 128), (specs[4:], 64))] == [
        256,
        128,
    ]
    outputs = runner.run(pixels, specs)
    assert runner.stats.split_packs == 0 and not runner.stats.graph_hits
    assert sum(runner.stats.eager_fallbacks.values()) == 1
    assert_matches_reference(reference, pixels, specs, outputs)


@functools.cache
def split_table():
    return warmed(
        from_preset("qwen3-vl-tiny", seed=4), GraphConfig(budgets=(64, 128, 256, 512), max_items_per_pack=64)
    ).table


@given(st.lists(st.integers(1, 200), min_size=1, max_size=40))
@settings(max_examples=200, deadline=None)
def test_split_plan_places_every_item_once_within_the_smaller_budget(tokens):
    table = split_table()
    specs = [ItemSpec("image", (1, 2, 2 * t), 4 * t, t) for t in tokens]
    budget = fitting_budget(table.budgets, sum(tokens))
    plan = split_plan(table, specs, budget) if budget else None
    if plan is None:
        return
    assert 2 <= len(plan) <= MAX_SPLIT
    assert sorted(i for part in plan for i in part.indices) == list(range(len(specs)))
    smaller = table.budgets[table.budgets.index(budget) - 1]
    for part in plan:
        load = sum(tokens[i] for i in part.indices)
        assert load <= smaller and part.budget == fitting_budget(table.budgets, load)
        assert list(part.indices) == sorted(part.indices)
        assert part.longest == max(specs[i].frame_patches for i in part.indices)


def eager_compiled(encoder):
    """The encoder's compiled forward with dynamo's "eager" backend: dynamo's guards and
    stances as with inductor, in seconds on CPU (the runner compiles with inductor on CUDA)."""
    torch._dynamo.reset()
    return encoder.compiled_forward(functools.partial(torch.compile, backend="eager", dynamic=True))


def test_exact_route_runs_uncompiled_rather_than_compile_on_a_request(qwen3):
    """With `compile`, packs of equal segments without a graph run through the compiled forward on
    their exact layout; a pack that would need a new compile runs uncompiled instead (counted),
    and once that shape is compiled off the request path, the compiled forward serves it,
    whatever the caller's grad or inference mode (dynamo guards on grad mode)."""
    encoder, reference = qwen3
    compiled = eager_compiled(encoder)
    runner = warmed(encoder, GraphConfig(budgets=(64, 256)), compiled_forward=compiled)
    assert runner.describe()["compiled_exact_route"] and runner.warmup_status().exact_route
    torch._dynamo.reset()  # the warm-up's compiles dropped: this shape would need a compile now
    pixels, specs = make_images(encoder, np.random.default_rng(7), [(500, 500), (500, 500)])
    assert sum(s.output_tokens for s in specs) > 256  # oversize: the exact route
    fallbacks = runner.stats.recompile_fallbacks

    outputs = runner.run(pixels, specs)
    assert runner.stats.recompile_fallbacks == fallbacks + 1 and runner.stats.compiled_exact == 0
    assert runner.stats.last.eager_reason == "oversize" and not runner.stats.last.compiled
    assert_matches_reference(reference, pixels, specs, outputs)

    with torch.no_grad():  # compiled off the request path, in the state the warm-up uses
        encoder.forward_eager(pixels, specs, forward=compiled)
    with torch.inference_mode():  # the caller's grad mode (and its inference tensors) must not miss it
        outputs = runner.run(pixels.clone(), specs)
    assert runner.stats.recompile_fallbacks == fallbacks + 1 and runner.stats.compiled_exact == 1
    assert runner.stats.last.compiled and runner.stats.snapshot()["compiled_exact"] == 1
    assert_matches_reference(reference, pixels, specs, outputs)

    pixels, specs = make_images(encoder, np.random.default_rng(8), [(500, 500), (380, 300)])
    outputs = runner.run(pixels, specs)  # unequal segments: uncompiled, not a fallback
    assert not runner.stats.last.compiled and runner.stats.recompile_fallbacks == fallbacks + 1
    assert_matches_reference(reference, pixels, specs, outputs)
    torch._dynamo.reset()


def test_compile_without_graphs_never_compiles_on_a_request(qwen3):
    """`compile: true` with `cuda_graphs: false`: packs run the compiled forward on the budgets'
    padded layouts, which the warm-up compiles and checks for every budget: packs of segments it
    never saw run compiled without a compile (attention reads their lengths inside one opaque op)."""
    encoder, reference = qwen3
    runner = warmed(
        encoder, GraphConfig(budgets=(64, 256), compile_exact=False), compiled_forward=eager_compiled(encoder)
    )
    assert runner.warmup_status().compiled and runner.stats.recompile_fallbacks == 0
    assert all(e.live and e.self_check_error < 1e-4 for e in runner.entries.values())
    rng = np.random.default_rng(17)
    packs = [make_images(encoder, rng, sizes) for sizes in ([(256, 256)], [(256, 256), (320, 288), (224, 224)])]
    for pixels, specs in packs:
        assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
        assert runner.stats.last.graph  # through the budgets' buffers, as on CUDA without graphs
    assert runner.stats.recompile_fallbacks == 0
    torch._dynamo.reset()


def test_a_wrong_compiled_exact_route_is_turned_off_at_startup(qwen3):
    """The exact route is checked against eager in the warm-up like the graphs: a stand-in for the
    compiled forward that is wrong only on exact (dense) layouts turns the route off; the graphs
    stay."""
    encoder, reference = qwen3

    def wrong_when_exact(pixel_values, metadata, layout, exact_segments=False):
        out = encoder.forward_padded(pixel_values, metadata, layout, exact_segments)
        if exact_segments:
            out.tokens = out.tokens * float("nan")
        return out

    runner = warmed(encoder, GraphConfig(budgets=(64, 256)), compiled_forward=wrong_when_exact)
    assert runner.describe()["compiled_exact_route"] is False and runner.warmup_status().exact_route is False
    assert all(e.live for e in runner.entries.values())
    pixels, specs = make_images(encoder, np.random.default_rng(9), [(500, 500), (500, 500)])
    outputs = runner.run(pixels, specs)  # oversize, equal segments: uncompiled eager
    assert not runner.stats.last.compiled
    assert_matches_reference(reference, pixels, specs, outputs)


class Answers:
    """An encoder whose answers to the runner's questions can be changed (what another attention
    kernel or model family would answer); everything else is the wrapped encoder's."""

    def __init__(self, encoder, one_call: bool):
        self._encoder, self.one_call = encoder, one_call

    def exact_in_one_call(self, specs) -> bool:
        return self.one_call or self._encoder.exact_in_one_call(specs)

    def __getattr__(self, name):
        return getattr(self._encoder, name)


def test_exact_route_is_priced_and_offered_only_where_measured(qwen3):
    """With measured costs, an equal-segment pack takes the (compiled) exact route when it beats
    the graph; an unequal pack (several attention calls per layer: host time the measured cost
    does not price) does only where the encoder says attention runs it in one call (e.g. backend
    "triton"); a pack below the size the compile held for, or a route whose cost was not
    measured, keeps the graph."""
    encoder, reference = qwen3
    answers = Answers(encoder, one_call=False)
    # the plain forward stands in for the compiled one
    runner = runner_with_costs(answers, lambda budget: 10.0, eager_ms=50.0, compiled_forward=encoder.forward_padded)
    runner.costs.set_startup("exact_ms", [(budget, 5.0) for budget in runner.ladder.budgets])
    rng = np.random.default_rng(10)
    equal_pixels, equal = make_images(encoder, rng, [(256, 256)] * 2)
    unequal_pixels, unequal = make_images(encoder, rng, [(256, 256), (256, 320)])

    assert_matches_reference(reference, equal_pixels, equal, runner.run(equal_pixels, equal))
    assert runner.stats.last.eager_reason == "cost" and runner.stats.last.compiled
    assert_matches_reference(reference, unequal_pixels, unequal, runner.run(unequal_pixels, unequal))
    assert runner.stats.last.graph
    answers.one_call = True  # one launch per layer for any segments
    assert_matches_reference(reference, unequal_pixels, unequal, runner.run(unequal_pixels, unequal))
    assert runner.stats.last.eager_reason == "cost" and runner.stats.last.compiled
    answers.one_call = False

    runner.exact.min_rows = sum(s.input_patches for s in equal) + 1
    runner.run(equal_pixels, equal)
    assert runner.stats.last.graph
    runner.exact.min_rows = 0
    runner.costs.set_startup("exact_ms", [])
    runner.run(equal_pixels, equal)
    assert runner.stats.last.graph and runner.stats.recompile_fallbacks == 0


def test_a_route_without_a_graph_learns_its_cost_from_the_packs_it_serves(qwen3):
    """The startup costs interpolate between full packs and miss host launch time and the first
    run of a new attention shape (a kernel library may build a plan for it). The route measures
    the packs it serves (the GPU span on CUDA, the host clock here): packs of shapes run before
    teach the route's scale; once that is known, a pack with a new shape teaches the cold cost,
    which new shapes are then priced with. On the routes' clock the forward here costs 20 ms, plus
    0.3 s the first time it meets a shape."""
    encoder, reference = qwen3
    built = set()
    clock = RouteClock()

    def builds_per_shape(pixel_values, metadata, layout, exact_segments=False):
        if exact_segments:
            clock.advance(0.02)  # the forward
            if pixel_values.shape[0] not in built:
                built.add(pixel_values.shape[0])
                clock.advance(0.3)  # the build
        return encoder.forward_padded(pixel_values, metadata, layout, exact_segments)

    runner = runner_with_costs(encoder, lambda budget: 150.0, eager_ms=1e9, compiled_forward=builds_per_shape)
    runner.costs.clock = clock.perf_counter
    runner.costs.set_startup("exact_ms", [(budget, 1e-3) for budget in runner.ladder.budgets])  # far below the graphs
    rng = np.random.default_rng(15)
    # 100, 121 and 81 tokens: budget 128 each, three attention shapes the warm-up never ran
    first, big, other = (make_images(encoder, rng, sizes) for sizes in ([(320, 320)], [(352, 352)], [(288, 288)]))

    def route(pixels, specs) -> str:
        assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs, recurring=False))
        last = runner.stats.last
        assert last.budget == 128
        return "graph" if last.graph else "exact" if last.compiled else "eager"

    assert route(*first) == "exact"  # as priced; a new shape before the scale is known: only marked
    assert runner.describe()["learned_cold_ms"] is None and runner.describe()["learned_route_scale"] == {}
    assert route(*first) == "exact"  # a shape run before: this run teaches the scale
    scale = runner.describe()["learned_route_scale"]["exact_ms@128"]
    assert scale == pytest.approx(20 / 1e-3)  # 20 ms measured for 1e-3 priced; under the graph's 150 ms
    assert route(*big) == "exact"  # a new shape, no cold cost known yet: it teaches it
    assert runner.describe()["learned_cold_ms"] == pytest.approx(300)
    assert route(*other) == "graph"  # a new shape, priced with the cold cost
    assert route(*first) == "exact"  # a shape run before: no cold cost


@pytest.mark.parametrize("half_life", [1, 1e9])
def test_a_route_priced_out_by_one_slow_run_is_tried_again(qwen3, half_life):
    """A route is measured only when it runs: one hiccup (here a 1 s stall on a warm shape, on the
    routes' clock) prices it above the graph, and without forgetting it would never run, so never
    be corrected. Each pack it loses forgets part of its learned excess (half-life 1 here so the
    test is short); it then runs again, and its next measurement brings the scale back down. With
    a half-life too long to matter (the second case) it stays priced out."""
    encoder, reference = qwen3
    stall = []
    clock = RouteClock()

    def hiccups(pixel_values, metadata, layout, exact_segments=False):
        if exact_segments:
            clock.advance(0.02 + (stall.pop() if stall else 0.0))
        return encoder.forward_padded(pixel_values, metadata, layout, exact_segments)

    runner = runner_with_costs(encoder, lambda budget: 150.0, eager_ms=1e9, compiled_forward=hiccups)
    runner.costs.clock, runner.costs.forget_half_life = clock.perf_counter, half_life
    runner.costs.set_startup("exact_ms", [(budget, 1e-3) for budget in runner.ladder.budgets])
    pixels, specs = make_images(encoder, np.random.default_rng(16), [(320, 320)])

    def route() -> str:
        assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs, recurring=False))
        return "graph" if runner.stats.last.graph else "exact"

    assert [route(), route()] == ["exact", "exact"]  # the second run teaches the scale
    settled = runner.describe()["learned_route_scale"]["exact_ms@128"]
    assert settled * 1e-3 == pytest.approx(20)
    stall.append(1.0)
    assert route() == "exact"  # the hiccup: ~1000 ms measured, learned at half weight
    assert runner.describe()["learned_route_scale"]["exact_ms@128"] * 1e-3 > 150
    routes = [route() for _ in range(6)]
    if half_life == 1:
        assert routes[0] == "graph" and "exact" in routes  # lost, forgot, ran again...
        assert runner.describe()["learned_route_scale"]["exact_ms@128"] * 1e-3 < 150  # ...and relearned
        assert routes[-1] == "exact"
    else:
        assert routes == ["graph"] * 6


def test_a_failing_exact_compile_leaves_the_route_off_and_the_runner_serving(qwen3, caplog):
    """The exact route is an optimisation: if its compile fails in the warm-up, that is logged and
    the runner reaches full speed without it."""
    encoder, reference = qwen3

    def fails_when_exact(pixel_values, metadata, layout, exact_segments=False):
        if exact_segments:
            raise RuntimeError("inductor failed")
        return encoder.forward_padded(pixel_values, metadata, layout)

    runner = warmed(encoder, GraphConfig(budgets=(64, 256)), compiled_forward=fails_when_exact)
    assert runner.describe()["compiled_exact_route"] is False and runner.warmup_status().full_speed
    assert "compiling the exact-layout route failed" in caplog.text
    pixels, specs = make_images(encoder, np.random.default_rng(11), [(500, 500), (500, 500)])
    assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    assert not runner.stats.last.compiled


def test_a_recurring_pack_gets_its_own_exact_layout_graph(qwen3):
    """The second sighting of a pack (same grids, in any order) sets up its own exact-layout entry
    (its metadata baked in; on CUDA, a captured graph); the third runs through it. Other packs
    through the shared pixel and output buffers in between do not disturb it; every output
    matches transformers. Equal segments (dense attention) and unequal ones alike."""
    encoder, reference = qwen3
    runner = warmed(encoder, GraphConfig(max_budget_tokens=1024, max_items_per_pack=16))
    rng = np.random.default_rng(12)
    packs = [make_images(encoder, rng, sizes) for sizes in ([(300, 200), (120, 90), (250, 250)], [(256, 256)] * 3)]
    other_pixels, other = make_images(encoder, rng, [(400, 380), (64, 64)])
    for round_ in range(3):
        for pixels, specs in packs:
            assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
            # the second sighting still runs by its plan, then sets the pack's entry up
            assert runner.stats.last.graph and runner.stats.last.recurring == (round_ > 1)
            assert_matches_reference(reference, other_pixels, other, runner.run(other_pixels, other))
    stats = runner.stats.snapshot()
    # `other` recurs too (it runs once per pack): its own entry from its third run on
    assert stats["recurring_captured"] == 3 and stats["recurring_hits"] == 2 + 4
    assert stats["recurring_capture_s"] > 0
    assert sum(stats["graph_hits"].values()) == 2 * 2 + 2
    assert runner.describe()["recurring_graphs"] == 3
    dense = next(e for e in runner.recurring.entries.values() if e.dense)
    assert dense.layout.token_budget == sum(s.output_tokens for s in packs[1][1])  # exact: no padding rows

    # the same items in another order are the same pack: its graph serves them, outputs come
    # back in the caller's order
    order = canonical_order(packs[0][1])[::-1]  # the canonical order reversed: not canonical
    assert order != sorted(order)
    pixels, specs = reordered(*packs[0], order)
    hits = runner.stats.recurring_hits
    assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    assert runner.stats.last.recurring and runner.stats.recurring_hits == hits + 1


def test_packs_that_recur_among_more_keys_than_are_kept_get_no_graph(qwen3):
    """With room for 2 recurring graphs, 3 packs in rotation would each be evicted before its
    next sighting: none is captured (each such sighting counted). A pack seen between every
    other one gets its graph."""
    encoder, reference = qwen3
    runner = warmed(encoder, GraphConfig(max_budget_tokens=1024, recurring_graphs=2))
    rng = np.random.default_rng(13)
    rotation = [make_images(encoder, rng, [size]) for size in ((96, 64), (64, 128), (160, 96))]
    for _ in range(3):
        for pixels, specs in rotation:
            assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    assert runner.stats.recurring_captured == 0 and runner.stats.recurring_sparse == 2 * 3
    hot = make_images(encoder, rng, [(128, 128)])
    for pixels, specs in rotation:
        runner.run(*hot)
        runner.run(pixels, specs)
    assert runner.stats.recurring_captured == 1 and runner.stats.last.recurring is False
    assert_matches_reference(reference, *hot, runner.run(*hot))
    assert runner.stats.last.recurring

    # Keys that hold graphs count among the others when they are hit: two packs with graphs and
    # a third in rotation with them would evict one per capture, so the third gets none
    runner = warmed(encoder, GraphConfig(max_budget_tokens=1024, recurring_graphs=2))
    a, b, c = rotation
    for pixels, specs in (a, a, b, b):
        runner.run(pixels, specs)
    assert runner.stats.recurring_captured == 2
    for _ in range(4):
        for pixels, specs in (a, b, c):
            runner.run(pixels, specs)
    assert runner.stats.recurring_captured == 2 and runner.stats.recurring_evicted == 0
    assert runner.stats.recurring_hits == 8


def reordered(pixels, specs, order):
    offsets = np.cumsum([0] + [s.input_patches for s in specs])
    return torch.cat([pixels[offsets[i] : offsets[i + 1]] for i in order]), [specs[i] for i in order]


class RecordsPacks:
    """An encoder that records the grids of every pack it lays out for a graph."""

    def __init__(self, encoder):
        self._encoder, self.packs = encoder, []

    def pack_metadata(self, specs, layout):
        if specs:
            self.packs.append([s.grid_thw for s in specs])
        return self._encoder.pack_metadata(specs, layout)

    def __getattr__(self, name):
        return getattr(self._encoder, name)


def test_items_run_in_canonical_order_and_come_back_in_the_callers(qwen3):
    """Equal segments run together (one run each for grouped attention) whatever order they came
    in; every output still belongs to its own item."""
    encoder, reference = qwen3
    recorder = RecordsPacks(encoder)
    runner = warmed(recorder, GraphConfig(max_budget_tokens=1024, max_items_per_pack=16, recurring_graphs=0))
    pixels, specs = make_images(encoder, np.random.default_rng(14), [(128, 128), (256, 256), (128, 128), (256, 256)])
    recorder.packs.clear()
    assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    big, small = specs[1].grid_thw, specs[0].grid_thw
    assert recorder.packs == [[big, big, small, small]]
    assert [s.grid_thw for s in specs] == [small, big, small, big]  # the caller's list is not touched


def test_recurring_graphs_are_bounded_and_can_be_turned_off(qwen3):
    encoder, reference = qwen3
    rng = np.random.default_rng(13)
    a, b = make_images(encoder, rng, [(256, 256)]), make_images(encoder, rng, [(300, 320), (90, 100)])
    runner = warmed(encoder, GraphConfig(max_budget_tokens=512, recurring_graphs=1))
    for pixels, specs in (a, a, b, b, a, a):
        assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    stats = runner.stats.snapshot()
    # a: captured; b: captured, a evicted; a again, after b: too sparse for one graph; a once
    # more, right after itself: captured, b evicted
    assert stats["recurring_captured"] == 3 and stats["recurring_evicted"] == 2 and stats["recurring_sparse"] == 1
    assert runner.describe()["recurring_graphs"] == 1 and stats["recurring_hits"] == 0

    off = warmed(encoder, GraphConfig(max_budget_tokens=512, recurring_graphs=0))
    for pixels, specs in (a, a, a):
        off.run(pixels, specs)
    assert off.stats.recurring_captured == 0 and off.stats.graph_hits[64] == 3

    # a pack larger than the largest budget never gets one (it would grow the shared pool)
    big_pixels, big = make_images(encoder, rng, [(700, 900)])
    small = warmed(encoder, GraphConfig(max_budget_tokens=128))
    for _ in range(3):
        assert_matches_reference(reference, big_pixels, big, small.run(big_pixels, big))
    assert small.stats.recurring_captured == 0 and small.stats.eager_fallbacks["oversize"] == 3


class RouteClock:
    """A clock for the route costs (`RouteCosts.clock`), advanced only by what a test's forward
    says it costs: learned costs then follow the test's numbers, not the CI machine's load."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def slow_when(exact: bool, forward):
    """`forward` 50 ms slower on exact layouts (`exact` True: a recurring pack's own graph) or on
    padded ones (False: the budgets' graphs): a route slower than another beyond timing noise."""

    def delayed(pixel_values, metadata, layout, exact_segments=False):
        if exact_segments == exact:
            time.sleep(0.05)
        return forward(pixel_values, metadata, layout, exact_segments)

    return delayed


def test_a_recurring_graph_is_kept_only_if_it_beats_the_plan_on_that_pack(qwen3):
    """Where costs are measured, the sighting that earns a pack its own graph runs its plan timed,
    then times the pack's own graph the same way: kept only if faster. A refused pack is not tried
    again and is served by its plan. (A delay stands in for the slower route.)"""
    encoder, reference = qwen3
    pixels, specs = make_images(encoder, np.random.default_rng(14), [(256, 256), (256, 320)])

    slow_plan = runner_with_costs(WithForward(encoder, slow_when(False, encoder.forward_padded)), lambda budget: 1.0)
    for _ in range(3):
        assert_matches_reference(reference, pixels, specs, slow_plan.run(pixels, specs))
    assert slow_plan.stats.recurring_captured == 1 and slow_plan.stats.last.recurring
    assert next(iter(slow_plan.recurring.entries.values())).replay_ms > 0  # kept: it beat the plan's time

    slow_own = runner_with_costs(WithForward(encoder, slow_when(True, encoder.forward_padded)), lambda budget: 1.0)
    for _ in range(4):
        assert_matches_reference(reference, pixels, specs, slow_own.run(pixels, specs))
        assert slow_own.stats.last.graph and not slow_own.stats.last.recurring
    assert slow_own.stats.recurring_rejected == {"slower": 1} and slow_own.stats.recurring_captured == 0


def test_a_recurring_graph_that_fails_to_set_up_leaves_the_pack_to_its_plan(qwen3):
    encoder, reference = qwen3

    def fails_when_exact(pixel_values, metadata, layout, exact_segments=False):
        if exact_segments:
            raise RuntimeError("no kernel")
        return encoder.forward_padded(pixel_values, metadata, layout)

    runner = warmed(WithForward(encoder, fails_when_exact), GraphConfig(max_budget_tokens=512))
    pixels, specs = make_images(encoder, np.random.default_rng(15), [(256, 256)] * 2)
    for _ in range(3):
        assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    assert runner.stats.recurring_rejected == {"error": 1} and runner.stats.graph_hits[128] == 3


class Flaky:
    """A padded forward whose output on exact layouts (a recurring pack's own graph) can be scaled
    (x2 on every other call, or NaN) on demand; padded layouts run 50 ms slower, sound."""

    def __init__(self, encoder):
        self.encoder, self.calls, self.alternate, self.nan = encoder, 0, False, False
        self.padded = slow_when(False, encoder.forward_padded)

    def __call__(self, pixel_values, metadata, layout, exact_segments=False):
        if not exact_segments:
            return self.padded(pixel_values, metadata, layout)
        self.calls += 1
        out = self.encoder.forward_padded(pixel_values, metadata, layout, exact_segments)
        if self.nan or (self.alternate and self.calls % 2 == 0):
            out.tokens = out.tokens * (float("nan") if self.nan else 2.0)
        return out


def test_a_recurring_graph_that_disagrees_or_turns_nonfinite_is_dropped_and_the_pack_served(qwen3):
    """A pack's own graph that disagrees with its own warm-up run is refused ("mismatch"); one kept
    that later returns NaN/inf is dropped at run time ("nonfinite"), that pack is recomputed
    eagerly, and neither pack is tried again. The budgets' graphs are sound but slower, so a
    sound own graph is always kept."""
    encoder, reference = qwen3
    rng = np.random.default_rng(16)
    pixels, specs = make_images(encoder, rng, [(256, 256), (256, 320)])
    flaky = Flaky(encoder)
    runner = runner_with_costs(WithForward(encoder, flaky), lambda budget: 1e6)

    flaky.alternate = True  # warm-up and replay disagree
    for _ in range(4):
        assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    assert runner.stats.recurring_rejected == {"mismatch": 1} and not runner.recurring.entries

    flaky.alternate = False
    other_pixels, other = make_images(encoder, rng, [(300, 300)])
    for _ in range(3):
        runner.run(other_pixels, other)
    assert runner.stats.last.recurring and len(runner.recurring.entries) == 1
    flaky.nan = True
    for _ in range(3):
        assert_matches_reference(reference, other_pixels, other, runner.run(other_pixels, other))
        assert not runner.stats.last.recurring
    assert runner.stats.recurring_rejected == {"mismatch": 1, "nonfinite": 1} and not runner.recurring.entries
    assert runner.stats.eager_fallbacks["nonfinite"] == 1
