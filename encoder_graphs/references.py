"""Sample packs for the warm-up's graph checks, and their eager references, computed once per
distinct item (`References`).

A graph's sample pack repeats its bucket's frame up to the budget, plus one remainder item, so
the graphs of a ladder share few distinct items. Each runs eagerly once, beside those of the
graphs built next, in one forward, and is held until the last graph that holds it is checked; a
pack's reference is its items' outputs laid end to end (the items of a pack never interact).
Equal items in a pack cycle through `VARIANTS` pixel draws, so that attention leaking across a
segment boundary, or rows shifted by an item or two, still change what the check compares.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from models.protocol import EncoderOutput, ItemSpec, VisionEncoder

from .selfcheck import synthetic_pixels

ItemKey = tuple[ItemSpec, int]
"""A distinct sample item: its spec and which of the `VARIANTS` pixel draws it has."""

VARIANTS = 3
"""Pixel draws equal items cycle through: rows moved by fewer items than this change the check."""


def item_keys(specs: Sequence[ItemSpec]) -> list[ItemKey]:
    """Each item's key: equal specs take the draws in turn (A, B, C, A, ...), others the first."""
    seen: dict[ItemSpec, int] = {}
    keys = []
    for spec in specs:
        count = seen.get(spec, 0)
        seen[spec] = count + 1
        keys.append((spec, count % VARIANTS))
    return keys


def item_seed(key: ItemKey) -> int:
    """A seed for the item's pixels that is the same in every process (not `hash`)."""
    spec, variant = key
    return zlib.crc32(repr((spec.modality, spec.grid_thw, variant)).encode())


@dataclass(frozen=True)
class SamplePack:
    """A graph's sample pack: its items, their keys, and its pixels."""

    specs: list[ItemSpec]
    keys: list[ItemKey]
    pixels: torch.Tensor
    """The whole pack's pixel rows, in the encoder's dtype, on its device."""


class References:
    """Distinct sample items' eager outputs, each held from its eager forward until the last
    pack that was announced with it (`expect`) got its reference.

    One eager forward takes the items missing for several packs, up to `batch_rows` rows (always
    all of the first pack's)."""

    def __init__(self, encoder: VisionEncoder, batch_rows: int):
        self.encoder = encoder
        self.batch_rows = batch_rows
        self._outputs: dict[ItemKey, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._uses: Counter[ItemKey] = Counter()
        self.bytes = 0
        self.peak_bytes = 0
        self.eager_forwards = 0
        """Eager forwards run for references (for tests and the log)."""
        self.eager_rows = 0

    def expect(self, packs: Iterable[Sequence[ItemSpec]]) -> None:
        """Packs whose references will be asked for: their items are kept until then."""
        for specs in packs:
            self._uses.update(set(item_keys(specs)))

    def pack(self, specs: Sequence[ItemSpec]) -> SamplePack:
        keys = item_keys(specs)
        return SamplePack(list(specs), keys, self._pixels(keys))

    def _pixels(self, keys: Sequence[ItemKey]) -> torch.Tensor:
        """The items' pixels end to end, each distinct item drawn once (on the device: cheap, so
        drawn again rather than held)."""
        encoder = self.encoder
        drawn = {
            key: synthetic_pixels([key[0]], encoder.patch_dim, encoder.device, seed=item_seed(key)).to(encoder.dtype)
            for key in dict.fromkeys(keys)
        }
        return torch.cat([drawn[key] for key in keys])

    def prepare(self, packs: Iterable[Sequence[ItemSpec]]) -> None:
        """Run eagerly, in one forward, the items the first pack lacks, then those the next ones
        lack while they fit in `batch_rows`."""
        missing: dict[ItemKey, None] = {}
        rows = 0
        for index, specs in enumerate(packs):
            new = [k for k in dict.fromkeys(item_keys(specs)) if k not in self._outputs and k not in missing]
            added = sum(k[0].input_patches for k in new)
            if index > 0 and rows + added > self.batch_rows:
                break
            missing.update(dict.fromkeys(new))
            rows += added
        if missing:
            self._run(list(missing))

    def _run(self, keys: list[ItemKey]) -> None:
        specs = [k[0] for k in keys]
        pixels = self._pixels(keys)
        out = self.encoder.forward_eager(pixels, specs)
        self.eager_forwards += 1
        self.eager_rows += pixels.shape[0]
        start = 0
        for key, spec in zip(keys, specs):
            end = start + spec.output_tokens
            tokens = out.tokens[start:end].clone()  # not a view: the forward's output is freed
            deepstack = None if out.deepstack is None else out.deepstack[:, start:end].clone()
            self._outputs[key] = (tokens, deepstack)
            self.bytes += _nbytes(tokens, deepstack)
            start = end
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def reference(self, sample: SamplePack) -> EncoderOutput:
        """The eager outputs of the pack's items, item after item (run now where missing); the
        items no announced pack still needs are dropped."""
        if any(k not in self._outputs for k in sample.keys):
            self.prepare([sample.specs])
        parts = [self._outputs[key] for key in sample.keys]
        tokens = torch.cat([p[0] for p in parts])
        deepstack = None if parts[0][1] is None else torch.cat([p[1] for p in parts], dim=1)
        for key in set(sample.keys):
            self._uses[key] -= 1
            if self._uses[key] <= 0:
                del self._uses[key]
                self.bytes -= _nbytes(*self._outputs.pop(key))
        return EncoderOutput(tokens, deepstack)


def _nbytes(tokens: torch.Tensor, deepstack: torch.Tensor | None) -> int:
    size = tokens.numel() * tokens.element_size()
    return size if deepstack is None else size + deepstack.numel() * deepstack.element_size()
