"""Compile once per cluster: what torch.compile produced, kept in a directory replicas share.

`GraphConfig.compile_cache` names a directory (shared storage on a real cluster). Under it, one
subdirectory per signing key (`cache_trust.Signer.key_id`), and under that one per cache key
(`cache_key`: the model and its attention kernel, the graph layouts and dynamic-shape setting,
torch, Triton, CUDA and the GPU) holds:

- `artifacts.bin`: PyTorch's portable "mega-cache" (`torch.compiler.save_cache_artifacts`):
  inductor's compiled graphs with their Triton kernels, AOTAutograd's entries and autotuning
  results. Loaded (`torch.compiler.load_cache_artifacts`) before the first compile, it turns
  every compile of a `dynamic=True` forward that matches into a cache hit: dynamo still traces,
  inductor and Triton do not run. Saved at the end of the warm-up when this process compiled
  something the file lacked, or found none it could trust.
- `regions-<fingerprint>.bin` (`GraphConfig.precompile_regions`): the regions' AOT-compiled
  variants (dynamo's transformed bytecode, guards and inductor's output, as
  `AOTCompiledFunction.serialize` writes them), named by a fingerprint of our code so that a
  variant is never loaded into another version of it: loaded, they run without dynamo tracing.
- `warmup-<fingerprint>.json`: the warm-up record (`warmup_record.py`): each graph's check and
  replay time, one file per code version and check settings.

All are code or steer code, so all are signed (`cache_trust.py`): a file not signed with this
replica's key is refused before torch or a parser sees a byte of it (one warning naming the file
and why), and the replica compiles as if the cache were empty, then saves a signed one. Triton's
own cache (the kernels of our custom ops, such as the varlen attention kernel, which inductor's
artifacts do not cover; it holds launchers that are loaded as shared libraries) is left where
Triton keeps it, on the node (`TRITON_CACHE_DIR`, default `~/.triton/cache`): a new node
compiles those few kernels itself.

Writes are safe for concurrent replicas: each file goes to a temporary file renamed over the old
one (`os.replace` is atomic), signature and bytes in one file.

Pre-build the cache for a deployment before scaling it out, on one GPU of the kind that will
serve (the key includes the GPU), with the key the replicas will use:
`python -m deployments compile-cache --config configs/gpu.yaml` (with `graphs.compile: true`,
`graphs.compile_cache` and, for a cluster, `graphs.compile_cache_key_file` set in its args).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import stat
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from .cache_trust import Signer, Untrusted

logger = logging.getLogger(__name__)

ARTIFACTS = "artifacts.bin"
REGIONS_VERSION = 1
HEADER_BYTES = 8


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


def regions_name(fingerprint: str) -> str:
    """The precompiled regions' file of one code version (hex `fingerprint`: nothing else names a file)."""
    if not fingerprint or not all(c in "0123456789abcdef" for c in fingerprint):
        raise ValueError(f"a fingerprint is hex digits, got {fingerprint!r}")
    return f"regions-{fingerprint}.bin"


def pack_regions(regions: Mapping[str, Sequence[bytes]]) -> bytes:
    """Serialized variants by region name in one blob: the header's length (8 bytes, big-endian),
    a JSON header of each region's variant lengths, then the variants in that order. Pure."""
    header = json.dumps(
        {"version": REGIONS_VERSION, "regions": {name: [len(b) for b in blobs] for name, blobs in regions.items()}}
    ).encode()
    body = b"".join(blob for blobs in regions.values() for blob in blobs)
    return len(header).to_bytes(HEADER_BYTES, "big") + header + body


def unpack_regions(data: bytes) -> dict[str, list[bytes]]:
    """What `pack_regions` packed; raises ValueError where `data` is not such a blob. Pure."""
    size = int.from_bytes(data[:HEADER_BYTES], "big")
    if len(data) < HEADER_BYTES + size:
        raise ValueError("shorter than its header says")
    header = json.loads(data[HEADER_BYTES : HEADER_BYTES + size])
    if (
        not isinstance(header, dict)
        or header.get("version") != REGIONS_VERSION
        or not isinstance(header.get("regions"), dict)
    ):
        raise ValueError(f"not precompiled regions of version {REGIONS_VERSION}")
    regions, offset = {}, HEADER_BYTES + size
    for name, lengths in header["regions"].items():
        if not isinstance(lengths, list) or not all(type(n) is int and n > 0 for n in lengths):
            raise ValueError(f"region {name!r}: lengths must be positive integers")
        regions[name] = []
        for length in lengths:
            regions[name].append(data[offset : offset + length])
            offset += length
    if offset != len(data):
        raise ValueError(f"{len(data) - offset} bytes beyond the variants its header names")
    return regions


def _misses() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]


def _plain_name(name: str) -> str:
    """`name` where it is one path component of our own making; raises ValueError otherwise."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"not a plain file name: {name!r}")
    return name


def _read_regular(path: Path, max_bytes: int | None) -> bytes:
    """The bytes of the regular file `path` (not a link, a FIFO or a device, which could hang a read
    or never end); raises OSError or `Untrusted`."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(descriptor, "rb") as file:
        found = os.fstat(descriptor)
        if not stat.S_ISREG(found.st_mode):
            raise Untrusted("not a regular file")
        if max_bytes is not None and found.st_size > max_bytes:
            raise Untrusted(f"larger than {max_bytes} bytes")
        return file.read() if max_bytes is None else file.read(max_bytes + 1)


class CompileCache:
    """One cache key's directory under a compile cache root, its files signed with `signer`."""

    def __init__(self, root: str | os.PathLike, key: str, signer: Signer | None):
        """`signer`: the key our files are signed with (`cache_trust.signer`); None (no usable
        key): nothing is loaded or saved."""
        self.root = Path(root).expanduser()
        self.key = _plain_name(key)
        self.signer = signer
        self.path = self.root / (self.signer.key_id if self.signer is not None else "unsigned") / key
        self._misses_at_load: int | None = None
        self._loaded_trusted = False
        """`load` found artifacts signed with our key (else `save` replaces whatever is there)."""

    @property
    def artifacts(self) -> Path:
        return self.path / ARTIFACTS

    def read(self, name: str, max_bytes: int | None = None) -> bytes | None:
        """The bytes of our file `name` in this directory, its signature checked before anything
        else reads them; None where there is none (silently), or it is unreadable, larger than
        `max_bytes` or not signed with our key (one warning naming the file and why)."""
        if self.signer is None:
            return None
        path = self.path / _plain_name(name)
        try:
            return self.signer.verify(f"{self.key}/{name}", _read_regular(path, max_bytes))
        except FileNotFoundError:
            return None
        except (OSError, Untrusted) as error:
            logger.warning("compile cache file %s refused: %s; going on as if it were absent", path, error)
            return None

    def write(self, name: str, data: bytes) -> bool:
        """Save `data` as our file `name`, signed, atomically; False where it was not saved
        (no key, or storage refused: logged)."""
        if self.signer is None:
            return False
        return write_atomically(self.path / _plain_name(name), self.signer.sign(f"{self.key}/{name}", data))

    def remove(self, name: str) -> None:
        """Remove our file `name` (logged where storage refuses)."""
        try:
            (self.path / _plain_name(name)).unlink(missing_ok=True)
        except OSError as error:
            logger.warning("%s not removed: %s", self.path / name, error)

    def load(self) -> int:
        """Load the saved artifacts into this process's caches, once their signature is checked;
        the number loaded (0: none, or none trusted)."""
        self._misses_at_load = _misses()
        self._loaded_trusted = False
        data = self.read(ARTIFACTS)
        if data is None:
            return 0
        try:
            info = torch.compiler.load_cache_artifacts(data)
        except Exception as error:  # noqa: BLE001 - ours, yet unusable here: compile instead
            logger.warning("compile cache %s could not be loaded (%s); compiling anew", self.artifacts, error)
            return 0
        if info is None:
            logger.warning("compile cache %s could not be read; compiling anew", self.artifacts)
            return 0
        self._loaded_trusted = True
        return sum(len(found) for found in info.artifacts.values())

    def save(self) -> bool:
        """Save this process's artifacts, signed, unless `load` found ours and nothing was
        compiled anew since; atomic (temporary file, then rename). False where nothing was saved
        (a storage error is logged)."""
        if self.signer is None:
            return False
        if self._loaded_trusted and self._misses_at_load is not None and _misses() == self._misses_at_load:
            return False
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return False
        if not self.write(ARTIFACTS, saved[0]):
            return False
        logger.info("saved %d bytes of compiled artifacts to %s", len(saved[0]), self.artifacts)
        return True

    def load_regions(self, fingerprint: str) -> dict[str, list[bytes]] | None:
        """The serialized variants of our code version's precompiled regions, by region name, their
        signature checked first; None where there are none, or none trusted or readable (logged)."""
        data = self.read(regions_name(fingerprint))
        if data is None:
            return None
        try:
            return unpack_regions(data)
        except ValueError as error:
            logger.warning("precompiled regions %s refused: %s", self.path / regions_name(fingerprint), error)
            return None

    def save_regions(self, fingerprint: str, regions: Mapping[str, Sequence[bytes]]) -> bool:
        """Save the serialized variants, signed, atomically; False where nothing was saved."""
        if not self.write(regions_name(fingerprint), pack_regions(regions)):
            return False
        logger.info("saved the precompiled regions (%d variants) to %s", sum(map(len, regions.values())), self.path)
        return True
