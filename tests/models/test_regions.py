"""Regional compilation: one trace of the repeated layer serves every layer, only where asked."""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
import torch
import torch._dynamo

from models import from_preset
from models.regions import compiled_regions
from tests.helpers import FAMILY_TINY, random_image, relative_error


class CountingBackend:
    """A dynamo backend that runs the traced graph as is, counting the graphs it was given and
    the calls of them."""

    def __init__(self):
        self.graphs = 0
        self.calls = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs):
        self.graphs += 1

        def run(*args):
            self.calls += 1
            return graph.forward(*args)

        return run


def layers(encoder) -> int:
    tower = encoder.tower
    return len(tower.blocks) if hasattr(tower, "blocks") else tower.layers


def pack(encoder, rng, sizes):
    pre = encoder.preprocessor
    resized = [pre.resize_image(random_image(rng, h, w)) for h, w in sizes]
    specs = [pre.spec("image", 1, *r.shape[-2:]) for r in resized]
    return pre.pixel_values(resized, "image"), specs


@pytest.mark.parametrize("family", sorted(FAMILY_TINY))
def test_one_trace_serves_every_layer_and_the_plain_forward_stays_uncompiled(family):
    """`compiled_forward` gives what `forward_padded` gives, compiling at most three graphs
        whatever the depth (the first layer takes a view, the last one may differ; then the exact
        layout's attention, as many again); `forward_padded`, on this thread and on another one while
        this one is in a compiled forward, never runs compiled code; a compiled forward calls compiled
    code once per layer."""
    encoder = from_preset(FAMILY_TINY[family], seed=1)
    backend = CountingBackend()
    torch._dynamo.reset()
    try:
        compiled = encoder.compiled_forward(functools.partial(torch.compile, backend=backend, dynamic=True))
        rng = np.random.default_rng(3)
        pixels, specs = pack(encoder, rng, [(256, 256), (128, 192)])
        layout = encoder.pack_layout(512, 1024, 4)
        metadata = encoder.pack_metadata(specs, layout)
        rows = torch.zeros(512 * encoder.merge_unit, encoder.patch_dim)
        rows[: pixels.shape[0]] = pixels
        with torch.no_grad():
            out = compiled(rows, metadata, layout)
            assert 0 < backend.graphs <= 6
            want = encoder.forward_padded(rows, metadata, layout)
            assert relative_error(out.tokens, want.tokens) < 1e-5
            exact = encoder.forward_eager(pixels, specs, forward=compiled)
            assert relative_error(exact.tokens, encoder.forward_eager(pixels, specs).tokens) < 1e-5
            assert backend.graphs <= 12

            calls = backend.calls
            encoder.forward_padded(rows, metadata, layout)
            other = threading.Thread(target=encoder.forward_padded, args=(rows, metadata, layout))
            with compiled_regions():  # this thread's regions compiled; the other thread's not
                other.start()
                other.join()
            assert backend.calls == calls
            compiled(rows, metadata, layout)
            assert backend.calls - calls >= layers(encoder)  # regions: compiled code per layer
    finally:
        torch._dynamo.reset()
