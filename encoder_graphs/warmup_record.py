"""Check once per cluster: what a warm-up checked and timed (each graph's check and replay time, the
startup cost curves, the exact route's verdict), kept beside the compiled artifacts of the same key
(`compile_cache.py`), so that a later replica or restart captures its graphs without checking and
timing each one again. The record also names the code and tolerance it was made with; a record of
other code is not used. Every graph is still checked on the first real pack it serves."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .entry import GraphKey

logger = logging.getLogger(__name__)

RECORD = "warmup.json"
VERSION = 1
PACKAGES = ("encoder_graphs", "models")
"""The packages whose sources a record's checks depend on (the forwards, the capture, the check)."""


def code_digest(roots: Iterable[Path] | None = None) -> str:
    """A digest of the Python sources of `PACKAGES` (default: the installed ones): a record made by
    other code is not trusted."""
    if roots is None:
        here = Path(__file__).resolve().parent
        roots = [here.parent / name for name in PACKAGES]
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            digest.update(path.relative_to(Path(root).parent).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


@dataclass(frozen=True)
class WarmupRecord:
    """What one warm-up found, every graph of its table checked (pure data)."""

    graphs: dict[GraphKey, float | None]
    """Each graph's replay ms (NaN: not timed, no CUDA graphs); None: refused (its check failed)."""
    costs: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    """The startup cost curves (`RouteCosts.startup`)."""
    exact_min_rows: int | None = None
    """The exact route's smallest pack (rows) where it passed its check; None: refused or not built."""
    code: str = ""
    tolerance: float = math.nan

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": VERSION,
                "code": self.code,
                "tolerance": self.tolerance,
                "graphs": [[budget, seqlen, ms] for (budget, seqlen), ms in sorted(self.graphs.items())],
                "costs": {route: [list(point) for point in points] for route, points in sorted(self.costs.items())},
                "exact_min_rows": self.exact_min_rows,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> WarmupRecord:
        """Raises ValueError (or KeyError, TypeError) on a record this version cannot read."""
        blob = json.loads(text)
        if blob.get("version") != VERSION:
            raise ValueError(f"record version {blob.get('version')!r}, expected {VERSION}")
        graphs = {(int(b), int(s)): (None if ms is None else float(ms)) for b, s, ms in blob["graphs"]}
        costs = {str(r): tuple((int(t), float(ms)) for t, ms in points) for r, points in blob["costs"].items()}
        rows = blob["exact_min_rows"]
        return cls(graphs, costs, None if rows is None else int(rows), str(blob["code"]), float(blob["tolerance"]))

    def matches(self, keys: Iterable[GraphKey], code: str, tolerance: float) -> bool:
        """Whether it was made for this table, this code and this check tolerance."""
        return set(self.graphs) == set(keys) and self.code == code and self.tolerance == tolerance


def load(directory: Path, keys: Iterable[GraphKey], code: str, tolerance: float) -> WarmupRecord | None:
    """The record in `directory` if there is one made for these graphs, code and tolerance."""
    path = Path(directory) / RECORD
    if not path.is_file():
        return None
    try:
        record = WarmupRecord.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("warm-up record %s could not be read (%s); every graph is checked", path, error)
        return None
    if not record.matches(keys, code, tolerance):
        logger.info("warm-up record %s is for other graphs, code or tolerance; every graph is checked", path)
        return None
    return record


def save(directory: Path, record: WarmupRecord) -> Path:
    """Write `record` atomically (a temporary file renamed over the old one)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f".{RECORD}.{os.getpid()}.{uuid.uuid4().hex}"
    temporary.write_text(record.to_json())
    os.replace(temporary, directory / RECORD)
    return directory / RECORD


def graph_times(entries: Mapping[GraphKey, object]) -> dict[GraphKey, float | None]:
    """Each entry's replay ms, None where it was refused (for a record)."""
    return {key: (entry.replay_ms if entry.enabled else None) for key, entry in entries.items()}
