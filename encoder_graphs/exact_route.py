"""The compiled exact-layout route (`ExactRoute`): packs without a graph run through the compiled
forward on their exact layout, warmed and checked at startup."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence

import torch

from models import attention
from models.protocol import EncoderOutput, ItemSpec

from .entry import GraphEntry
from .route_costs import attention_shapes
from .selfcheck import relative_error, synthetic_pixels, time_ms

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def compile_state():
    """The global state every compiled call runs in (budget graphs' capture, the exact route, a
    recurring pack's graph), whatever the caller's; probes that call the compiled forward
    themselves enter it too. Dynamo guards on global state such as grad mode: the deployment's
    worker thread runs with grad on, the benchmark under `inference_mode` (grad off); either
    would miss a compile made in the other state. Not inference mode itself: compiling views
    under it fails on torch 2.11 (see `forward_padded`)."""
    with torch.inference_mode(False), torch.no_grad():
        yield


class ExactRoute:
    """`EncoderRunner`'s compiled exact-layout route (a mixin). Relies on the runner's `encoder`,
    `config`, `device`, `ladder`, `stats`, `use_graphs`, `costs` (`RouteCosts`), `_forward` (the
    compiled forward) and sets its `_exact_compiled` and `_exact_min_rows`."""

    def _warm_exact(self, progress: Callable[[str], None]) -> None:
        """Compile the forward for exact layouts now, not on a request: attention runs dense
        batches through the grouped op, which the padded graphs never do. One segment and
        several are compiled apart (Qwen3-VL's position interpolation specialises one image);
        several equal segments serve unequal ones too (the lengths are never traced).

        The packs are a quarter of the largest budget: the exact route serves large packs, and
        each Triton kernel is autotuned on the shapes of its first run."""
        start = time.perf_counter()
        unit = self.encoder.merge_unit
        merge = math.isqrt(unit)
        rows = self.ladder[-1] * unit // 4

        def image(height: int, width: int) -> ItemSpec:
            height, width = max(merge, height // merge * merge), max(merge, width // merge * merge)
            return ItemSpec("image", (1, height, width), height * width, height * width // unit)

        one, half = math.isqrt(rows), math.isqrt(rows // 2)
        warm = ([image(one, one)], [image(half, half)] * 2)
        for specs in warm:
            pixels = synthetic_pixels(specs, self.encoder.patch_dim, self.device)
            with compile_state():
                self.encoder.forward_eager(pixels.to(self.encoder.dtype), specs, forward=self._forward)
        torch.cuda.synchronize(self.device)
        self._exact_min_rows = min(sum(s.input_patches for s in specs) for specs in warm)
        self._exact_compiled = True
        progress(f"compiled the exact-layout forward in {time.perf_counter() - start:.1f} s")

    def _compiles_exact(self, specs: Sequence[ItemSpec]) -> bool:
        """Whether the compiled exact route takes this pack: no smaller than the smallest pack its
        compile was seen to hold for, and one attention launch per layer: equal segments (one
        dense batch), or any segments under backend "triton" (its kernel over all of them,
        `attention.exact_in_one_call`). Outside a CUDA graph this route pays host time for every
        launch: a mixed pack's several dense calls per layer (cuDNN, FlashAttention-2) made it
        26-40 ms against its padded graph's ~28 ms from host to host (~130-320 us per dense call,
        `launch_probe.json`), which its cost measured on equal packs does not price; there mixed
        packs get grouped attention in their own recurring graph, where host time is not paid.
        With one Triton launch per layer the mixed pack ran 22.2-22.9 ms against 21.0 for its
        own graph and 24.4 for its first sighting's padded graphs."""
        return (
            self._exact_compiled
            and (len({s.frame_patches for s in specs}) == 1 or attention.exact_in_one_call())
            and sum(s.input_patches for s in specs) >= self._exact_min_rows
        )

    def _compiled_exact(self, pixel_values: torch.Tensor, specs: Sequence[ItemSpec]) -> EncoderOutput | None:
        """The compiled forward on the pack's exact layout; None where that would need a compile
        (seconds, on the request path): dynamo raises instead of compiling."""
        try:
            with compile_state(), torch.compiler.set_stance("fail_on_recompile"):
                # One copy at most: a caller's inference tensor (from its inference_mode) cannot
                # enter the compiled forward, and another dtype would recompile.
                pixel_values = pixel_values.to(self.encoder.dtype, copy=pixel_values.is_inference())
                return self.encoder.forward_eager(pixel_values, specs, forward=self._forward)
        except RuntimeError as error:
            if "fail_on_recompile" not in str(error):
                raise
            logger.debug("exact-layout pack of %d items would recompile: %s", len(specs), error)
            return None

    def _forward_exact(self, pixel_values: torch.Tensor, specs: Sequence[ItemSpec]) -> tuple[EncoderOutput, bool, bool]:
        """The pack on its exact layout: (output, whether the compiled forward ran it, whether it
        fell back because the compiled forward would have needed a compile; counted, warned once)."""
        fell_back = False
        if self._compiles_exact(specs):
            out = self._compiled_exact(pixel_values, specs)
            if out is not None:
                return out, True, False
            fell_back = True
            self.stats.recompile_fallbacks += 1
            if self.stats.recompile_fallbacks == 1:
                logger.warning("exact-layout pack of %d items would recompile; ran uncompiled", len(specs))
        return self.encoder.forward_eager(pixel_values, specs), False, fell_back

    def _check_exact(
        self, entry: GraphEntry, pixels: torch.Tensor, specs: Sequence[ItemSpec], eager: EncoderOutput
    ) -> None:
        """The compiled exact-layout forward on the self-check pack's equal items: compared with
        eager (a wrong or non-finite result turns the route off, as a wrong graph is disabled),
        then timed into `entry.exact_ms`, scaled to the full budget. Where that forward would need
        a compile it is left unmeasured (NaN: not offered by cost); where it holds, it lowers the
        smallest size the route is offered for. Qwen2.5-VL's compile holds only from ~3420 rows
        up (inductor's matmul padding guards on the size)."""
        equal = [s for s in specs if s == specs[0]]
        rows, tokens = sum(s.input_patches for s in equal), sum(s.output_tokens for s in equal)
        out = self._compiled_exact(pixels[:rows], equal)
        if out is None:
            return
        self.costs.mark_run(attention_shapes(equal))
        self._exact_min_rows = min(self._exact_min_rows, rows)
        error = relative_error(out.tokens, eager.tokens[:tokens])
        if eager.deepstack is not None:
            error = max(error, relative_error(out.deepstack, eager.deepstack[:, :tokens]))
        if not math.isfinite(error) or error > self.config.self_check_tolerance:
            self._exact_compiled = False
            logger.warning(
                "compiled exact-layout route turned off: self-check error %.3g > %s at %d rows",
                error,
                self.config.self_check_tolerance,
                rows,
            )
            return
        if self.use_graphs:
            # No warm-up: the check above just ran it.
            ms = time_ms(lambda: self._compiled_exact(pixels[:rows], equal), self.device, repeats=3, warmup=0)
            entry.exact_ms = ms * entry.key[0] / tokens
