"""The compile cache: keys (pure) and a round trip of torch's compiled artifacts through it (CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from encoder_graphs.compile_cache import CompileCache, cache_key, environment

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


def test_activating_points_triton_at_the_key_unless_the_environment_chose(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    CompileCache(tmp_path, "k").activate()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "k" / "triton")
    CompileCache(tmp_path, "other").activate()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "k" / "triton")


def test_a_directory_under_home_is_expanded(monkeypatch, tmp_path):
    """The GPU configs name `~/.cache/...`: the cache must land in the home directory, not in `./~`."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert CompileCache("~/.cache/compile", "k").path == tmp_path / ".cache" / "compile" / "k"


ROUND_TRIP = """
import sys
import torch
from torch._dynamo.utils import counters
from encoder_graphs.compile_cache import CompileCache

cache = CompileCache(sys.argv[1], "key")
loaded = cache.load()
fn = torch.compile(lambda x, y: torch.nn.functional.gelu(x @ y).sum(-1) * 2 + 1, dynamic=True)
fn(torch.randn(8, 16), torch.randn(16, 4))
print(loaded, counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"], cache.save())
"""


def compile_in_fresh_process(root: Path, local_cache: Path) -> list[str]:
    """A new process with an empty local inductor cache compiles through the shared cache."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(local_cache)}
    done = subprocess.run(
        [sys.executable, "-c", ROUND_TRIP, str(root)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    """The first process compiles (an inductor cache miss) and saves the artifacts; the second, with
    a local cache of its own, loads them and compiles nothing: a hit, and nothing new to save."""
    assert compile_in_fresh_process(tmp_path / "shared", tmp_path / "local1") == ["0", "0", "1", "True"]
    assert (tmp_path / "shared" / "key" / "artifacts.bin").is_file()
    loaded, hits, misses, saved = compile_in_fresh_process(tmp_path / "shared", tmp_path / "local2")
    assert int(loaded) > 0 and (hits, misses, saved) == ("1", "0", "False")
    assert not [p for p in (tmp_path / "shared" / "key").iterdir() if p.name.startswith(".")]  # no temporaries left


def test_artifacts_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """Saved through a temporary file renamed over the old one; where storage refuses (here the
    root is a file), nothing is saved, nothing is left behind, and the warm-up goes on."""
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled", None))
    cache = CompileCache(tmp_path / "root", "k")
    assert cache.save() and cache.artifacts.read_bytes() == b"compiled"
    assert list(cache.path.iterdir()) == [cache.artifacts]
    (tmp_path / "file").write_text("")
    assert not CompileCache(tmp_path / "file", "k").save()
    assert (tmp_path / "file").read_text() == ""
