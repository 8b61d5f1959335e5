"""Graphs of recurring packs' own exact layouts (`RecurringGraphs`): counted sightings, capture on
the sighting that earns one, kept only where they beat the pack's plan."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence

import torch

from models import attention
from models.layout import segment_lengths
from models.protocol import ItemSpec

from .entry import GraphEntry, PackKey
from .memory import pool_reserved_bytes
from .route_costs import SIGHTINGS_KEPT, attention_shapes
from .selfcheck import relative_error, time_ms

logger = logging.getLogger(__name__)

RECURRING_MIN_FREE = 1 << 30
"""Free GPU memory (bytes) below which no recurring pack's graph is captured."""


class RecurringGraphs:
    """`EncoderRunner`'s graphs of recurring packs (a mixin). Relies on the runner's `encoder`,
    `config`, `device`, `ladder`, `stats`, `memory`, `use_graphs`, `costs` (`RouteCosts`), `_pool`,
    `_side`, `_outputs`, `_compiled`, `_forward`, `_sightings`, `_recurring` and its methods
    `_input_specs`, `_output_specs`, `_fill`, `_execute`, `_take`, `_forward_into_outputs`,
    `_synchronize`."""

    def _recurs(self, key: PackKey, specs: Sequence[ItemSpec]) -> bool:
        """Count a sighting of `key`; True when this is the one that earns the pack its own graph.
        Packs larger than the largest budget's rows never do (their intermediates would grow the
        shared pool past what the budgets measured)."""
        if self.config.recurring_graphs <= 0 or (self.use_graphs and self.device.type == "cuda" and self._pool is None):
            return False  # off, or the budgets' graphs not captured yet
        if sum(s.input_patches for s in specs) > self.ladder[-1] * self.encoder.merge_unit:
            return False
        seen = self._sightings.pop(key, 0)
        if seen >= 0:
            seen += 1
        self._sightings[key] = seen
        while len(self._sightings) > SIGHTINGS_KEPT:
            self._sightings.popitem(last=False)
        return seen >= self.config.recurring_after

    def _reject_recurring(self, key: PackKey, why: str, detail: str = "") -> None:
        self._sightings[key] = -1
        self.stats.recurring_rejected[why] += 1
        logger.info("no graph for a recurring pack of %d items: %s %s", len(key), why, detail)

    def _capture_recurring(
        self,
        key: PackKey,
        pixel_values: torch.Tensor,
        specs: Sequence[ItemSpec],
        plan_ms: float,
        output_device: torch.device,
    ) -> None:
        """Capture (CUDA) or set up (CPU) the pack's own exact-layout graph. Refused, and the key
        never tried again: too little free memory, a capture error, a result that disagrees with
        its own warm-up run, or (where costs are measured: graphs on) a run no faster than
        `plan_ms`, the plan's time on this pack, timed the same way (copy in, replay, copy out).
        Where the compiled forward would need a compile, the uncompiled forward is captured.

        Its inputs are its own plain tensors, as the compiled exact route's are (dynamo guards on
        whether an input is a view: views of the shared buffers would miss that compile)."""
        capture = self._pool is not None  # as the budgets' graphs were (CUDA, `cuda_graphs`)
        if capture and torch.cuda.mem_get_info(self.device)[0] < RECURRING_MIN_FREE:
            self._reject_recurring(key, "memory")
            return
        layout = self.encoder.exact_layout(specs)
        tokens = layout.token_budget
        with torch.inference_mode(False):  # not inference tensors, whatever the caller's mode
            inputs = {
                name: torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)
                for name, spec in self._input_specs(layout).items()
            }
        entry = GraphEntry(
            (tokens, layout.max_seqlen),
            layout,
            inputs,
            self._outputs.views(self._output_specs(layout)),
            segments=tuple(segment_lengths(specs)),
            pack=key,
        )
        self._fill(entry, pixel_values, self.encoder.pack_metadata(specs, layout))
        pool_before = pool_reserved_bytes(self._pool, self.device) if capture else 0
        try:
            # The warm-up picks the attention kernels its capture will (`attention.for_graph`), so
            # it builds them (cuDNN's dense plans) outside capture.
            with attention.for_graph():
                expected = self._warm_recurring(entry)
                self.costs.mark_run(attention_shapes(specs))  # its attention is built now
                if capture:
                    graph = torch.cuda.CUDAGraph()
                    with self._recurring_stance(entry):
                        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                            self._forward_into_outputs(entry)
                    entry.graph = graph
            self._execute(entry)
            error = max(relative_error(entry.outputs[name], want) for name, want in expected.items())
        except Exception as exc:  # an optimisation: the pack still runs by its plan
            self._reject_recurring(key, "error", f"{type(exc).__name__}: {exc}")
            self._synchronize()
            return
        if not math.isfinite(error) or error > self.config.self_check_tolerance:
            self._reject_recurring(key, "mismatch", f"{error:.3g} against its warm-up run")
            return
        if self.use_graphs:

            def run_own() -> None:
                self._fill(entry, pixel_values, None)
                self._execute(entry)
                self._take(entry, tokens, output_device)

            entry.replay_ms = time_ms(run_own, self.device, repeats=3, warmup=0)
            if entry.replay_ms >= plan_ms:
                self._reject_recurring(key, "slower", f"{entry.replay_ms:.2f} ms >= {plan_ms:.2f} ms by its plan")
                return
        if capture:
            grown = pool_reserved_bytes(self._pool, self.device) - pool_before
            self.memory.recurring_bytes += sum(t.numel() * t.element_size() for t in inputs.values()) + grown
        self._recurring[key] = entry
        self.stats.recurring_captured += 1
        while len(self._recurring) > self.config.recurring_graphs:
            self._recurring.popitem(last=False)
            self.stats.recurring_evicted += 1

    def _recurring_stance(self, entry: GraphEntry):
        """No compile on a request: the compiled forward raises where it would need one."""
        if self._compiled and entry.forward is self._forward:
            return torch.compiler.set_stance("fail_on_recompile")
        return contextlib.nullcontext()

    def _warm_recurring(self, entry: GraphEntry) -> dict[str, torch.Tensor]:
        """Run the entry once outside capture (kernel selection, workspaces; on a side stream on
        CUDA) with the compiled forward, or the uncompiled one where that would need a compile.
        Returns copies of its outputs: what its graph must reproduce."""
        forwards = [self._forward, self.encoder.forward_padded] if self._compiled else [self.encoder.forward_padded]
        for forward in forwards:
            entry.forward = forward
            try:
                if self._side is not None:
                    side = self._side
                    side.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(side), self._recurring_stance(entry):
                        self._forward_into_outputs(entry)
                    torch.cuda.current_stream(self.device).wait_stream(side)
                else:
                    self._forward_into_outputs(entry)
                break
            except RuntimeError as error:
                if "fail_on_recompile" not in str(error):
                    raise
                self.stats.recurring_uncompiled += 1
        return {name: tensor.clone() for name, tensor in entry.outputs.items()}
