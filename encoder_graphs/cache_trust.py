"""Whose compile cache files a replica may load: only those signed with the service's own key.

What the compile cache holds is code (inductor's generated modules, pickled AOTAutograd and FX
entries, autotune entries torch writes to paths they name), and its directory may be shared
storage that others can write. So every file the cache keeps is saved as a header line
(`HEADER` and an HMAC-SHA256 in hex) followed by its bytes, and read back only when the MAC over
its name and bytes is the key's: a file not made with the key is refused before any of its
bytes reach torch or a parser.

The key (`signer`):

- `graphs.compile_cache_key_file`: a file the operator provides on every node (a Kubernetes secret,
  a file the deployment tool places), at least `MIN_KEY_BYTES` bytes (e.g.
  `openssl rand -hex 32`). Every node that holds it trusts what the others saved: the way to share
  one cache across a cluster. A missing, short or misplaced file is a configuration error.
- Without it, a per-node key (`node_key_path`: `$XDG_STATE_HOME/vlm-encoder-serve/`, by default
  `~/.local/state/...`), generated once with mode 0600: restarts on the node reuse what the node
  saved, and files that other nodes or users saved are never trusted. A node key that is not the
  service user's own 0600 file is refused (the cache is then not used).

Each key saves under its own directory (`Signer.key_id`), so replicas with different keys that
share a directory never overwrite each other's files.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

HEADER = b"vlm-encoder-serve signed v1 hmac-sha256="
"""The first line of every signed file, followed by the MAC in hex and a newline."""
MIN_KEY_BYTES = 32
MAX_KEY_BYTES = 4096
NODE_KEY = Path("vlm-encoder-serve") / "compile-cache.key"
"""The per-node key, under `$XDG_STATE_HOME` (default `~/.local/state`)."""


class CacheKeyError(ValueError):
    """The configured key file cannot be used; the message names it and the fix."""


class Untrusted(Exception):
    """A file not signed with this key (the message says why)."""


@dataclass(frozen=True)
class Signer:
    """Signs and verifies the files of a compile cache with one key."""

    key: bytes = field(repr=False)
    source: str
    """Where the key came from, for logs and the pre-build tool."""

    @property
    def key_id(self) -> str:
        """A name for the key that reveals nothing of it: the directory its files are saved under."""
        return hmac.new(self.key, b"vlm-encoder-serve key id", hashlib.sha256).hexdigest()[:16]

    def _mac(self, name: str, data: bytes | memoryview) -> str:
        mac = hmac.new(self.key, b"vlm-encoder-serve compile cache\0", hashlib.sha256)
        mac.update(name.encode())
        mac.update(b"\0")
        mac.update(data)
        return mac.hexdigest()

    def sign(self, name: str, data: bytes) -> bytes:
        """`data` with the header that `verify` checks; `name` (the file's name under the cache)
        is signed too, so a file moved to another name is refused."""
        return HEADER + self._mac(name, data).encode() + b"\n" + data

    def verify(self, name: str, blob: bytes) -> bytes:
        """The signed bytes of `blob`; raises `Untrusted` where it is not signed with this key as `name`."""
        start = len(HEADER) + 64 + 1
        if not blob.startswith(HEADER) or len(blob) < start or blob[start - 1 : start] != b"\n":
            raise Untrusted("no signature header (not saved by this service, or by an older version)")
        data = memoryview(blob)[start:]
        if not hmac.compare_digest(blob[len(HEADER) : start - 1], self._mac(name, data).encode()):
            raise Untrusted("signature does not match (another key, or the file was altered)")
        return bytes(data)


def read_key(path: Path) -> bytes:
    """The key in `path`: its content, surrounding whitespace stripped. Raises OSError or ValueError."""
    with open(path, "rb") as file:
        key = file.read(MAX_KEY_BYTES + 1).strip()
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"longer than {MAX_KEY_BYTES} bytes: not a key file")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"holds {len(key)} bytes, fewer than {MIN_KEY_BYTES} (make one: openssl rand -hex 32)")
    return key


def node_key_path() -> Path:
    """Where the per-node key is kept: `$XDG_STATE_HOME/vlm-encoder-serve/compile-cache.key`."""
    return Path(os.environ.get("XDG_STATE_HOME") or "~/.local/state").expanduser() / NODE_KEY


def node_key(path: Path | None = None) -> bytes:
    """The per-node key, generated on first use (mode 0600, in a 0700 directory); concurrent first
    uses agree on one (linked into place only if absent). Raises OSError, or ValueError where the
    file is not the service user's own private file."""
    path = node_key_path() if path is None else path
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}"
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "wb") as file:
                file.write(secrets.token_hex(32).encode() + b"\n")
                file.flush()
                os.fsync(file.fileno())
            with contextlib.suppress(FileExistsError):  # another replica made it first: use that one
                os.link(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
    found = os.lstat(path)
    if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise ValueError(
            f"must be a regular file owned by this user with mode 0600 (found mode {stat.filemode(found.st_mode)}, "
            f"owner {found.st_uid}): remove it to have a new key made"
        )
    return read_key(path)


def signer(key_file: str | os.PathLike | None, cache_root: str | os.PathLike) -> Signer | None:
    """The key a compile cache under `cache_root` is signed with: `key_file` where given (raises
    `CacheKeyError` where it cannot be used), else the node's own key; None where the node key
    cannot be made or is unsafe (logged: the replica then compiles without the cache). A key
    inside the cache directory is refused: whoever writes the cache must not read its key."""
    root = Path(cache_root).expanduser().resolve()
    if key_file is not None:
        path = Path(key_file).expanduser()
        try:
            if path.resolve().is_relative_to(root):
                raise ValueError(
                    f"lies inside graphs.compile_cache {root}: keep it where the cache's writers cannot read it"
                )
            return Signer(read_key(path), f"graphs.compile_cache_key_file {path}")
        except (OSError, ValueError) as error:
            raise CacheKeyError(f"graphs.compile_cache_key_file {path}: {error}") from error
    path = node_key_path()
    try:
        if path.resolve().is_relative_to(root):
            raise ValueError(f"lies inside graphs.compile_cache {root}: set XDG_STATE_HOME elsewhere")
        return Signer(node_key(path), f"this node's key {path}")
    except (OSError, ValueError) as error:
        logger.warning("compile cache %s not used: the node key %s: %s", cache_root, path, error)
        return None
