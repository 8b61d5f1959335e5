"""Compile once per cluster: what torch.compile produced, kept in a directory replicas share.

`GraphConfig.compile_cache` names a directory (shared storage on a real cluster). Under it, one
subdirectory per key (`cache_key`: the model and its attention kernel, the graph layouts and
dynamic-shape setting, torch, Triton, CUDA and the GPU) holds:

- `artifacts.bin`: PyTorch's portable "mega-cache" (`torch.compiler.save_cache_artifacts`):
  inductor's compiled graphs with their Triton kernels, AOTAutograd's entries and autotuning
  results. Loaded (`torch.compiler.load_cache_artifacts`) before the first compile, it turns
  every compile of a `dynamic=True` forward that matches into a cache hit: dynamo still traces,
  inductor and Triton do not run. Saved at the end of the warm-up when this process compiled
  something the file lacked.
- `warmup-<fingerprint>.json`: the warm-up record (`warmup_record.py`): each graph's check and
  replay time, one file per code version and check settings.
- `triton/`: `TRITON_CACHE_DIR` (unless already set) for the Triton kernels launched inside our
  opaque custom ops (the varlen attention kernel), which inductor's artifacts do not cover.

Writes are safe for concurrent replicas: the artifacts go to a temporary file renamed over the
old one (`os.replace` is atomic), and Triton writes its own cache the same way.

Pre-build the cache for a deployment before scaling it out, on one GPU of the kind that will
serve (the key includes the GPU): `python -m deployments.compile_cache --config configs/gpu.yaml`
(with `graphs.compile: true` and `graphs.compile_cache` set in that config's args).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ARTIFACTS = "artifacts.bin"


def environment(device: torch.device) -> dict[str, str]:
    """What compiled code depends on outside the model: torch, Triton, CUDA, Python, the GPU."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - not installed (CPU-only torch)
        triton_version = "none"
    found = {
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
        "device": device.type,
    }
    if device.type == "cuda":
        found["gpu"] = torch.cuda.get_device_name(device)
        found["capability"] = "{}.{}".format(*torch.cuda.get_device_capability(device))
    return found


def cache_key(identity: Mapping[str, object], layouts: Mapping[str, object], env: Mapping[str, object]) -> str:
    """A directory name for compiled artifacts: the model family, then a digest of the model's
    identity (`VisionEncoder.compile_identity`), its graph layouts and the environment. Pure."""
    blob = json.dumps({"model": identity, "layouts": layouts, "environment": env}, sort_keys=True, default=str)
    family = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(identity.get("family", "model")))
    return f"{family}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"


def write_atomically(path: Path, data: bytes) -> bool:
    """Write `path` through a temporary file renamed over it (`os.replace` is atomic), so that
    concurrent replicas never read half a file; False where storage refused (read-only, full:
    logged, and the replica serves on without it)."""
    temporary = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_bytes(data)
        os.replace(temporary, path)
    except OSError as error:
        logger.warning("%s not saved: %s", path, error)
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        return False
    return True


def _misses() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]


class CompileCache:
    """One key's directory under a compile cache root."""

    def __init__(self, root: str | os.PathLike, key: str):
        self.path = Path(root).expanduser() / key
        self._misses_at_load: int | None = None

    @property
    def artifacts(self) -> Path:
        return self.path / ARTIFACTS

    def activate(self) -> None:
        """Point Triton's own cache here (before any Triton kernel compiles), unless the
        environment already chose a directory."""
        if "TRITON_CACHE_DIR" not in os.environ:
            (self.path / "triton").mkdir(parents=True, exist_ok=True)
            os.environ["TRITON_CACHE_DIR"] = str(self.path / "triton")

    def load(self) -> int:
        """Load the saved artifacts into this process's caches; the number loaded (0: none)."""
        self._misses_at_load = _misses()
        if not self.artifacts.is_file():
            return 0
        info = torch.compiler.load_cache_artifacts(self.artifacts.read_bytes())
        if info is None:
            logger.warning("compile cache %s could not be read; compiling anew", self.artifacts)
            return 0
        return sum(len(found) for found in info.artifacts.values())

    def save(self) -> bool:
        """Save this process's artifacts when the file is missing or this process compiled
        something anew since `load`; atomic (temporary file, then rename). False where nothing was
        saved (a storage error is logged)."""
        if self.artifacts.is_file() and self._misses_at_load is not None and _misses() == self._misses_at_load:
            return False
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return False
        if not write_atomically(self.artifacts, saved[0]):
            return False
        logger.info("saved %d bytes of compiled artifacts to %s", len(saved[0]), self.artifacts)
        return True
