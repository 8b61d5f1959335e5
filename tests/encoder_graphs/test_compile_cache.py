"""The compile cache: keys (pure), a round trip of torch's compiled artifacts through it (CPU), and
its trust boundary: only files signed with our key reach torch."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from encoder_graphs.cache_trust import HEADER, NODE_KEY, Signer, read_key
from encoder_graphs.compile_cache import ARTIFACTS, CompileCache, cache_key, environment

ROOT = Path(__file__).resolve().parents[2]
IDENTITY = {"family": "qwen3-vl", "name": "qwen3-vl-8b", "tower_config": "ab12", "attention": "triton"}
LAYOUTS = {"dynamic": True, "graphs": [(64, 256), (128, 512)]}
ENV = {"torch": "2.14.1", "triton": "3.8.0", "gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0"}


def test_a_key_names_the_family_and_changes_with_model_layouts_and_environment():
    key = cache_key(IDENTITY, LAYOUTS, ENV)
    assert key == cache_key(dict(reversed(IDENTITY.items())), LAYOUTS, ENV)  # order of fields is not identity
    assert key.startswith("qwen3-vl-") and all(c.isalnum() or c in "-_." for c in key)
    changed = [
        cache_key({**IDENTITY, "attention": "cudnn"}, LAYOUTS, ENV),
        cache_key({**IDENTITY, "tower_config": "cd34"}, LAYOUTS, ENV),
        cache_key(IDENTITY, {**LAYOUTS, "graphs": [(64, 256)]}, ENV),
        cache_key(IDENTITY, LAYOUTS, {**ENV, "gpu": "NVIDIA H200"}),
        cache_key(IDENTITY, LAYOUTS, {**ENV, "torch": "2.15.0"}),
    ]
    assert len({key, *changed}) == 6


def test_the_environment_names_torch_and_the_device():
    found = environment(torch.device("cpu"))
    assert found["torch"] == torch.__version__ and found["device"] == "cpu" and "gpu" not in found


def test_a_directory_under_home_is_expanded(monkeypatch, tmp_path):
    """The GPU configs name `~/.cache/...`: the cache must land in the home directory, not in `./~`;
    each key saves under a directory of its own."""
    monkeypatch.setenv("HOME", str(tmp_path))
    key = Signer(b"k" * 32, "test")
    assert CompileCache("~/.cache/compile", "k", key).path == tmp_path / ".cache" / "compile" / key.key_id / "k"


def test_only_plain_names_of_our_own_name_files():
    key = Signer(b"k" * 32, "test")
    for bad in ("..", "a/b", "", "."):
        with pytest.raises(ValueError):
            CompileCache("/tmp", bad, key)
    with pytest.raises(ValueError):
        CompileCache("/tmp", "k", key).read("../artifacts.bin")


ROUND_TRIP = """
import sys
import torch
from torch._dynamo.utils import counters
from encoder_graphs.cache_trust import signer
from encoder_graphs.compile_cache import CompileCache

cache = CompileCache(sys.argv[1], "key", signer(None, sys.argv[1]))
loaded = cache.load()
fn = torch.compile(lambda x, y: torch.nn.functional.gelu(x @ y).sum(-1) * 2 + 1, dynamic=True)
fn(torch.randn(8, 16), torch.randn(16, 4))
print(loaded, counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"], cache.save())
print(cache.artifacts)
"""


def run_python(code: str, *args: object, env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return done


def compile_in_fresh_process(root: Path, local_cache: Path, node: Path) -> tuple[list[str], Path, str]:
    """A new process with an empty local inductor cache compiles through the shared cache, signing
    with the key of `node` (its node-private state directory): (loaded, hits, misses, saved), the
    artifacts' path and the log."""
    done = run_python(ROUND_TRIP, root, env={"TORCHINDUCTOR_CACHE_DIR": str(local_cache), "XDG_STATE_HOME": str(node)})
    counts, artifacts = done.stdout.splitlines()
    return counts.split(), Path(artifacts), done.stderr


@pytest.fixture(scope="module")
def first_compile(tmp_path_factory) -> tuple[Path, Path, list[str], Path]:
    """A first process's compile into an empty shared cache (a cold inductor compile, the slow part),
    kept untouched for the tests to copy: (shared cache root, its node's state directory, counts,
    the artifacts' path under the root)."""
    root = tmp_path_factory.mktemp("first-compile")
    counts, artifacts, _ = compile_in_fresh_process(root / "shared", root / "local", root / "node")
    return root / "shared", root / "node", counts, artifacts.relative_to(root / "shared")


def copy_of_first_compile(first_compile, tmp_path: Path) -> tuple[Path, Path, list[str], Path]:
    shared, node, counts, artifacts = first_compile
    shutil.copytree(shared, tmp_path / "shared")
    shutil.copytree(node, tmp_path / "node1")
    return tmp_path / "shared", tmp_path / "node1", counts, tmp_path / "shared" / artifacts


def test_a_second_process_loads_what_the_first_compiled_and_another_nodes_key_trusts_none_of_it(
    first_compile, tmp_path
):
    """The first process compiles (an inductor cache miss) and saves the artifacts, signed; the second,
    on the same node (same key) with a local cache of its own, loads them and compiles nothing: a hit,
    and nothing new to save. A process with another node's key never reads them: it compiles and
    saves under its own key's directory, leaving the first node's file as it was."""
    shared, _, counts, artifacts = copy_of_first_compile(first_compile, tmp_path)
    assert counts == ["0", "0", "1", "True"] and artifacts.read_bytes().startswith(HEADER)
    saved = artifacts.read_bytes()
    counts, again, _ = compile_in_fresh_process(shared, tmp_path / "local2", tmp_path / "node1")
    assert again == artifacts and int(counts[0]) > 0 and counts[1:] == ["1", "0", "False"]
    assert not [p for p in artifacts.parent.iterdir() if p.name.startswith(".")]  # no temporaries left

    counts, other, _ = compile_in_fresh_process(shared, tmp_path / "local3", tmp_path / "node2")
    assert counts == ["0", "0", "1", "True"] and other != artifacts and artifacts.read_bytes() == saved


def test_a_tampered_artifact_is_refused_and_replaced_by_a_signed_one(first_compile, tmp_path):
    """One byte changed in a genuine signed file: refused (one warning naming the file), compiled
    anew and saved over it, signed with the node's key."""
    shared, node_state, _, artifacts = copy_of_first_compile(first_compile, tmp_path)
    blob = bytearray(artifacts.read_bytes())
    blob[-10] ^= 1
    artifacts.write_bytes(bytes(blob))
    counts, _, log = compile_in_fresh_process(shared, tmp_path / "local2", node_state)
    assert counts == ["0", "0", "1", "True"]
    assert log.count("refused") == 1 and f"{artifacts} refused: signature does not match" in log
    node = Signer(read_key(node_state / NODE_KEY), "the node's")
    assert node.verify(f"key/{ARTIFACTS}", artifacts.read_bytes()) != bytes(blob)[len(HEADER) + 65 :]


CRAFTED = """
import sys
from torch._inductor.runtime.autotune_cache import AutotuneCacheArtifact
from torch.compiler._cache import _serialize_single_cache
from torch.utils._appending_byte_serializer import AppendingByteSerializer

writer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
writer.append(("autotune", [AutotuneCacheArtifact(sys.argv[2], sys.argv[3].encode())]))
open(sys.argv[1], "wb").write(writer.to_bytes())
"""

LOAD_RAW = """
import sys, torch
print(torch.compiler.load_cache_artifacts(open(sys.argv[1], "rb").read()))
"""


def test_a_crafted_artifact_that_would_write_outside_the_cache_is_refused_before_torch_reads_it(tmp_path, caplog):
    """An autotune entry whose key is a path elsewhere (here a `.pth` in a site directory, which the
    next Python started there would run): handed to torch as it is, it writes there (checked, so
    the test's file is a real one); our load refuses it, unsigned or with a forged signature, and
    nothing appears outside the cache."""
    site = tmp_path / "site-packages"
    target = site / "evil.pth"
    crafted = tmp_path / "crafted.bin"
    env = {"XDG_STATE_HOME": str(tmp_path / "node"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    run_python(CRAFTED, crafted, target, f"import pathlib; pathlib.Path({str(tmp_path / 'ran')!r}).touch()", env=env)
    run_python(LOAD_RAW, crafted, env=env)
    assert target.is_file()  # what loading it unchecked does
    target.unlink()
    site.rmdir()

    cache = CompileCache(tmp_path / "cache", "key", Signer(b"k" * 32, "test"))
    cache.path.mkdir(parents=True)
    forged = HEADER + b"0" * 64 + b"\n" + crafted.read_bytes()
    other_key = Signer(b"x" * 32, "another").sign(f"{cache.key}/{ARTIFACTS}", crafted.read_bytes())
    unsigned = "no signature header (not saved by this service, or by an older version)"
    mismatch = "signature does not match (another key, or the file was altered)"
    for blob, why in [(crafted.read_bytes(), unsigned), (forged, mismatch), (other_key, mismatch)]:
        cache.artifacts.write_bytes(blob)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert cache.load() == 0
        assert [r.getMessage() for r in caplog.records] == [
            f"compile cache file {cache.artifacts} refused: {why}; going on as if it were absent"
        ]
        assert not site.exists() and not (tmp_path / "ran").exists()


def test_a_file_that_is_not_a_regular_file_is_refused_without_reading(tmp_path):
    """A FIFO in its place would block a read forever; a link is not ours either."""
    cache = CompileCache(tmp_path, "key", Signer(b"k" * 32, "test"))
    cache.path.mkdir(parents=True)
    os.mkfifo(cache.artifacts)
    assert cache.load() == 0
    cache.artifacts.unlink()
    (tmp_path / "elsewhere").write_bytes(cache.signer.sign(f"key/{ARTIFACTS}", b"x"))
    cache.artifacts.symlink_to(tmp_path / "elsewhere")
    assert cache.read(ARTIFACTS) is None


def test_without_a_key_nothing_is_loaded_or_saved(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled", None))
    cache = CompileCache(tmp_path, "k", None)
    assert not cache.save() and cache.load() == 0 and not list(tmp_path.iterdir())


def test_artifacts_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """Saved, signed, through a temporary file renamed over the old one; where storage refuses (here
    the root is a file), nothing is saved, nothing is left behind, and the warm-up goes on."""
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled", None))
    key = Signer(b"k" * 32, "test")
    cache = CompileCache(tmp_path / "root", "k", key)
    assert cache.save() and key.verify(f"k/{ARTIFACTS}", cache.artifacts.read_bytes()) == b"compiled"
    assert list(cache.path.iterdir()) == [cache.artifacts]
    (tmp_path / "file").write_text("")
    assert not CompileCache(tmp_path / "file", "k", key).save()
    assert (tmp_path / "file").read_text() == ""
