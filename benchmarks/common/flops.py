"""Useful FLOPs of a pack (no padding) and the GPU's measured bf16 matmul peak: MFU's numerator and
denominator, one formula for every system a benchmark compares."""

from __future__ import annotations

import torch

from encoder_graphs.selfcheck import back_to_back_ms
from models.protocol import ItemSpec


def measure_peak_tflops(device: torch.device, trials: int = 5) -> float:
    """bf16 matmul TFLOP/s on random 8192^3 operands: the best of `trials` runs of 20 back to
    back. The best, not a median: the denominator of MFU is what the GPU can reach."""
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = min(back_to_back_ms(lambda: a @ b, device, repeats=20) for _ in range(trials))
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def add_mfu(rows: list[dict], peak: float) -> None:
    """Floor and MFU columns of each case against `peak` TFLOP/s."""
    for row in rows:
        flops = row["gflops"] * 1e9
        row["floor_ms"] = flops / (peak * 1e12) * 1e3 if peak == peak else float("nan")
        for path in ("hf", "eager", "graph", "recurring"):
            row[f"mfu_{path}"] = flops / (row[f"{path}_ms"] * 1e-3) / (peak * 1e12)


def useful_flops(encoder, specs: list[ItemSpec]) -> float:
    """Linear-layer FLOPs for the real rows plus block-diagonal attention FLOPs (no padding)."""
    if encoder.family == "internvl":
        return internvl_flops(encoder, specs)
    tower, config = encoder.tower, encoder.tower.config
    rows = sum(s.input_patches for s in specs)
    flops = 0.0
    for name, module in tower.named_modules():
        if isinstance(module, torch.nn.Linear):
            layer_rows = rows if name.startswith("blocks.") else rows // encoder.merge_unit
            flops += 2 * layer_rows * module.in_features * module.out_features
        elif isinstance(module, torch.nn.Conv3d):
            flops += 2 * rows * module.weight[0].numel() * module.out_channels
    width = getattr(config, "embed_dim", None) or config.hidden_size
    full = sum(s.grid_thw[0] * s.frame_patches**2 for s in specs)
    depth = config.depth
    full_layers = depth
    window = 0.0
    if hasattr(config, "fullatt_block_indexes"):
        full_layers = len(config.fullatt_block_indexes)
        for spec in specs:
            window += sum(length**2 for length in encoder.window_lengths(spec))
    flops += 4 * width * (full * full_layers + window * (depth - full_layers))
    return flops


def internvl_flops(encoder, specs: list[ItemSpec]) -> float:
    """InternViT over each tile's patches and class token (full attention within a tile), then
    the projector over the tokens left after pixel shuffle."""
    vision = encoder.tower.config.vision_config
    tiles = sum(s.segments for s in specs)
    patches = sum(s.input_patches for s in specs)
    rows = patches + tiles  # a class token per tile
    tile_rows = rows // tiles if tiles else 0
    flops = 0.0
    for name, module in encoder.tower.named_modules():
        if isinstance(module, torch.nn.Linear):
            layer_rows = rows if name.startswith("vision_tower.") else patches // encoder.merge_unit
            flops += 2 * layer_rows * module.in_features * module.out_features
        elif isinstance(module, torch.nn.Conv2d):
            flops += 2 * patches * module.weight[0].numel() * module.out_channels
    flops += 4 * vision.hidden_size * tiles * tile_rows**2 * vision.num_hidden_layers
    return flops
