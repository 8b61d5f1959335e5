"""Regional compilation: the tower's repeated layer compiled once, serving every layer.

`torch.compile` of the whole padded forward traces all of a tower's layers (27 in Qwen3-VL-8B)
and compiles one graph of all of them, again for the exact route; a layer is one function of
its module and inputs, so compiling that function once serves every layer (PyTorch's regional
compilation recipe). A `Region` is such a function: it runs compiled only on a thread inside
`compiled_regions()`, so the encoder's own forward stays the uncompiled reference that the
runner checks graphs against, while another thread compiles or replays.

Ahead-of-time compiled regions, whose variants a later start loads without tracing: `precompiled.py`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

_state = threading.local()


@contextmanager
def compiled_regions() -> Iterator[None]:
    """On this thread, until the end of the block, every compiled `Region` runs compiled."""
    previous = getattr(_state, "active", False)
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous


class Region:
    """One layer's function (its module among the arguments), with a compiled variant that
    `compiled_regions()` switches on for the calling thread."""

    def __init__(self, function: Callable[..., Any]):
        self.function = function
        self.compiled: Callable[..., Any] | None = None

    def compile(self, compile: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        self.compiled = compile(self.function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is not None and getattr(_state, "active", False):
            return self.compiled(*args, **kwargs)
        return self.function(*args, **kwargs)


def module_region(modules: Sequence[torch.nn.Module]) -> Region:
    """One region for modules of one class called by code we do not own (transformers' loops):
    each module's `forward` is routed through it, the module its first argument."""
    classes = {type(module) for module in modules}
    if len(classes) != 1:
        raise ValueError(f"a region's modules share one class, not {sorted(c.__name__ for c in classes)}")
    region = Region(classes.pop().forward)
    for module in modules:
        module.forward = functools.partial(region, module)
    return region


def region_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` run with this thread's regions compiled: the runner's compiled padded forward."""

    def compiled_forward(*args: Any, **kwargs: Any) -> Any:
        with compiled_regions():
            return forward(*args, **kwargs)

    compiled_forward.__name__ = f"compiled_{getattr(forward, '__name__', 'forward')}"
    return compiled_forward
