"""Checks before a runner serves (`WarmUp.prepare`): seconds each, synchronous, failing the start.

- the graphs must fit in memory (`check_memory`: `GraphMemoryError` names a budget that fits);
- the eager path, every pack's route until graphs are live, must keep segments apart
  (`check_eager`: two unequal images as one pack against each alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from models.protocol import VisionEncoder

from .memory import check_fits, fit_memory_model, measure_peak_bytes
from .selfcheck import pack_error, synthetic_pixels, synthetic_specs


def check_memory(encoder: VisionEncoder, budgets: Sequence[int], static_bytes: int, fraction: float) -> int:
    """The predicted graph pool (bytes), or `GraphMemoryError`: a line through the peak activations
    of two eager forwards (after one unmeasured one: library workspaces must not enter the line),
    extrapolated to the largest budget."""

    def forward_at(budget: int) -> Callable[[], object]:
        specs = synthetic_specs(encoder, budget, budget * encoder.merge_unit, 1)
        pixels = synthetic_pixels(specs, encoder.patch_dim, encoder.device)
        return lambda: encoder.forward_eager(pixels, specs)

    forward_at(budgets[0])()
    sampled = sorted({budgets[0], budgets[len(budgets) // 2]})
    model = fit_memory_model([(b, measure_peak_bytes(forward_at(b), encoder.device)) for b in sampled])
    free, _ = torch.cuda.mem_get_info(encoder.device)
    return check_fits(model, budgets, static_bytes, free, fraction)


def check_eager(encoder: VisionEncoder, tolerance: float) -> None:
    """Two unequal images as one pack against each alone: the eager path keeps segments apart and
    returns finite values, or `RuntimeError`."""
    patches = max(64, 2 * encoder.min_item_tokens * encoder.merge_unit)
    specs = [encoder.synthetic_item(patches), encoder.synthetic_item(patches // 4)]
    pixels = synthetic_pixels(specs, encoder.patch_dim, encoder.device).to(encoder.dtype)
    with torch.no_grad():
        whole = encoder.forward_eager(pixels, specs)
        row = token = 0
        for spec in specs:
            alone = encoder.forward_eager(pixels[row : row + spec.input_patches], [spec])
            rows = slice(token, token + spec.output_tokens)
            error = pack_error(whole.tokens[rows], None if whole.deepstack is None else whole.deepstack[:, rows], alone)
            if not math.isfinite(error) or error > tolerance:
                raise RuntimeError(
                    f"the eager forward of a two-image pack differs from each image alone (error {error:.3g}); "
                    "the attention backend does not keep segments apart on this device"
                )
            row, token = row + spec.input_patches, token + spec.output_tokens


def raise_recompile_limits(graphs: int) -> None:
    """Each graph's layout may specialise the compiled forward; dynamo's default recompile limit
    (8) would silently leave later graphs uncompiled."""
    import torch._dynamo

    limit = max(torch._dynamo.config.recompile_limit, 2 * graphs + 8)
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4 * limit)
