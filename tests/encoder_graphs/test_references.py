"""The warm-up's sample packs and their eager references, computed per distinct item (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from encoder_graphs.config import GraphConfig
from encoder_graphs.references import References, item_keys
from encoder_graphs.runner import EncoderRunner
from encoder_graphs.selfcheck import sample_frame, synthetic_specs
from models import from_preset
from models.protocol import EncoderOutput
from tests.helpers import reference_item, reference_tower, relative_error


@pytest.fixture(scope="module")
def qwen3():
    encoder = from_preset("qwen3-vl-tiny", seed=5)
    return encoder, reference_tower(encoder)


def test_equal_items_cycle_through_three_pixel_draws(qwen3):
    encoder, _ = qwen3
    specs = synthetic_specs(encoder, 256, 64, 64)  # 16 equal images of 64 patches
    assert len(set(specs)) == 1 and len(specs) == 16
    pixels = References(encoder, batch_rows=1024).pack(specs).pixels
    items = [pixels[i * 64 : (i + 1) * 64] for i in range(4)]
    # neighbours, and items two apart, differ: a leak across a boundary or rows moved by one or
    # two items change what the check compares
    assert not torch.equal(items[0], items[1]) and not torch.equal(items[0], items[2])
    assert torch.equal(items[0], items[3])
    assert [v for _, v in item_keys(specs)] == [0, 1, 2] * 5 + [0]


def test_a_packs_reference_is_each_items_transformers_output(qwen3):
    encoder, tower = qwen3
    references = References(encoder, batch_rows=4096)
    specs = synthetic_specs(encoder, 512, 256, 64, frame=144)  # 14 images of 144 patches and a remainder
    assert len(set(specs)) == 2
    sample = references.pack(specs)
    reference = references.reference(sample)
    assert references.eager_forwards == 1 and references.eager_rows == 3 * 144 + specs[-1].input_patches
    row = token = 0
    for spec in specs:
        pixels = sample.pixels[row : row + spec.input_patches].float()
        expected, deepstack = reference_item(tower, pixels, spec.grid_thw)
        got = slice(token, token + spec.output_tokens)
        assert relative_error(reference.tokens[got], expected) <= 1e-4
        assert relative_error(reference.deepstack[:, got], deepstack) <= 1e-4
        row, token = row + spec.input_patches, token + spec.output_tokens
    assert token == reference.tokens.shape[0]


def test_a_whole_ladders_references_take_a_few_eager_forwards(qwen3):
    encoder, _ = qwen3
    table = EncoderRunner(encoder, GraphConfig(max_budget_tokens=2048)).table
    packs = []
    for budget, seqlen in sorted(table.entries):
        frame = sample_frame([e.key[1] for e in table.by_budget[budget]], seqlen)
        packs.append(synthetic_specs(encoder, budget, seqlen, table.ladder.max_items, frame))
    references = References(encoder, batch_rows=table.budgets[-1] * encoder.merge_unit)
    references.expect(packs)
    for index, specs in enumerate(packs):
        references.prepare(packs[index : index + 16])
        references.reference(references.pack(specs))
    pack_rows = sum(s.input_patches for specs in packs for s in specs)
    distinct = {k for specs in packs for k in item_keys(specs)}
    assert references.eager_rows == sum(k[0].input_patches for k in distinct) < pack_rows / 4  # each once
    assert not references._outputs and references.bytes == 0
    assert references.eager_forwards * 4 < len(packs)


def test_an_items_output_is_held_until_the_last_announced_pack_that_holds_it(qwen3):
    encoder, _ = qwen3
    references = References(encoder, batch_rows=4096)
    shared = synthetic_specs(encoder, 256, 256, 64, frame=64)  # 16 images of 64 patches: three draws
    first, second = shared, shared[:2]
    references.expect([first, second])
    references.reference(references.pack(first))
    assert set(references._outputs) == set(item_keys(second))
    references.reference(references.pack(second))
    assert not references._outputs and references.bytes == 0
    references.reference(references.pack(first))  # not announced: run again, then dropped
    assert references.eager_forwards == 2 and not references._outputs


def test_the_warm_up_checks_every_graph_with_few_eager_forwards(qwen3):
    encoder, _ = qwen3
    # a stand-in compiled forward: on CPU the warm-up checks graphs (padded layouts) only with one
    runner = EncoderRunner(encoder, GraphConfig(max_budget_tokens=1024), compiled_forward=encoder.forward_padded)
    runner.prepare(progress=lambda message: None)
    forwards = []
    eager = encoder.forward_eager

    def counted(pixels, specs, forward=None):
        forwards.append(pixels.shape[0])
        return eager(pixels, specs, forward)

    encoder.forward_eager = counted
    try:
        runner.warm_up(progress=lambda message: None)
    finally:
        del encoder.forward_eager
    graphs = len(runner.table.entries)
    assert runner.warmup_status().full_speed and runner.table.live_count() == graphs
    assert all(math.isfinite(e.self_check_error) for e in runner.table.entries.values())
    assert 0 < len(forwards) * 2 < graphs


@pytest.mark.parametrize("items", [1, 2])
def test_a_forward_that_moves_rows_by_whole_items_fails_its_check(qwen3, items):
    """Equal sample items differ in their pixels, so rows moved by one or two items show."""
    encoder, _ = qwen3

    def moved(pixel_values, metadata, layout, *args):
        out = encoder.forward_padded(pixel_values, metadata, layout, *args)
        shift = int(metadata["cu_seqlens"][1]) // encoder.merge_unit * items  # the first item's tokens
        deepstack = None if out.deepstack is None else out.deepstack.roll(shift, dims=1)
        return EncoderOutput(out.tokens.roll(shift, dims=0), deepstack)

    runner = EncoderRunner(encoder, GraphConfig(budgets=(256,)), compiled_forward=moved)
    runner.prepare(progress=lambda message: None)
    runner.warm_up(progress=lambda message: None)
    several = [e for e in runner.table.entries.values() if e.key[1] < 256 * encoder.merge_unit]  # not one frame
    assert several and not any(e.enabled for e in several)
