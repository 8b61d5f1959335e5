"""The warm-up's overlapped check pipeline (`CheckPipeline`): each graph built is checked against the
eager forward on a sample pack of its own, and that checked run is also the one timed. A graph
captured is checked while the next one is captured: its checked run is launched under the next
step's lock, before that capture, and read after it, so the GPU replays one graph while the host
captures the next. Every method that touches the device runs under the caller's device lock."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from models.protocol import EncoderOutput, ItemSpec

from .entry import LIVE, PENDING, GraphEntry, GraphKey
from .parts import RunnerParts
from .references import References, SamplePack
from .selfcheck import DeviceTimer, best_ms, pack_error, sample_frame, synthetic_specs

RETIME_MS = 20.0
"""A graph whose checked (first) run took less is timed on the best of two more: the first includes
the graph's upload, which counts in a short replay."""
UPCOMING_GRAPHS = 16
"""Graphs, in the order they are likely built, whose references one eager forward may also take."""


@dataclass
class Check:
    """What one graph's check needs: the sample pack and its eager reference."""

    entry: GraphEntry
    pixels: torch.Tensor
    specs: list
    metadata: dict[str, torch.Tensor]
    reference: EncoderOutput

    @property
    def tokens(self) -> int:
        return sum(s.output_tokens for s in self.specs)


@dataclass
class Launched:
    """A check's run, launched and not yet read (`passed` None) or read once."""

    check: Check
    timer: DeviceTimer | None = None
    passed: bool | None = None


class CheckPipeline:
    """Sample packs, their eager references, and the one graph captured but not yet checked."""

    def __init__(self, parts: RunnerParts):
        self.parts = parts
        self.unchecked: Check | None = None
        """The graph captured last, not yet checked: its checked run overlaps the next capture."""
        self._references: References | None = None

    @property
    def references(self) -> References:
        """The graph checks' eager references (made on first use; `release` frees them)."""
        if self._references is None:
            rows = self.parts.table.budgets[-1] * self.parts.encoder.merge_unit
            self._references = References(self.parts.encoder, batch_rows=rows)
        return self._references

    def release(self) -> References | None:
        """Free the references (the warm-up stopped, failed or built every graph); the ones freed."""
        references, self._references = self._references, None
        return references

    def sample_specs(self, key: GraphKey) -> list[ItemSpec]:
        """The items of the sample pack that checks and times graph `key`."""
        budget, seqlen = key
        parts = self.parts
        frame = sample_frame([e.key[1] for e in parts.table.by_budget.get(budget, [])], seqlen)
        return synthetic_specs(parts.encoder, budget, seqlen, parts.ladder.max_items, frame)

    def expect(self, keys: Iterable[GraphKey]) -> None:
        """The graphs the warm-up will check (their sample items share eager forwards)."""
        self.references.expect(self.sample_specs(key) for key in keys)

    def make(self, entry: GraphEntry, upcoming: Sequence[GraphKey]) -> Check:
        """`entry`'s check (no lock: the eager reference runs on tensors of its own); `upcoming`:
        graphs likely checked next, whose references the same eager forward may also take."""
        sample: SamplePack = self.references.pack(self.sample_specs(entry.key))
        later = [self.sample_specs(key) for key in upcoming if key != entry.key]
        self.references.prepare([sample.specs, *later[:UPCOMING_GRAPHS]])
        reference = self.references.reference(sample)
        metadata = self.parts.encoder.pack_metadata(sample.specs, entry.layout)
        return Check(entry, sample.pixels, sample.specs, metadata, reference)

    def launch(self, check: Check | None = None) -> Launched:
        """The checked run of `check`'s graph (default: the one captured last), launched on the
        sample pack and not waited for. With graphs that run is also the one timed (copies in and
        out included: a split pays them per part), on CUDA events, so a capture meanwhile does not
        count; a graph costs one replay here, not two."""
        if check is None:
            check, self.unchecked = self.unchecked, None
        parts, entry = self.parts, check.entry
        for name, rows in entry.outputs.items():  # a graph that leaves them unwritten fails the check
            if rows.is_floating_point():
                (rows[: check.tokens] if name != "deepstack" else rows[:, : check.tokens]).fill_(math.nan)
        if entry.graph is None:  # the forward itself (no graph: CPU, or `cuda_graphs: false`)
            parts.io.fill(entry, check.pixels, check.metadata)
            parts.io.forward_into(entry)
            return Launched(check)
        timer = DeviceTimer(parts.device)
        parts.io.launch(entry, check.metadata, check.pixels, check.specs, parts.device)
        return Launched(check, timer.stop())

    def settle(self, launched: Launched) -> bool:
        """Read a launched check (once): the graph against the eager reference, disabled on a
        mismatch; its time, where the run was short (`RETIME_MS`: a graph's first launch includes
        its upload), the best of two more. Whether it passed."""
        if launched.passed is not None:
            return launched.passed
        parts, check = self.parts, launched.check
        entry, tokens = check.entry, check.tokens
        replay_ms = launched.timer.ms() if launched.timer is not None else math.nan
        deepstack = entry.outputs.get("deepstack")
        error = pack_error(
            entry.outputs["tokens"][:tokens], None if deepstack is None else deepstack[:, :tokens], check.reference
        )
        entry.self_check_error = error
        tolerance = parts.config.self_check_tolerance
        if not math.isfinite(error) or error > tolerance:
            parts.table.disable(entry, f"self-check error {error:.3g} > {tolerance}")
            launched.passed = False
            return False
        if replay_ms < RETIME_MS:
            launch = lambda: parts.io.launch(entry, check.metadata, check.pixels, check.specs, parts.device)  # noqa: E731
            replay_ms = best_ms(launch, parts.device)
        entry.replay_ms = replay_ms
        if entry.graph is not None and entry.state == PENDING:  # a graph goes live once checked
            entry.state = LIVE
        launched.passed = True
        return True

    def launch_unchecked(self) -> Launched | None:
        """The checked run of the graph captured last, launched (None: there is none)."""
        return self.launch() if self.unchecked is not None else None
