"""Check once per cluster: what a warm-up checked and timed (each graph's check and replay time, the
startup cost curves, the exact route's verdict), kept beside the compiled artifacts of the same key
(`compile_cache.py`), so that a later replica or restart captures its graphs without checking and
timing each one again. A record is named by a fingerprint of the code and settings it was made
with; another fingerprint's is not used. Every graph is still checked on the first real pack it
serves, and a mismatch there removes the record.

A record steers what goes live unchecked, so it is signed like the artifacts beside it
(`CompileCache.read`): one not signed with our key, or one that does not read back whole with
every value in range, is ignored (one warning) and the warm-up checks every graph."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .compile_cache import CompileCache
from .entry import GraphKey

logger = logging.getLogger(__name__)

VERSION = 2
PACKAGES = ("encoder_graphs", "models")
"""The packages whose sources a record's checks depend on (the forwards, the capture, the check)."""


def record_name(fingerprint: str) -> str:
    """One file per fingerprint: replicas of two code versions (a rolling upgrade) keep their own.
    A fingerprint is hex (`fingerprint`): nothing else names a file."""
    if not fingerprint or not all(c in "0123456789abcdef" for c in fingerprint):
        raise ValueError(f"a fingerprint is hex digits, got {fingerprint!r}")
    return f"warmup-{fingerprint}.json"


def fingerprint(settings: Mapping[str, object], roots: Iterable[Path] | None = None) -> str | None:
    """A digest of the Python sources of `PACKAGES` (default: the installed ones) and of `settings`
    (what else the checks depend on besides the compile cache key: the tolerance, whether the
    forward is compiled). None where no source is found (installed without sources): a record is then neither
    used nor written."""
    if roots is None:
        here = Path(__file__).resolve().parent
        roots = [here.parent / name for name in PACKAGES]
    digest = hashlib.sha256(json.dumps(dict(settings), sort_keys=True, default=str).encode())
    found = 0
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            digest.update(path.relative_to(Path(root).parent).as_posix().encode())
            digest.update(path.read_bytes())
            found += 1
    return digest.hexdigest()[:20] if found else None


def _count(value: object, what: str, least: int) -> int:
    """`value` where it is an int (not a bool) >= `least`; raises ValueError naming `what`."""
    if type(value) is not int or value < least:
        raise ValueError(f"{what} must be an integer >= {least}, got {value!r}")
    return value


def _ms(value: object, what: str) -> float:
    """`value` where it is a finite, non-negative number of milliseconds; raises ValueError."""
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number of ms >= 0, got {value!r}")
    return float(value)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a record holds")


@dataclass(frozen=True)
class WarmupRecord:
    """What one warm-up found, every graph of its table checked (pure data)."""

    graphs: dict[GraphKey, float | None]
    """Each graph's replay ms (NaN: not timed, no CUDA graphs); None: not live then (its check or
    capture failed, or memory refused it): a start on the record builds and checks it anew."""
    costs: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    """The startup cost curves (`RouteCosts.startup`)."""
    exact_min_rows: int | None = None
    """The exact route's smallest pack (rows) where it passed its checks; None: refused or not built."""
    fingerprint: str = ""

    def to_json(self) -> str:
        """Standard JSON: a graph not timed has `replay_ms` null, one not live `live` false."""
        graphs = [
            {
                "budget": budget,
                "max_seqlen": seqlen,
                "live": ms is not None,
                "replay_ms": ms if ms is not None and math.isfinite(ms) else None,
            }
            for (budget, seqlen), ms in sorted(self.graphs.items())
        ]
        blob = {
            "version": VERSION,
            "fingerprint": self.fingerprint,
            "graphs": graphs,
            "costs": {route: [list(point) for point in points] for route, points in sorted(self.costs.items())},
            "exact_min_rows": self.exact_min_rows,
        }
        return json.dumps(blob, indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> WarmupRecord:
        """The record in `text`, every value checked (types; counts >= 1; times finite and >= 0).
        Raises ValueError, or another exception on a record this version cannot read (a caller
        catches any)."""
        blob = json.loads(text, parse_constant=_refuse_constant)
        if not isinstance(blob, dict) or blob.get("version") != VERSION:
            raise ValueError(f"not a warm-up record of version {VERSION}")
        if not isinstance(blob["fingerprint"], str) or not isinstance(blob["graphs"], list):
            raise ValueError("fingerprint must be a string and graphs a list")
        graphs: dict[GraphKey, float | None] = {}
        for graph in blob["graphs"]:
            if not isinstance(graph, dict) or set(graph) != {"budget", "max_seqlen", "live", "replay_ms"}:
                raise ValueError(f"a graph must be budget, max_seqlen, live and replay_ms, got {graph!r}")
            key = (_count(graph["budget"], "budget", 1), _count(graph["max_seqlen"], "max_seqlen", 1))
            if type(graph["live"]) is not bool or key in graphs:
                raise ValueError(f"graph {key}: live must be true or false, each graph once")
            ms = graph["replay_ms"]
            graphs[key] = None if not graph["live"] else math.nan if ms is None else _ms(ms, f"graph {key} replay")
        if not isinstance(blob["costs"], dict):
            raise ValueError("costs must be an object")
        costs = {}
        for route, points in blob["costs"].items():
            if not isinstance(points, list) or not all(isinstance(p, list) and len(p) == 2 for p in points):
                raise ValueError(f"costs {route!r} must be a list of [tokens, ms]")
            costs[route] = tuple((_count(t, "tokens", 1), _ms(ms, f"costs {route!r}")) for t, ms in points)
        rows = blob["exact_min_rows"]
        return cls(graphs, costs, None if rows is None else _count(rows, "exact_min_rows", 1), blob["fingerprint"])


MAX_RECORD_BYTES = 16 * 2**20
"""A record is a few KiB: a larger file is refused before it is read."""


def load(cache: CompileCache, keys: Iterable[GraphKey], fingerprint: str) -> WarmupRecord | None:
    """The record in `cache` made with `fingerprint` for exactly these graphs, if there is one
    signed with our key (`CompileCache.read`) that reads back whole. Any other (unsigned, altered,
    unreadable, out of range) is ignored, with one warning: every graph is then checked."""
    name = record_name(fingerprint)
    data = cache.read(name, MAX_RECORD_BYTES)
    if data is None:
        return None
    try:
        record = WarmupRecord.from_json(data.decode())
    except Exception as error:  # noqa: BLE001 - whatever a bad record raises (RecursionError too), it is ignored
        logger.warning("warm-up record %s ignored (%s); every graph is checked", cache.path / name, error)
        return None
    if record.fingerprint != fingerprint or set(record.graphs) != set(keys):
        logger.info("warm-up record %s is for other graphs; every graph is checked", cache.path / name)
        return None
    return record


def save(cache: CompileCache, record: WarmupRecord) -> Path | None:
    """Write `record`, signed, atomically; None where it could not be written (logged: the warm-up
    goes on without)."""
    name = record_name(record.fingerprint)
    try:
        text = record.to_json()
    except ValueError as error:  # a time that is not finite: not a record a later start could use
        logger.warning("warm-up record %s not saved: %s", cache.path / name, error)
        return None
    return cache.path / name if cache.write(name, text.encode()) else None


def forget(cache: CompileCache, fingerprint: str) -> None:
    """Remove the record (a graph captured on it failed its first-pack check): the next start checks all."""
    cache.remove(record_name(fingerprint))


def graph_times(entries: Mapping[GraphKey, object]) -> dict[GraphKey, float | None]:
    """Each entry's replay ms, None where it is not live (for a record)."""
    return {key: (entry.replay_ms if entry.live else None) for key, entry in entries.items()}


class RecordKeeper:
    """One runner's warm-up record: loaded at the start of a warm-up where it may be used, saved at
    the end of one that made every check itself, removed when a graph captured on it fails its
    first real pack. `cache` None: no record (no compile cache, or graphs are not checked)."""

    def __init__(self, cache: CompileCache | None, settings: Mapping[str, object], reuse: bool):
        """`settings`: what else a record's checks depend on (`fingerprint`); `reuse` False: no
        record is used or written (`reuse_checks`)."""
        self.cache, self.settings, self.reuse = cache, dict(settings), reuse
        self.record: WarmupRecord | None = None
        """The record this warm-up captures on, if one is used."""

    def _fingerprint(self) -> str | None:
        """What a record must have been made with, besides the compile cache key (model, layouts,
        environment): our code and `settings`."""
        return fingerprint(self.settings)

    def load(self, keys: Iterable[GraphKey]) -> WarmupRecord | None:
        """The record for these graphs, if one may be used and is there (then kept as `record`)."""
        self.record = None
        if not (self.reuse and self.cache is not None):
            return None
        found = self._fingerprint()
        self.record = None if found is None else load(self.cache, keys, found)
        return self.record

    def recorded_ms(self, key: GraphKey) -> float | None:
        """The graph's replay ms from the record (None: no record, or it refused the graph then)."""
        return None if self.record is None else self.record.graphs.get(key)

    def save(
        self, entries: Mapping[GraphKey, object], costs: Mapping[str, tuple[tuple[int, float], ...]], exact_rows
    ) -> None:
        """Record this warm-up's checks and timings for later starts (only where it made them all)."""
        if self.record is not None or self.cache is None:
            return
        found = self._fingerprint() if self.reuse else None
        if found is None:
            return
        saved = save(self.cache, WarmupRecord(graph_times(entries), dict(costs), exact_rows, found))
        if saved is not None:
            logger.info("saved the warm-up record %s", saved)

    def graph_failed(self, key: GraphKey) -> None:
        """A graph captured on the record failed its first-pack check: the record goes, and the
        next start checks every graph again."""
        record = self.record
        if record is not None and record.graphs.get(key) is not None:
            logger.warning("graph %s, captured on the warm-up record, failed its first pack: record removed", key)
            forget(self.cache, record.fingerprint)
