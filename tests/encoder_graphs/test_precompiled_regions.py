"""Precompiled regions (`GraphConfig.precompile_regions`, CPU, dynamo's "eager" backend): a later
start loads them from the compile cache and traces nothing; a file not signed with our key, or of
another code version, is refused and the warm-up compiles; a pack no variant accepts while serving
runs uncompiled, as transformers computes it."""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from encoder_graphs.cache_trust import NODE_KEY, Signer, read_key
from encoder_graphs.compile_cache import pack_regions, regions_name, unpack_regions
from encoder_graphs.config import GraphConfig
from encoder_graphs.execute import would_compile
from encoder_graphs.runner import EncoderRunner
from models import from_preset
from models.precompiled import PrecompiledRegions
from models.protocol import RegionMiss, precompiled_regions
from tests.helpers import random_image, reference_item, reference_tower, relative_error

ROOT = Path(__file__).resolve().parents[2]

WARM_UP = """
import json, sys
import numpy as np
import torch
from torch._dynamo.utils import compilation_time_metrics, counters
import encoder_graphs.warmup
from encoder_graphs.config import GraphConfig
from encoder_graphs.runner import EncoderRunner
from models import from_preset
from models.protocol import precompiled_regions
from tests.helpers import random_image, reference_item, reference_tower, relative_error

if sys.argv[2] == "other-code":  # what a change to our sources does to the fingerprint
    fingerprint = encoder_graphs.warmup.fingerprint
    encoder_graphs.warmup.fingerprint = lambda settings: fingerprint({**settings, "code": "changed"})
preset, device, backend = sys.argv[3:6]
dtype = torch.bfloat16 if device == "cuda" else torch.float32
encoder = from_preset(preset, seed=4, device=device, dtype=dtype)
config = GraphConfig(budgets=(64, 256), compile=True, precompile_regions=True, compile_cache=sys.argv[1])
runner = EncoderRunner(encoder, config, precompiled=precompiled_regions(backend))
runner.prepare(progress=lambda message: None)
lines = []
runner.warm_up(progress=lines.append)
reference, pre, errors, compiled = reference_tower(encoder), encoder.preprocessor, [], []
for seed, sizes in enumerate([[(256, 256)], [(500, 500), (500, 500)]]):  # a padded budget, the exact route
    resized = [pre.resize_image(random_image(np.random.default_rng(seed), h, w)) for h, w in sizes]
    pixels, specs = pre.pixel_values(resized, "image"), [pre.spec("image", 1, *r.shape[-2:]) for r in resized]
    row = 0
    for spec, out in zip(specs, runner.run(pixels, specs)):
        tokens, deepstack = reference_item(reference, pixels[row : row + spec.input_patches], spec.grid_thw)
        errors += [relative_error(out.tokens, tokens), relative_error(out.deepstack, deepstack)]
        row += spec.input_patches
    compiled.append(runner.stats.last.graph or runner.stats.last.compiled)
print(json.dumps({
    "lines": lines,
    "graphs_traced": counters["stats"]["unique_graphs"],
    "tracing": sorted(k for k in compilation_time_metrics if k in ("bytecode_tracing", "fullgraph_capture")),
    "error": max(errors),
    "compiled": compiled,
    "fallbacks": runner.stats.recompile_fallbacks,
    "captured_compiled": sum(e.graph is not None and e.forward is None for e in runner.entries.values()),
    "graphs": len(runner.entries),
    "cache": str(runner.compile_cache.path),
    "key": runner.compile_cache.key,
}))
"""


def warm_up_in_fresh_process(
    cache: Path, state: Path, mode: str = "plain", preset: str = "qwen3-vl-tiny", device: str = "cpu"
) -> dict:
    """A replica's warm-up and two packs in a new process (its own dynamo and torch state); on CPU
    with dynamo's "eager" backend, on a GPU with inductor, as a replica compiles."""
    backend = "inductor" if device == "cuda" else "eager"
    done = subprocess.run(
        [sys.executable, "-c", WARM_UP, str(cache), mode, preset, device, backend],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(state)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    found["stderr"] = done.stderr
    return found


def loaded(found: dict) -> bool:
    return any(line.startswith("precompiled regions:") for line in found["lines"])


def regions_files(found: dict) -> list[Path]:
    return sorted(Path(found["cache"]).glob("regions-*.bin"))


@pytest.fixture(scope="module")
def first_start(tmp_path_factory) -> tuple[dict, Path, Path]:
    """The first start on an empty cache: it compiles and saves the variants, signed."""
    root = tmp_path_factory.mktemp("precompiled")
    cache, state = root / "cache", root / "state"
    found = warm_up_in_fresh_process(cache, state)
    assert not loaded(found) and found["graphs_traced"] > 0 and found["tracing"]
    assert found["error"] <= 1e-4 and all(found["compiled"]) and found["fallbacks"] == 0
    assert len(regions_files(found)) == 1
    return found, cache, state


def test_a_later_start_loads_the_variants_and_traces_nothing(first_start):
    """Dynamo traces no frame and captures no graph: every region runs a loaded variant, the
    padded budget and the exact route compiled, both as transformers computes them; nothing new
    is saved."""
    first, cache, state = first_start
    (saved,) = regions_files(first)
    before = saved.read_bytes()
    found = warm_up_in_fresh_process(cache, state)
    assert loaded(found), found["lines"]
    assert found["graphs_traced"] == 0 and found["tracing"] == []
    assert found["error"] <= 1e-4 and all(found["compiled"]) and found["fallbacks"] == 0
    assert regions_files(found) == [saved] and saved.read_bytes() == before


def test_variants_signed_with_another_key_are_refused_before_torch_reads_them(first_start):
    """A regions file signed with a key not ours is refused (one warning naming it) and the
    warm-up compiles, then replaces it with one signed with ours."""
    first, cache, state = first_start
    (saved,) = regions_files(first)
    blob = Signer(b"f" * 32, "foreign").sign(f"{first['key']}/{saved.name}", b"not a pickle torch may read")
    saved.write_bytes(blob)
    found = warm_up_in_fresh_process(cache, state)
    assert not loaded(found) and found["graphs_traced"] > 0
    assert f"{saved} refused" in found["stderr"]
    assert found["error"] <= 1e-4 and all(found["compiled"])
    ours = Signer(read_key(state / NODE_KEY), "node")
    assert unpack_regions(ours.verify(f"{first['key']}/{saved.name}", saved.read_bytes()))  # ours again


def test_variants_of_another_code_version_are_not_loaded(first_start):
    """Under another fingerprint of our code the saved variants are not used: the warm-up compiles
    and saves its own file beside them."""
    first, cache, state = first_start
    found = warm_up_in_fresh_process(cache, state, "other-code")
    assert not loaded(found) and found["graphs_traced"] > 0
    assert found["error"] <= 1e-4 and all(found["compiled"])
    assert len(regions_files(found)) == 2


def test_a_variant_whose_traced_source_changed_is_refused(tmp_path, monkeypatch):
    """Stale bytecode never runs: a variant that traced a function whose source has changed since
    does not load (the warm-up then compiles anew)."""
    module_file = tmp_path / "region_source.py"
    module_file.write_text("def layer(x):\n    return x * 2 + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("region_source")
    compiling = PrecompiledRegions("eager")
    compiling.compiling = True
    assert torch.equal(compiling(module.layer)(torch.ones(3)), torch.full((3,), 3.0))
    blobs = compiling.serialized()
    assert not compiling.new and list(blobs) == ["region_source.layer"]

    fresh = PrecompiledRegions("eager")
    layer = fresh(module.layer)  # regions load by the name of the function they were made for
    assert fresh.load(blobs) == 1 and torch.equal(layer(torch.ones(3)), torch.full((3,), 3.0))
    module_file.write_text("def layer(x):\n    return x * 3 + 1\n")
    changed = PrecompiledRegions("eager")
    changed(module.layer)
    with pytest.raises(ValueError, match="changed"):
        changed.load(blobs)
    assert changed.regions["region_source.layer"].variants == []


def scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_a_region_compiles_a_variant_per_guard_set_only_while_compiling():
    """A guard miss compiles a variant only while the regions are compiling and the caller's stance
    allows; otherwise it raises `RegionMiss` and compiles nothing. A call tries the variant that
    passed last first."""
    regions = PrecompiledRegions("eager")
    region = regions(scaled)
    assert regions(scaled) is region and region.name.endswith("test_precompiled_regions.scaled")
    with pytest.raises(RegionMiss):
        region(torch.ones(4))  # not compiling: nothing to run
    regions.compiling = True
    with torch.compiler.set_stance("fail_on_recompile"), pytest.raises(RegionMiss):
        region(torch.ones(4))  # where dynamo may not compile (the device lock), neither may a region
    assert torch.equal(region(torch.ones(4)), torch.full((4,), 3.0)) and len(region.variants) == 1
    assert torch.equal(region(torch.ones(7)), torch.full((7,), 3.0)) and len(region.variants) == 1  # dynamic
    assert torch.equal(region(torch.ones(4, dtype=torch.float64)), torch.full((4,), 3.0, dtype=torch.float64))
    assert len(region.variants) == 2 and region._last == 1 and regions.new
    regions.compiling = False
    region(torch.ones(5))
    assert region._last == 0
    with pytest.raises(RegionMiss, match="none of its 2 precompiled variants"):
        region(torch.ones(4, dtype=torch.int64))
    assert len(region.variants) == 2


def checkpointing(forward):
    """A decorator as transformers wraps a layer's `forward` (`GradientCheckpointingLayer`)."""

    @functools.wraps(forward)
    def wrapper(x: torch.Tensor) -> torch.Tensor:
        return forward(x)

    return wrapper


@checkpointing
def wrapped_layer(x: torch.Tensor) -> torch.Tensor:
    return x * 3 - 1


def test_a_decorated_region_function_round_trips():
    """The function a decorator wraps (in the wrapper's closure, named as the wrapper) cannot be
    pickled by its name: it is passed by reference, and the variant loads and runs."""
    regions = PrecompiledRegions("eager")
    regions.compiling = True
    assert torch.equal(regions(wrapped_layer)(torch.ones(3)), torch.full((3,), 2.0))
    fresh = PrecompiledRegions("eager")
    layer = fresh(wrapped_layer)
    assert fresh.load(regions.serialized()) == 1 and torch.equal(layer(torch.ones(5)), torch.full((5,), 2.0))


def test_the_regions_file_round_trips_and_a_malformed_one_is_refused():
    regions = {"a.layer": [b"x" * 5, b"yy"], "b.merger": [b"z"]}
    assert unpack_regions(pack_regions(regions)) == regions
    packed = pack_regions(regions)
    for bad in (packed[:-1], packed + b"!", b"\0" * 8 + b"{}", packed[:10]):
        with pytest.raises(ValueError):
            unpack_regions(bad)
    with pytest.raises(ValueError):
        regions_name("../x")


def images(encoder, seed: int, sizes):
    pre = encoder.preprocessor
    resized = [pre.resize_image(random_image(np.random.default_rng(seed), h, w)) for h, w in sizes]
    return pre.pixel_values(resized, "image"), [pre.spec("image", 1, *r.shape[-2:]) for r in resized]


def assert_matches_reference(reference, pixels, specs, outputs):
    row = 0
    for spec, out in zip(specs, outputs):
        expected, deepstack = reference_item(reference, pixels[row : row + spec.input_patches], spec.grid_thw)
        assert relative_error(out.tokens, expected) <= 1e-4 and relative_error(out.deepstack, deepstack) <= 1e-4
        row += spec.input_patches


def test_a_pack_no_variant_accepts_runs_uncompiled_while_serving():
    """Serving never compiles: without the exact route the warm-up compiles no exact-layout variant,
    so a recurring pack's exact layout misses every one (a `RegionMiss`, never raised to the caller)
    and runs uncompiled; a padded budget whose layer variants are gone falls back the same way, as
    a recompile under "fail_on_recompile" does. Every output is transformers'."""
    encoder = from_preset("qwen3-vl-tiny", seed=4)
    reference = reference_tower(encoder)
    precompiled = precompiled_regions("eager")
    config = GraphConfig(budgets=(64, 256), compile=True, precompile_regions=True, compile_exact=False)
    runner = EncoderRunner(encoder, config, precompiled=precompiled)
    runner.prepare(progress=lambda message: None)
    runner.warm_up(progress=lambda message: None)
    assert not precompiled.compiling
    variants = {name: len(region.variants) for name, region in precompiled.regions.items()}

    pixels, specs = images(encoder, 1, [(128, 128), (96, 160)])
    for _ in range(config.recurring_after + 1):
        assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    assert runner.stats.recurring_uncompiled >= 1
    assert {name: len(region.variants) for name, region in precompiled.regions.items()} == variants

    precompiled.regions["models.qwen3_vl.fused_layer"].variants = []
    pixels, specs = images(encoder, 2, [(200, 180)])
    assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    assert runner.stats.recompile_fallbacks == 1 and runner.stats.last.graph
    assert would_compile(RegionMiss("region x")) and not would_compile(RuntimeError("other"))


@pytest.mark.gpu
def test_on_a_gpu_a_later_start_captures_loaded_variants_without_tracing(tmp_path):
    """GPU, inductor, CUDA graphs: the first start compiles and saves; the second loads the
    variants, traces nothing, captures every graph with the compiled forward (none fell back),
    and its packs (a graph, the exact route) agree with transformers' bf16 tower."""
    cache, state = tmp_path / "cache", tmp_path / "state"
    first = warm_up_in_fresh_process(cache, state, preset="qwen3-vl-2b", device="cuda")
    assert not loaded(first) and first["graphs_traced"] > 0 and len(regions_files(first)) == 1
    found = warm_up_in_fresh_process(cache, state, preset="qwen3-vl-2b", device="cuda")
    assert loaded(found) and found["graphs_traced"] == 0 and found["tracing"] == []
    assert found["fallbacks"] == 0 and found["captured_compiled"] == found["graphs"] and all(found["compiled"])
    assert found["error"] <= 0.05
