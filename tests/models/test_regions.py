"""Regional compilation: one trace of the repeated layer serves every layer, only where asked."""

from __future__ import annotations

import dataclasses
import functools
import threading

import numpy as np
import pytest
import torch
import torch._dynamo

from models import from_preset, resolve_preset
from models.regions import compiled_regions, module_region
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
    images = [random_image(rng, h, w) for h, w in sizes]
    specs = [pre.image_spec(*image.shape[-2:]) for image in images]
    return pre.pixel_values([pre.resize_image(image) for image in images], "image"), specs


def deeper(name: str, layers: int = 8):
    """A tiny preset with more layers than a compiled forward has graphs."""
    preset = resolve_preset(None, name)
    key = "depth" if "depth" in preset.vision_config else "num_hidden_layers"
    return dataclasses.replace(preset, vision_config={**preset.vision_config, key: layers})


@pytest.mark.parametrize("preset", [*sorted(FAMILY_TINY.values()), "internvl-tiny"])
def test_one_trace_serves_every_layer_and_the_plain_forward_stays_uncompiled(preset):
    """On an 8-layer tower `compiled_forward` gives what `forward_padded` gives, compiling fewer
    graphs than there are layers (the first layer's input is a view, the last layer may differ,
    the stem and mergers are regions of their own; the exact layout's attention as many again),
    and calls compiled code at least once per layer; `forward_padded`, on this thread and on
    another one while this one is in a compiled forward, never runs compiled code."""
    encoder = from_preset(deeper(preset), seed=1)
    assert layers(encoder) == 8
    backend = CountingBackend()
    torch._dynamo.reset()
    try:
        compiled = encoder.compiled_forward(functools.partial(torch.compile, backend=backend, dynamic=True))
        rng = np.random.default_rng(3)
        pixels, specs = pack(encoder, rng, [(256, 256), (128, 192)])
        budget = 1 << sum(s.output_tokens for s in specs).bit_length()
        longest = max(s.frame_patches for s in specs)
        layout = encoder.pack_layout(budget, max(1024, longest), sum(s.segments for s in specs) + 4)
        metadata = encoder.pack_metadata(specs, layout)
        rows = torch.zeros(budget * encoder.merge_unit, encoder.patch_dim)
        rows[: pixels.shape[0]] = pixels
        with torch.no_grad():
            out = compiled(rows, metadata, layout)
            assert 0 < backend.graphs <= 6 < layers(encoder)
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


def test_one_region_takes_modules_of_one_class_only():
    """Modules of two classes would share one compiled function and guard each other out."""
    with pytest.raises(ValueError, match="share one class"):
        module_region([torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)])
