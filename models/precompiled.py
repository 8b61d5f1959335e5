"""Precompiled regions: each region of `regions.py` compiled ahead of time, one variant per guard set.

`PrecompiledRegions`, handed to `VisionEncoder.compiled_forward` instead of `torch.compile`, compiles a
region with `torch.compile(...).aot_compile` where dynamo would trace it, so that its variants can be
serialized into the compile cache and a later start loads them without dynamo tracing. Torch only:
`protocol.py` names it for the runner, which must not import model code.
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


class RegionMiss(RuntimeError):
    """A precompiled region met inputs that none of its compiled variants accepts, where it may
    not compile another (serving, or under dynamo's "fail_on_recompile" stance): the caller runs
    the pack uncompiled, as it does where dynamo would recompile."""


def region_name(function: Callable[..., Any]) -> str:
    """A region's name in the compile cache: where its function is defined."""
    return f"{function.__module__}.{function.__qualname__}"


def _stance_forbids_compiling() -> bool:
    """Whether the caller set dynamo's "fail_on_recompile" stance (the device lock, a request)."""
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    return getattr(stance, "stance", None) == "fail_on_recompile"


def _sources_unchanged(variant: Any) -> bool:
    """Whether every source a variant traced (ours and transformers') reads as it did when it was
    compiled: its bytecode would otherwise run the old code."""
    from torch._dynamo.package import _hash_sourcelines

    for source in variant.source_info().inlined_sources:
        module = importlib.import_module(source.module)
        if _hash_sourcelines(module, source.firstlineno, source.lastlineno) != source.checksum:
            return False
    return True


def _closure(function: Callable[..., Any]) -> dict[str, object]:
    """What a region function's closure holds, by name: passed by reference when its variants are
    serialized and loaded, not pickled (a decorator's wrapped function, e.g. transformers'
    checkpointing wrapper of a layer's `forward`, cannot be pickled by its name)."""
    found = {}
    for name, cell in zip(function.__code__.co_freevars, getattr(function, "__closure__", None) or ()):
        try:
            found[f"closure:{name}"] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    return found


class PrecompiledRegion:
    """A region's AOT-compiled variants, one per guard set: a call runs the variant that passed last,
    else the first whose guards pass; none passing, it compiles another while its regions are
    `compiling` and the caller's dynamo stance allows, else raises `RegionMiss`."""

    def __init__(self, regions: PrecompiledRegions, function: Callable[..., Any]):
        self.regions = regions
        self.function = function
        self.name = region_name(function)
        self.variants: list[Any] = []
        self.blobs: list[bytes | None] = []
        """Each variant's serialized bytes where it was loaded (None: compiled here, serialized on save)."""
        self._last = 0
        self.closure = _closure(function)

    def __reduce__(self):
        # Dynamo's guard-state pickler keeps a module's callable attributes: a module's `forward`
        # is `partial(region, module)`, whose `Region` holds this object and its variants' guard
        # managers (unpicklable). No guard reads it: a placeholder is pickled instead.
        return (str, (f"precompiled region {self.name}",))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        variants = self.variants
        for offset in range(len(variants)):
            index = (self._last + offset) % len(variants)
            if variants[index].guard_check(*args, **kwargs):
                self._last = index
                return variants[index].fn(*args, **kwargs)
        if not self.regions.compiling or _stance_forbids_compiling():
            raise RegionMiss(
                f"region {self.name}: none of its {len(variants)} precompiled variants accepts these inputs, "
                "and it may not compile one now"
            )
        with torch._dynamo.config.patch(enable_aot_compile=True, specialize_float=True):
            # specialize_float: AOT compiles do not restart analysis on a float they would tensorify
            # (the plain compile does); enable_aot_compile: read by torch.compile (off before torch 2.13).
            compiled = torch.compile(self.function, backend=self.regions.backend, fullgraph=True, dynamic=True)
            variant = compiled.aot_compile((args, kwargs))
        variants.append(variant)
        self.blobs.append(None)
        self._last = len(variants) - 1
        return variant.fn(*args, **kwargs)


class PrecompiledRegions:
    """The `compile` that `VisionEncoder.compiled_forward` takes to precompile its regions
    (`models.protocol.PrecompiledRegions`): one `PrecompiledRegion` per region function."""

    def __init__(self, backend: str = "inductor"):
        self.backend = backend
        self.compiling = False
        self.regions: dict[str, PrecompiledRegion] = {}

    def __call__(self, function: Callable[..., Any]) -> PrecompiledRegion:
        name = region_name(function)
        if name not in self.regions:
            self.regions[name] = PrecompiledRegion(self, function)
        return self.regions[name]

    @property
    def new(self) -> bool:
        return any(blob is None for region in self.regions.values() for blob in region.blobs)

    def load(self, blobs: Mapping[str, Sequence[bytes]]) -> int:
        loaded: dict[str, list[tuple[Any, bytes]]] = {}
        for name, found in blobs.items():
            region = self.regions.get(name)
            if region is None:
                continue
            for blob in found:
                variant = torch.compiler.load_compiled_function(
                    io.BytesIO(blob), f_globals=region.function.__globals__, external_data=region.closure
                )
                if not _sources_unchanged(variant):
                    raise ValueError(f"region {name}: a saved variant traced sources that changed since")
                loaded.setdefault(name, []).append((variant, blob))
        for name, pairs in loaded.items():
            region = self.regions[name]
            region.variants = [variant for variant, _ in pairs]
            region.blobs = [blob for _, blob in pairs]
            region._last = 0
        return sum(len(pairs) for pairs in loaded.values())

    def serialized(self) -> dict[str, list[bytes]]:
        from torch._dynamo.aot_compile import AOTCompiledFunction

        found = {}
        for name, region in self.regions.items():
            region.blobs = [
                blob if blob is not None else AOTCompiledFunction.serialize(variant, region.closure).serialized_data
                for variant, blob in zip(region.variants, region.blobs)
            ]
            if region.blobs:
                found[name] = list(region.blobs)
        return found
