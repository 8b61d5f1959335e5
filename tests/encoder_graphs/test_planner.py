"""The planner and the runner over an encoder that is not a Qwen tower: the seam holds for a family
of fixed tiles with plain dense attention per tile and no varlen metadata (as InternVL's)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from encoder_graphs.config import GraphConfig
from encoder_graphs.plan import EagerPlan, GraphPlan
from encoder_graphs.runner import EncoderRunner
from models.protocol import EncoderOutput, ItemSpec, PackCapacityError, PackLayout, VisionEncoder
from tests.helpers import relative_error, warmed

TILE = 4
"""Patches per tile side: a tile is one attention segment of TILE * TILE patches."""


class TileEncoder:
    """Fixed tiles of 16 patches, each attending to itself alone (dense), merged 4 patches to a token."""

    family = "tiles"
    merge_unit = 4
    patch_dim = 3
    out_hidden = 2
    num_deepstack = 0
    min_item_tokens = TILE * TILE // 4
    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self):
        self.weight = torch.randn(self.patch_dim, self.out_hidden, generator=torch.Generator().manual_seed(0))

    def graph_seqlen_buckets(self, budget_rows: int) -> tuple[int, ...]:
        return (TILE * TILE,)

    def pack_layout(self, token_budget: int, max_seqlen: int, max_segments: int) -> PackLayout:
        return PackLayout(token_budget, TILE * TILE, max_segments)

    def exact_layout(self, specs) -> PackLayout:
        return PackLayout(sum(s.output_tokens for s in specs), TILE * TILE, sum(s.grid_thw[0] for s in specs))

    def metadata_specs(self, layout: PackLayout) -> dict:
        return {}

    def pack_metadata(self, specs, layout: PackLayout) -> dict:
        rows = sum(s.input_patches for s in specs)
        if rows > layout.token_budget * self.merge_unit or sum(s.grid_thw[0] for s in specs) > layout.max_segments:
            raise PackCapacityError(f"{rows} rows do not fit {layout}")
        return {}

    def forward_padded(self, pixel_values, metadata, layout, exact_segments=False) -> EncoderOutput:
        tiles = pixel_values.reshape(-1, TILE * TILE, self.patch_dim)  # padding rows form whole tiles too
        attended = torch.softmax(tiles @ tiles.transpose(1, 2), dim=-1) @ tiles
        merged = attended.reshape(-1, self.merge_unit, self.patch_dim).mean(1)
        return EncoderOutput(merged @ self.weight)

    def forward_eager(self, pixel_values, specs, forward=None) -> EncoderOutput:
        return (forward or self.forward_padded)(pixel_values, {}, self.exact_layout(specs), True)

    def synthetic_item(self, patches: int) -> ItemSpec:
        return tiles_item(max(1, patches // (TILE * TILE)))

    def exact_segments(self, specs):
        return contextlib.nullcontext()

    def exact_in_one_call(self, specs) -> bool:
        return True

    def capturing(self):
        return contextlib.nullcontext()

    def compile_identity(self) -> dict:
        return {"family": self.family}

    def compiled_forward(self, compile):
        return compile(self.forward_padded)  # one layer: the whole forward is its region


def tiles_item(count: int) -> ItemSpec:
    """An image of `count` tiles (a segment each)."""
    patches = count * TILE * TILE
    return ItemSpec("image", (count, TILE, TILE), patches, patches // 4)


def reference(encoder: TileEncoder, pixels: torch.Tensor) -> torch.Tensor:
    """One item's tokens written out tile by tile: each tile's attention, then 4 patches to a token."""
    tokens = []
    for tile in pixels.split(TILE * TILE):
        weights = torch.softmax(tile @ tile.T, dim=-1)
        tokens.append((weights @ tile).reshape(-1, 4, encoder.patch_dim).mean(1) @ encoder.weight)
    return torch.cat(tokens)


def pack(encoder: TileEncoder, counts, seed: int = 0):
    specs = [tiles_item(n) for n in counts]
    rows = sum(s.input_patches for s in specs)
    return torch.randn(rows, encoder.patch_dim, generator=torch.Generator().manual_seed(seed)), specs


def test_the_tile_encoder_satisfies_the_protocol():
    assert isinstance(TileEncoder(), VisionEncoder)


def planned(runner: EncoderRunner, counts) -> EagerPlan | GraphPlan:
    specs = [tiles_item(n) for n in counts]
    tokens = sum(s.output_tokens for s in specs)
    return runner.planner.plan(specs, tokens, runner.table.fitting_budget(tokens))


def budgets_of(plan: GraphPlan) -> list[int]:
    return [part.entry.key[0] for part in plan.parts]


def test_plans_follow_the_graphs_state_and_the_costs():
    runner = EncoderRunner(TileEncoder(), GraphConfig(budgets=(4, 8, 16, 32)))
    assert sorted(runner.entries) == [(4, 16), (8, 16), (16, 16), (32, 16)]  # one bucket: the tile
    assert planned(runner, [2, 1]) == EagerPlan("warming")  # nothing live before the warm-up
    runner.prepare(progress=lambda message: None)
    runner.warm_up(progress=lambda message: None)
    assert planned(runner, [9]) == EagerPlan("oversize")  # 36 tokens
    assert budgets_of(planned(runner, [2, 1])) == [16]  # no costs measured: the fitting graph

    for (budget, _), entry in runner.entries.items():
        entry.replay_ms = budget**2 / 10
    runner.costs.set_startup("eager_ms", [(4, 500.0), (32, 500.0)])
    split = planned(runner, [4, 1])  # 20 tokens: budget 32 (102 ms) or 16 + 4 (27 ms)
    assert budgets_of(split) == [16, 4] and [part.indices for part in split.parts] == [(0,), (1,)]
    assert split.beaten == (("eager_ms", 32),)
    runner.costs.set_startup("eager_ms", [(4, 1.0), (32, 1.0)])
    assert planned(runner, [4, 1]) == EagerPlan("cost")
    for entry in runner.entries.values():
        entry.replay_ms = 1.0
    runner.costs.set_startup("eager_ms", [(4, 500.0), (32, 500.0)])
    single = planned(runner, [4, 1])
    assert budgets_of(single) == [32] and single.beaten == (("eager_ms", 32), ("split", 32))
    runner.table.disable(runner.entries[(32, 16)], "a test")
    assert planned(runner, [4, 1]) == EagerPlan("no_graph")


def test_planning_mutates_nothing():
    runner = warmed(TileEncoder(), GraphConfig(budgets=(4, 8, 16, 32)))
    for (budget, _), entry in runner.entries.items():
        entry.replay_ms = float(budget)
    runner.costs.set_startup("eager_ms", [(4, 100.0), (32, 100.0)])
    runner.costs.route_scale[("eager_ms", 32)] = 3.0
    first, second = planned(runner, [4, 1]), planned(runner, [4, 1])
    assert budgets_of(first) == budgets_of(second) and runner.costs.route_scale == {("eager_ms", 32): 3.0}


def assert_per_tile_reference(encoder, pixels, specs, outputs):
    row = 0
    for spec, out in zip(specs, outputs):
        assert relative_error(out.tokens, reference(encoder, pixels[row : row + spec.input_patches])) < 1e-5
        row += spec.input_patches


@pytest.mark.parametrize("counts", [[1], [3, 1], [2, 2, 2, 1], [9], [8, 8]])
def test_the_runner_serves_tile_packs_as_the_per_tile_reference(counts):
    """One graph, oversize, and from the third sighting the pack's own graph: each item gets what
    its tiles give alone."""
    encoder = TileEncoder()
    runner = warmed(encoder, GraphConfig(budgets=(4, 8, 16, 32)))
    pixels, specs = pack(encoder, counts)
    for _ in range(3):
        assert_per_tile_reference(encoder, pixels, specs, runner.run(pixels, specs))
    assert runner.stats.last.recurring == (sum(s.output_tokens for s in specs) <= 32)
    assert runner.stats.first_pack_mismatches == 0


def test_a_split_tile_pack_comes_back_in_item_order():
    encoder = TileEncoder()
    runner = warmed(encoder, GraphConfig(budgets=(4, 8, 16, 32)))
    for (budget, _), entry in runner.entries.items():
        entry.replay_ms = budget**2 / 10
    runner.costs.set_startup("eager_ms", [(4, 500.0), (32, 500.0)])
    pixels, specs = pack(encoder, [1, 4, 1])  # 24 tokens: 16 + 8 beats 32
    assert_per_tile_reference(encoder, pixels, specs, runner.run(pixels, specs, recurring=False))
    assert runner.stats.split_packs == 1 and runner.stats.graph_hits == {16: 1, 8: 1}


def test_live_budgets_are_reported_as_graphs_go_live():
    runner = EncoderRunner(TileEncoder(), GraphConfig(budgets=(4, 8, 16, 32)))
    runner.prepare(progress=lambda message: None)
    assert runner.live_budgets() == ()
    pixels, specs = pack(runner.encoder, [2])  # 8 tokens, served before its graph is live
    runner.run(pixels, specs)
    assert runner.stats.last.eager_reason == "warming"
    runner.warm_up(progress=lambda message: None)
    assert runner.live_budgets() == (4, 8, 16, 32) and runner.warmup_status().full_speed
    assert_per_tile_reference(runner.encoder, pixels, specs, runner.run(pixels, specs))
    assert runner.stats.last.graph
