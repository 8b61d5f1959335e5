"""The compiled exact-layout route (`ExactRoute`): packs without a graph run through the compiled
forward on their exact layout once the warm-up compiled and checked it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from models.protocol import EncoderOutput, ItemSpec, VisionEncoder

from .execute import Forwards, compile_state, would_compile
from .selfcheck import synthetic_pixels
from .stats import RunnerStats

logger = logging.getLogger(__name__)


class ExactRoute:
    """The compiled forward on exact layouts: off until `compile` (warm-up) and the checks pass."""

    def __init__(self, encoder: VisionEncoder, forwards: Forwards, stats: RunnerStats):
        self.encoder = encoder
        self.forwards = forwards
        self.stats = stats
        self.live = False
        """Whether packs may take the route (set by the warm-up once compiled and checked)."""
        self.min_rows = 0
        """Smallest pack (input rows) the compile was seen to hold for: smaller ones keep their
        graphs (a compile may guard on sizes, e.g. inductor's matmul padding)."""

    def takes(self, specs: Sequence[ItemSpec]) -> bool:
        """Whether the route serves this pack: live, at least `min_rows`, and one attention launch
        per layer (several dense calls per layer would be host time its measured cost misses)."""
        return (
            self.live and sum(s.input_patches for s in specs) >= self.min_rows and self.encoder.exact_in_one_call(specs)
        )

    def compile(self, largest_rows: int, progress: Callable[[str], None]) -> None:
        """Compile the forward for exact layouts (warm-up thread): one segment and several equal
        ones (a family may specialise one image), a quarter of the largest budget's rows each (the
        route serves large packs; autotuned kernels tune on their first shapes)."""
        start = time.perf_counter()
        rows = largest_rows // 4
        half = self.encoder.synthetic_item(rows // 2)
        warm = ([self.encoder.synthetic_item(rows)], [half, half])
        for specs in warm:
            pixels = synthetic_pixels(specs, self.encoder.patch_dim, self.encoder.device)
            with compile_state():
                self.encoder.forward_eager(pixels.to(self.encoder.dtype), specs, forward=self.forwards.compiled)
        if self.encoder.device.type == "cuda":
            torch.cuda.synchronize(self.encoder.device)
        self.min_rows = min(sum(s.input_patches for s in specs) for specs in warm)
        progress(f"compiled the exact-layout forward in {time.perf_counter() - start:.1f} s")

    def run_compiled(self, pixel_values: torch.Tensor, specs: Sequence[ItemSpec]) -> EncoderOutput | None:
        """The compiled forward on the pack's exact layout; None where that would need a compile
        (seconds): dynamo raises instead of compiling."""
        try:
            with compile_state(), torch.compiler.set_stance("fail_on_recompile"):
                # One copy at most: a caller's inference tensor cannot enter the compiled forward,
                # and another dtype would recompile.
                pixel_values = pixel_values.to(self.encoder.dtype, copy=pixel_values.is_inference())
                return self.encoder.forward_eager(pixel_values, specs, forward=self.forwards.compiled)
        except RuntimeError as error:
            if not would_compile(error):
                raise
            logger.debug("exact-layout pack of %d items would recompile: %s", len(specs), error)
            return None

    def forward(self, pixel_values: torch.Tensor, specs: Sequence[ItemSpec]) -> tuple[EncoderOutput, bool, bool]:
        """The pack on its exact layout: (output, whether the compiled forward ran it, whether it
        fell back because the compiled forward would have needed a compile; counted, warned once)."""
        fell_back = False
        if self.takes(specs):
            out = self.run_compiled(pixel_values, specs)
            if out is not None:
                return out, True, False
            fell_back = True
            self.stats.recompile_fallbacks += 1
            if self.stats.recompile_fallbacks == 1:
                logger.warning("exact-layout pack of %d items would recompile; ran uncompiled", len(specs))
        return self.encoder.forward_eager(pixel_values, specs), False, fell_back
