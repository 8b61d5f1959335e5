"""Startup: `prepare`, then a warm-up in a background thread while packs are served (CPU)."""

from __future__ import annotations

import functools
import json
import math
import os
import threading

import numpy as np
import pytest
import torch

from encoder_graphs.config import GraphConfig
from encoder_graphs.runner import EncoderRunner
from models import from_preset
from tests.helpers import random_image, reference_item, reference_tower, relative_error

SMALL_LADDER = GraphConfig(max_budget_tokens=512, fine_budget_steps=1)
"""Ten graphs on CPU: few enough that the warm-up logs a line for each (its per-step hook here)."""


@pytest.fixture(scope="module")
def qwen3():
    encoder = from_preset("qwen3-vl-tiny", seed=4)
    return encoder, reference_tower(encoder)


def images(encoder, seed: int, sizes):
    pre = encoder.preprocessor
    resized = [pre.resize_image(random_image(np.random.default_rng(seed), h, w)) for h, w in sizes]
    return pre.pixel_values(resized, "image"), [pre.spec("image", 1, *r.shape[-2:]) for r in resized]


def assert_matches_reference(reference, pixels, specs, outputs):
    assert len(outputs) == len(specs)  # nothing lost
    row = 0
    for spec, out in zip(specs, outputs):
        expected, deepstack = reference_item(reference, pixels[row : row + spec.input_patches], spec.grid_thw)
        assert relative_error(out.tokens, expected) <= 1e-4 and relative_error(out.deepstack, deepstack) <= 1e-4
        row += spec.input_patches


def route(runner) -> str:
    last = runner.stats.last
    return "graph" if last.graph else last.eager_reason


def serve_while(
    thread: threading.Thread, runner, reference, packs, before_full_speed=None, served: threading.Event | None = None
) -> list[str]:
    """Serve the packs round after round until the warm-up thread ends; the route of each. The
    stats of each pack that started before full speed go to `before_full_speed` (the thread
    still saves the compile cache after it); `served` is set after each pack."""
    routes = []
    while thread.is_alive():
        for pixels, specs in packs:
            with runner.device_lock:  # full speed switches on under this lock: no switch in between
                full_speed = runner.warmup_status().full_speed
                outputs = runner.run(pixels, specs)
            assert_matches_reference(reference, pixels, specs, outputs)
            routes.append(route(runner))
            if served is not None:
                served.set()
            if before_full_speed is not None and not full_speed:
                before_full_speed.append(runner.stats.last)
    return routes


def test_packs_served_during_a_background_warm_up_match_transformers(qwen3):
    """After `prepare` the runner serves at once (eagerly on exact layouts); graphs go live one
    by one under the warm-up thread while packs keep coming: every output is transformers' own,
    and packs move to graphs as their graphs go live."""
    encoder, reference = qwen3
    runner = EncoderRunner(encoder, SMALL_LADDER)
    runner.prepare(progress=lambda message: None)
    assert runner.warmup_status().stage == "prepared" and runner.live_budgets() == ()
    log: list[str] = []
    served = threading.Event()

    def slow_progress(message: str) -> None:  # each step waits for a pack served meanwhile (however slow the host)
        log.append(message)
        served.clear()
        served.wait(timeout=30)

    thread = threading.Thread(target=runner.warm_up, args=(slow_progress,), daemon=True)
    packs = [images(encoder, 1, [(256, 256), (300, 200)]), images(encoder, 2, [(200, 200)] * 3)]
    thread.start()
    routes = serve_while(thread, runner, reference, packs, served=served)
    thread.join()
    status = runner.warmup_status()
    assert status.full_speed and status.stage == "done" and status.graphs_live == status.graphs_total
    assert routes[0] == "warming" and "graph" in routes, routes
    assert runner.stats.packs == len(routes) and runner.stats.items == sum(len(p[1]) for p in packs) * len(routes) // 2
    assert any(message.startswith("full speed") for message in log)
    for pixels, specs in packs:
        assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
        assert runner.stats.last.graph


def test_the_graphs_the_traffic_needed_are_built_first(qwen3):
    encoder, _ = qwen3
    runner = EncoderRunner(encoder, SMALL_LADDER)
    runner.prepare(progress=lambda message: None)
    pixels, specs = images(encoder, 3, [(256, 256), (300, 200)])
    budget = runner.table.fitting_budget(sum(s.output_tokens for s in specs))
    assert budget != runner.table.budgets[0]
    runner.run(pixels, specs)
    log: list[str] = []
    runner.warm_up(progress=log.append)
    first = next(message for message in log if message.startswith("graph "))
    assert f"budget {budget} tokens" in first, first


def test_a_stopped_warm_up_leaves_a_serving_runner(qwen3):
    encoder, reference = qwen3
    runner = EncoderRunner(encoder, SMALL_LADDER)
    runner.prepare(progress=lambda message: None)
    stop = threading.Event()

    def stop_after_three(message: str) -> None:
        if message.startswith("graph 3/"):
            stop.set()

    status = runner.warm_up(progress=stop_after_three, stop=stop)
    assert status.stage == "stopped" and not status.full_speed and status.graphs_live == 3
    pixels, specs = images(encoder, 4, [(256, 256), (300, 200)])
    assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))


def test_a_background_compile_never_meets_a_pack(qwen3):
    """With a compiled forward (dynamo, "eager" backend) the warm-up compiles in its thread while
    packs run: they take the uncompiled eager route or live graphs meanwhile, never a compile and
    never a compiled call (dynamo's stance is process-global), and all agree with transformers.
    From full speed on, the compiled routes serve."""
    encoder, reference = qwen3
    torch._dynamo.reset()
    compiled = encoder.compiled_forward(functools.partial(torch.compile, backend="eager", dynamic=True))
    runner = EncoderRunner(encoder, GraphConfig(budgets=(64, 256)), compiled_forward=compiled)
    runner.prepare(progress=lambda message: None)
    thread = threading.Thread(target=runner.warm_up, kwargs={"progress": lambda message: None}, daemon=True)
    packs = [images(encoder, 5, [(256, 256)]), images(encoder, 6, [(500, 500), (500, 500)])]
    thread.start()
    during: list = []
    routes = serve_while(thread, runner, reference, packs, during)
    thread.join()
    assert routes and during and runner.stats.recompile_fallbacks == 0
    assert not any(stats.compiled or stats.recompile_fallback for stats in during)
    assert runner.warmup_status().compiled and runner.warmup_status().exact_route
    pixels, specs = packs[1]  # oversize, equal images: the compiled exact route now
    assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    assert runner.stats.last.compiled
    torch._dynamo.reset()


def test_what_the_warm_up_compiles_serves_the_shared_buffers_without_recompiling(qwen3):
    """The warm-up compiles each layout on private inputs; packs then run on the shared static
    buffers' views. Dynamo guards on a view's base (its size against the view's), so the private
    inputs must be views of bases sized as the shared ones, or every graph would recompile on its
    first pack (and fall back to the uncompiled forward). Without the self-check nothing else
    touches the shared views before the packs do."""
    encoder, reference = qwen3
    torch._dynamo.reset()
    compiled = encoder.compiled_forward(functools.partial(torch.compile, backend="eager", dynamic=True))
    config = GraphConfig(budgets=(64, 128, 256), self_check=False, compile_exact=False)
    runner = EncoderRunner(encoder, config, compiled_forward=compiled)
    runner.prepare(progress=lambda message: None)
    runner.warm_up(progress=lambda message: None)
    for seed, sizes in enumerate([[(200, 200)], [(300, 260)], [(400, 380)]]):
        pixels, specs = images(encoder, seed, sizes)
        assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
        assert runner.stats.last.graph or runner.stats.last.compiled
    assert runner.stats.recompile_fallbacks == 0
    torch._dynamo.reset()


class RunningCapture:
    """A stand-in for `GraphCapture` on CPU: its warm run and its "capture" run the forward (no
    graph is kept), so the warm-up's capture path runs as on a GPU, dynamo stances included."""

    started = True

    def warm(self, run) -> None:
        run()

    def capture(self, entry, run) -> int:
        run()
        return 0

    def pool_bytes(self) -> int:
        return 0


def test_a_capture_that_would_compile_compiles_outside_the_lock_and_keeps_the_compiled_forward(qwen3):
    """With graphs, a layout is not compiled ahead of its capture; where the capture finds the
    compiled forward would compile (here: dynamo's caches dropped after the compile stage), the
    warm-up compiles it outside the lock and captures again with the compiled forward, which
    then serves that budget's packs and agrees with transformers."""
    encoder, reference = qwen3
    torch._dynamo.reset()
    compiled = encoder.compiled_forward(functools.partial(torch.compile, backend="eager", dynamic=True))
    config = GraphConfig(budgets=(64, 256), compile_exact=False)
    runner = EncoderRunner(encoder, config, compiled_forward=compiled)
    runner.capture = RunningCapture()
    compile_stage = runner.warmup._compile

    def compile_then_forget(*args):
        compile_stage(*args)
        torch._dynamo.reset()

    runner.warmup._compile = compile_then_forget
    try:
        runner.prepare(progress=lambda message: None)
        runner.warm_up(progress=lambda message: None)
        assert runner.stats.layout_compiles >= 1 and runner.stats.recompile_fallbacks == 0
        assert all(e.live and e.forward is None for e in runner.entries.values())
        pixels, specs = images(encoder, 11, [(256, 256)])
        assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
    finally:
        torch._dynamo.reset()


class Replay:
    """A CPU "graph": its replay runs what was captured."""

    def __init__(self, run):
        self.run = run

    def replay(self) -> None:
        self.run()


class ReplayingCapture:
    """A stand-in for `GraphCapture` on CPU whose captures run nothing, as on a GPU, and whose
    graphs replay what they captured: a check that read the shared outputs after another graph's
    replay or a warm run would compare the wrong rows. The `fail_once` keys fail their first
    capture (as a lazy initialisation inside one does), so a warm run comes mid-warm-up;
    `corrupt` keys' graphs scale their tokens after the forward."""

    def __init__(self, fail_once=(), corrupt=()):
        self.started = False
        self.fail_once, self.corrupt = set(fail_once), set(corrupt)
        self.warm_runs = 0
        self.captures: list = []
        self.warming = False

    def warm(self, run) -> None:
        self.warm_runs += 1
        self.started, self.warming = True, True
        try:
            run()
        finally:
            self.warming = False

    def capture(self, entry, run) -> int:
        self.captures.append(entry.key)
        if entry.key in self.fail_once:
            self.fail_once.discard(entry.key)
            raise RuntimeError("operation not permitted when stream is capturing")
        if entry.key in self.corrupt:
            entry.graph = Replay(lambda: (run(), entry.outputs["tokens"].mul_(1.5)))
        else:
            entry.graph = Replay(run)
        self.started = True
        return 0

    def pool_bytes(self) -> int:
        return 0


class SettlingLock:
    """The device lock, asserting at each outermost release that no graph's checked run is left
    launched and unread (the serving thread would then overwrite the outputs it compares)."""

    def __init__(self, launched: list):
        self._lock, self._depth, self.launched = threading.RLock(), 0, launched

    def __enter__(self):
        self._lock.acquire()
        self._depth += 1

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0 and exc[0] is None:
            assert all(launch.passed is not None for launch in self.launched), "a check left unread"
        self._lock.release()


def pipelined_runner(encoder, capture: ReplayingCapture, config: GraphConfig = SMALL_LADDER) -> EncoderRunner:
    """A runner whose warm-up checks graphs as on a GPU: each graph's checked run is launched
    before the next capture and read after it (the forward stands in for a compiled one, so that
    graphs are checked on CPU). `runner.launched`: the checked runs launched."""
    runner = EncoderRunner(encoder, config, compiled_forward=encoder.forward_padded)
    runner.capture = capture
    forward_into = runner.io.forward_into

    def forward_checked(entry):  # a warm run sees an empty pack, not another graph's sample
        assert not capture.warming or not entry.inputs["pixel_values"].any(), "a warm run on a sample"
        forward_into(entry)

    runner.io.forward_into = forward_checked
    launched: list = []
    launch = runner.warmup.checks.launch

    def recorded(*args):
        launched.append(launch(*args))
        return launched[-1]

    runner.warmup.checks.launch = recorded
    runner.device_lock = SettlingLock(launched)
    runner.prepare(progress=lambda message: None)
    runner.warm_up(progress=lambda message: None)
    assert all(launch.passed is not None for launch in launched)
    runner.launched = launched
    return runner


def test_each_graph_is_checked_on_its_own_rows_while_the_next_is_captured(qwen3):
    encoder, reference = qwen3
    keys = sorted(EncoderRunner(encoder, SMALL_LADDER).table.entries)
    # the largest is captured first, then the smallest up: the second smallest fails once and is
    # captured again after a warm run, which writes the shared outputs while the smallest's
    # checked run waits to be read
    capture = ReplayingCapture(fail_once=[keys[1]])
    runner = pipelined_runner(encoder, capture)
    entries = runner.table.entries.values()
    assert len(runner.launched) == len(keys)
    assert capture.warm_runs == 2 and runner.table.live_count() == len(keys)
    assert sorted(capture.captures) == sorted([*keys, keys[1]])  # each once, the failed one twice
    assert all(e.self_check_error <= 1e-4 for e in entries) and all(e.replay_ms >= 0 for e in entries)
    for seed, sizes in enumerate([[(200, 200)], [(300, 260), (120, 90)]]):
        pixels, specs = images(encoder, seed, sizes)
        assert_matches_reference(reference, pixels, specs, runner.run(pixels, specs))
        assert runner.stats.last.graph


def test_a_wrong_graph_fails_its_overlapped_check_and_only_it(qwen3):
    encoder, _ = qwen3
    keys = sorted(EncoderRunner(encoder, SMALL_LADDER).table.entries)
    runner = pipelined_runner(encoder, ReplayingCapture(corrupt=[keys[2], keys[-1]]))
    assert {k for k, e in runner.table.entries.items() if not e.enabled} == {keys[2], keys[-1]}
    assert runner.warmup_status().full_speed


def only_record(runner):
    """The one warm-up record in the runner's compile cache directory."""
    (record,) = runner.compile_cache.path.glob("warmup-*.json")
    return record


def test_a_later_start_captures_on_the_warm_up_record_and_checks_each_graph_on_its_first_pack(
    qwen3, tmp_path, monkeypatch
):
    """The first warm-up with a compile cache checks and times every graph and records it; a later
    runner of the same graphs captures them without a checked run, takes the recorded times and
    the exact route's smallest pack, and checks each graph on its first real pack instead: a graph
    that went wrong in the later capture is caught there, disabled, its pack served eagerly, as
    transformers computes it, and the record removed. Triton's cache is left where Triton keeps it,
    on the node: never pointed into the (shared) compile cache."""
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    encoder, reference = qwen3
    config = GraphConfig(max_budget_tokens=512, fine_budget_steps=1, compile_cache=str(tmp_path / "cache"))
    first = pipelined_runner(encoder, ReplayingCapture(), config)
    assert len(first.launched) == len(first.table.entries) and not first.warmup_status().from_record
    assert "TRITON_CACHE_DIR" not in os.environ
    assert [p.relative_to(tmp_path / "cache") for p in (tmp_path / "cache").rglob("*")] == [
        first.compile_cache.path.parent.relative_to(tmp_path / "cache"),
        first.compile_cache.path.relative_to(tmp_path / "cache"),
        only_record(first).relative_to(tmp_path / "cache"),
    ]
    times = {key: entry.replay_ms for key, entry in first.table.entries.items()}
    record = only_record(first)

    keys = sorted(times)
    later = pipelined_runner(encoder, ReplayingCapture(corrupt=[keys[0]]), config)
    status = later.warmup_status()
    assert status.from_record and status.full_speed and later.launched == []
    assert later.table.live_count() == len(keys)
    assert all(math.isnan(entry.self_check_error) for entry in later.table.entries.values())  # none checked
    assert {key: entry.replay_ms for key, entry in later.table.entries.items()} == times
    assert later.exact.live and later.exact.min_rows == first.exact.min_rows
    served = 0
    for seed, sizes in enumerate([[(200, 200)], [(300, 260), (120, 90)], [(64, 64)], [(64, 64)]]):
        pixels, specs = images(encoder, seed, sizes)
        assert_matches_reference(reference, pixels, specs, later.run(pixels, specs))
        served += later.stats.last.graph
        assert record.exists() == (later.stats.first_pack_mismatches == 0)
    assert served and later.stats.first_pack_checks >= 1 and later.stats.first_pack_mismatches == 1
    assert not later.table.entries[keys[0]].enabled and not record.exists()


def test_a_record_is_used_only_for_its_own_code_and_settings_and_what_it_refused_is_checked(
    qwen3, tmp_path, monkeypatch
):
    """Under other code, another tolerance, with `reuse_checks` off, or with a record that is
    unreadable (one that breaks the JSON parser too) or not signed with our key, every graph is
    checked again and the warm-up reaches full speed; a graph the record has as refused is
    checked, and an exact route it has as refused is checked at every budget as on a first start."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    encoder, _ = qwen3
    config = GraphConfig(max_budget_tokens=512, fine_budget_steps=1, compile_cache=str(tmp_path / "cache"))
    first = pipelined_runner(encoder, ReplayingCapture(), config)
    record = only_record(first)
    made = json.loads(first.compile_cache.read(record.name))
    checked = len(first.launched)

    def launched_after_writing(config, blob=made, signed=True) -> int:
        text = (blob if isinstance(blob, str) else json.dumps(blob)).encode()
        if signed:
            first.compile_cache.write(record.name, text)
        else:
            record.write_bytes(text)
        runner = pipelined_runner(encoder, ReplayingCapture(), config)
        assert runner.warmup_status().full_speed
        return len(runner.launched)

    assert launched_after_writing(config) == 0
    with monkeypatch.context() as patched:
        patched.setattr("encoder_graphs.warmup_record.fingerprint", lambda settings: "0123456789")
        assert launched_after_writing(config) == checked
    assert launched_after_writing(GraphConfig(**{**config.__dict__, "self_check_tolerance": 0.1})) == checked
    assert launched_after_writing(GraphConfig(**{**config.__dict__, "reuse_checks": False})) == checked
    for unreadable in ("[]", "[" * 100000 + "]" * 100000, json.dumps({**made, "costs": []})):  # the 2nd: RecursionError
        assert launched_after_writing(config, unreadable) == checked
    assert launched_after_writing(config, signed=False) == checked
    refused = {**made, "graphs": [{**graph, "live": i != 1} for i, graph in enumerate(made["graphs"])]}
    assert launched_after_writing(config, refused) == 1

    from encoder_graphs.exact_route import ExactRoute

    exact_runs = []
    run_compiled = ExactRoute.run_compiled
    monkeypatch.setattr(ExactRoute, "run_compiled", lambda *a: exact_runs.append(1) or run_compiled(*a))
    launched_after_writing(config)
    on_record = len(exact_runs)
    exact_runs.clear()
    launched_after_writing(config, {**made, "exact_min_rows": None})
    assert 1 == on_record < len(exact_runs)
