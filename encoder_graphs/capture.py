"""Capturing CUDA graphs into one shared memory pool (`GraphCapture`), and what each capture took.

Graphs replay one at a time, so they share one pool: a capture reuses memory that earlier
captures freed. The largest graph is captured first: its allocator segments are then split for
every smaller graph's intermediates, where smaller-first would leave each larger capture
allocating new segments and the pool growing with every step of the ladder.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .entry import GraphEntry
from .memory import MemoryReport, pool_reserved_bytes

LOW_FREE = 0.1
"""Below this share of the device's memory free, the cache is emptied before a capture (which
waits for the device): otherwise captures start at once, overlapping the previous graph's check."""


class GraphCapture:
    """The shared graph pool of one device and the side stream warm-up runs use."""

    def __init__(self, device: torch.device, memory: MemoryReport):
        self.device = device
        self.memory = memory
        self.pool = None
        self._side: torch.cuda.Stream | None = None
        self._capture_stream: torch.cuda.Stream | None = None

    @property
    def started(self) -> bool:
        """Whether the pool exists (a graph was captured into it, or is about to be)."""
        return self.pool is not None

    def _ensure_pool(self) -> None:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self._side = torch.cuda.Stream(self.device)
            self._capture_stream = torch.cuda.Stream(self.device)

    def warm(self, run: Callable[[], None]) -> None:
        """`run` once on a side stream (kernel selection, plans, workspaces): what PyTorch asks
        before a capture, so lazy initialisation never happens inside one. The device cache is
        emptied after it, as `torch.cuda.graph` does before a capture: the one that follows is the
        first into the pool (which it sizes) or one tried again (which may have failed for memory),
        and while a capture is underway the allocator cannot give cached blocks back."""
        self._ensure_pool()
        current = torch.cuda.current_stream(self.device)
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side):
            run()
        current.wait_stream(self._side)
        torch.cuda.empty_cache()

    def capture(self, entry: GraphEntry, run: Callable[[], None]) -> int:
        """Capture `run` as `entry`'s graph into the shared pool; returns how much the pool grew.
        `capture_error_mode="thread_local"`: another thread's CUDA calls do not invalidate it
        (the runner's device lock keeps them out of the capture anyway). Work launched before it
        may still be running: a capture records, it runs nothing."""
        self._ensure_pool()
        free, total = torch.cuda.mem_get_info(self.device)
        if free < LOW_FREE * total:  # a capture cannot give cached blocks back if it runs short
            torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        # `CUDAGraph.capture_begin` on a side stream, as `torch.cuda.graph` does, but without what
        # that does before each capture: a device-wide synchronize (which would wait for the
        # previous graph's checked run) and emptying the device and host caches (which the next
        # packs and copies would allocate again).
        # Ordered after the work already launched (on the GPU only: the host goes on), so the
        # capture's own setup (the RNG state it fills) never meets a replay still running.
        self._capture_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._capture_stream):
            graph.capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                run()
            finally:
                graph.capture_end()
        entry.graph = graph
        # Nothing else allocates meanwhile (the device lock), and the cache is not emptied, so
        # the growth of what the allocator reserved is the pool's, without an allocator snapshot.
        return max(0, torch.cuda.memory_reserved(self.device) - before)

    def pool_bytes(self) -> int:
        return pool_reserved_bytes(self.pool, self.device) if self.pool is not None else 0
