"""Static buffers shared by every graph of a runner.

One backing tensor per name, sized for the largest layout; each graph reads and writes a
prefix view of it. Views keep the backing storage's address, so a captured graph reads
whatever is copied into its views before replay (static inputs keep their identity).
Graphs replay one at a time, so sharing inputs and outputs between them is safe, provided
the caller copies a replay's outputs out before the next replay.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from models.protocol import TensorSpec


class StaticBuffers:
    def __init__(self, layouts: Iterable[Mapping[str, TensorSpec]], device: torch.device):
        sizes: dict[str, int] = {}
        dtypes: dict[str, torch.dtype] = {}
        for specs in layouts:
            for name, spec in specs.items():
                if dtypes.setdefault(name, spec.dtype) != spec.dtype:
                    raise ValueError(f"buffer {name!r} is {dtypes[name]} in one layout and {spec.dtype} in another")
                sizes[name] = max(sizes.get(name, 0), math.prod(spec.shape))
        self._backing = {name: torch.zeros(size, dtype=dtypes[name], device=device) for name, size in sizes.items()}

    def views(self, specs: Mapping[str, TensorSpec]) -> dict[str, torch.Tensor]:
        """Prefix views with the shapes of `specs`."""
        return {name: self._backing[name][: math.prod(spec.shape)].view(spec.shape) for name, spec in specs.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._backing.values())
