"""Saving results: one JSON per system, rewritten after every point with the host's environment
first, so that a run stopped early keeps what it measured."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.common.environment import environment


class Record(dict):
    """One system's results, written to `<out>/<prefix>_<system>.json` after every point: a run
    stopped early (a time limit, a crash) keeps what it measured, marked `"complete": false`."""

    def __init__(self, out: Path, system: str, config: Path, prefix: str = "e2e"):
        super().__init__(environment=environment(), config=str(config), complete=False)
        self.path = out / f"{prefix}_{system}.json"

    def save(self) -> None:
        partial = self.path.with_suffix(".json.partial")  # a kill mid-write leaves the last whole file
        partial.write_text(json.dumps(self, indent=1))
        os.replace(partial, self.path)


class Discard(dict):
    """A record that keeps nothing (a load that is not measured)."""

    def save(self) -> None:
        pass


def load_runs(out: Path) -> dict:
    """Every system's saved record in `out`, by system name."""
    return {p.stem.removeprefix("e2e_"): json.loads(p.read_text()) for p in sorted(out.glob("e2e_*.json"))}
