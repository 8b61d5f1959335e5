"""When an encoder replica takes traffic, and where its warm-up's seconds went.

After `prepare` a replica can serve every pack eagerly while its graphs warm up in the background;
that is what a cold replica does (a cold warm-up is tens of seconds of compiles). On a filled
compile cache the warm-up is seconds of loading and capturing: a replica that is routed to then
would warm up while serving, the two sharing its GPU, its CPU and its GIL, and reach full speed
far later than alone. So by default such a replica finishes its warm-up before its constructor
returns, which is when Serve starts routing to it (`warm_up_before_ready`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

WarmBeforeReady = Literal["cached", "always", "never"]

SLOWEST_STEPS = 3
"""Warm-up progress lines named in the summary line, the slowest first."""


def waits_for_warm_up(mode: WarmBeforeReady, filled: bool) -> bool:
    """Whether a replica finishes its warm-up before it takes traffic. "always" / "never" say so;
    "cached": where its compile cache is `filled` (`cache_filled`). Pure."""
    return mode == "always" or (mode == "cached" and filled)


def cache_filled(runner) -> bool:
    """Whether the runner's compile cache directory (its key's) holds an earlier start's files: the
    compiled artifacts where the forward is compiled, else a warm-up record. Their signatures are
    checked when the warm-up loads them; a file refused there makes that warm-up a cold one."""
    cache = runner.compile_cache
    if cache is None:
        return False
    if runner.warmup_status().compiled is not None:
        return cache.artifacts.is_file()
    return any(cache.path.glob("warmup-*.json"))


class WarmupTimeline:
    """The warm-up's progress callback: passes each line on and notes when it came, so that one
    summary line can say which steps took the warm-up's seconds."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.started = time.perf_counter()
        self.lines: list[tuple[float, str]] = []

    def __call__(self, message: str) -> None:
        self.lines.append((time.perf_counter(), message))
        self.log(message)

    def slowest(self, count: int = SLOWEST_STEPS) -> list[tuple[float, str]]:
        """The `count` longest gaps between progress lines, each with the line that ended it (which
        says what was done): (seconds, line), longest first."""
        steps, last = [], self.started
        for at, message in self.lines:
            steps.append((at - last, message))
            last = at
        return sorted(steps, key=lambda step: -step[0])[:count]


def warm_up_line(status, timeline: WarmupTimeline, waited: bool) -> str:
    """One line: where a replica's warm-up seconds went, by stage and by slowest step. `status`:
    the runner's `WarmupStatus` at the end; `waited`: whether the replica held traffic back for it."""
    total = time.perf_counter() - timeline.started
    stages = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in status.stage_seconds.items())
    slowest = "; ".join(f"{seconds:.1f} s to '{message[:100]}'" for seconds, message in timeline.slowest())
    where = "before taking traffic" if waited else "while serving"
    record = ", graphs captured on the warm-up record" if status.from_record else ""
    return (
        f"warm-up seconds ({where}): {total:.1f} s to {status.stage}, {status.graphs_live}/{status.graphs_total} "
        f"graphs live{record}; stages: {stages or 'none'}; slowest steps: {slowest or 'none'}"
    )
