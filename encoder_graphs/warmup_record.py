"""Check once per cluster: what a warm-up checked and timed (each graph's check and replay time, the
startup cost curves, the exact route's verdict), kept beside the compiled artifacts of the same key
(`compile_cache.py`), so that a later replica or restart captures its graphs without checking and
timing each one again. A record is named by a fingerprint of the code and settings it was made
with; another fingerprint's is not used. Every graph is still checked on the first real pack it
serves, and a mismatch there removes the record."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .compile_cache import write_atomically
from .entry import GraphKey

logger = logging.getLogger(__name__)

VERSION = 1
PACKAGES = ("encoder_graphs", "models")
"""The packages whose sources a record's checks depend on (the forwards, the capture, the check)."""


def record_name(fingerprint: str) -> str:
    """One file per fingerprint: replicas of two code versions (a rolling upgrade) keep their own."""
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
        return json.dumps(
            {
                "version": VERSION,
                "fingerprint": self.fingerprint,
                "graphs": [[budget, seqlen, ms] for (budget, seqlen), ms in sorted(self.graphs.items())],
                "costs": {route: [list(point) for point in points] for route, points in sorted(self.costs.items())},
                "exact_min_rows": self.exact_min_rows,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> WarmupRecord:
        """Raises ValueError (or KeyError, TypeError, AttributeError) on a record this version cannot read."""
        blob = json.loads(text)
        if not isinstance(blob, dict) or blob.get("version") != VERSION:
            raise ValueError(f"not a warm-up record of version {VERSION}")
        graphs = {(int(b), int(s)): (None if ms is None else float(ms)) for b, s, ms in blob["graphs"]}
        costs = {str(r): tuple((int(t), float(ms)) for t, ms in points) for r, points in blob["costs"].items()}
        rows = blob["exact_min_rows"]
        return cls(graphs, costs, None if rows is None else int(rows), str(blob["fingerprint"]))


def load(directory: Path, keys: Iterable[GraphKey], fingerprint: str) -> WarmupRecord | None:
    """The record in `directory` made with `fingerprint` for exactly these graphs, if there is one."""
    path = Path(directory) / record_name(fingerprint)
    if not path.is_file():
        return None
    try:
        record = WarmupRecord.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        logger.warning("warm-up record %s could not be read (%s); every graph is checked", path, error)
        return None
    if record.fingerprint != fingerprint or set(record.graphs) != set(keys):
        logger.info("warm-up record %s is for other graphs; every graph is checked", path)
        return None
    return record


def save(directory: Path, record: WarmupRecord) -> Path | None:
    """Write `record` atomically; None where it could not be written (logged: the warm-up goes on
    without)."""
    path = Path(directory) / record_name(record.fingerprint)
    return path if write_atomically(path, record.to_json().encode()) else None


def forget(directory: Path, fingerprint: str) -> None:
    """Remove the record (a graph captured on it failed its first-pack check): the next start checks all."""
    try:
        (Path(directory) / record_name(fingerprint)).unlink(missing_ok=True)
    except OSError as error:
        logger.warning("warm-up record in %s not removed: %s", directory, error)


def graph_times(entries: Mapping[GraphKey, object]) -> dict[GraphKey, float | None]:
    """Each entry's replay ms, None where it is not live (for a record)."""
    return {key: (entry.replay_ms if entry.live else None) for key, entry in entries.items()}
