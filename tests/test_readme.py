"""The README tells the truth: its test command is CI's, docs/configuration.md's reference is the
models', and each Python block runs, from a process of its own, against the YAML it names and prints
what the README says it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import ray

from deployments.config import REFERENCE_END, REFERENCE_START, reference_markdown
from tests.serve_harness import ROOT

README = (ROOT / "README.md").read_text()
CONFIGURATION = "docs/configuration.md"
BLOCK = re.compile(r"(?:<!-- readme-test: (\w+) -->\n)?```(\w+)\n(.*?)```", re.S)
OUTPUT = re.compile(r"\s*```text\n(.*?)```", re.S)
SERVED_AT = "http://127.0.0.1:8000"
APPS = {"local": ("configs/local.yaml", None), "epd": ("configs/epd.yaml", "readme-epd")}
"""What each tagged block runs against: the YAML (as `serve run` deploys it), and a name and route
of its own where the YAML's would collide with another application of the test session."""


def blocks(language: str) -> list[tuple[str | None, str, str | None]]:
    """(tag, code, the text block right after it) of each block in `language`."""
    found = []
    for match in BLOCK.finditer(README):
        if match.group(2) == language:
            after = OUTPUT.match(README, match.end())
            found.append((match.group(1), match.group(3), after.group(1) if after else None))
    return found


PYTHON = blocks("python")


def test_the_readme_test_command_is_what_ci_runs():
    commands = blocks("bash")[0][1].strip().splitlines()
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    assert commands[1] in ci and commands[0].endswith("serve run configs/local.yaml")
    assert ci[-1] == ".ci/vllm"  # and the vLLM step after it


def test_the_configuration_reference_is_the_models():
    text = (ROOT / CONFIGURATION).read_text()
    documented = text[text.index(REFERENCE_START) + len(REFERENCE_START) : text.index(REFERENCE_END)]
    assert documented == reference_markdown(), (
        f"regenerate it: python -m deployments config-reference --write {CONFIGURATION}"
    )


def test_the_readme_links_the_configuration_reference():
    assert f"]({CONFIGURATION})" in README and REFERENCE_START not in README


def test_every_python_block_names_what_it_runs_against():
    assert PYTHON and all(tag in APPS for tag, _, _ in PYTHON)


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_python_block_runs_and_prints_what_the_readme_says(index, serve_harness):
    tag, code, expected = PYTHON[index]
    config, name = APPS[tag]
    url = serve_harness.deploy(config, name=name, route_prefix=name and f"/{name}")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONPATH": path}
    try:
        done = subprocess.run(
            [sys.executable, "-c", code.replace(SERVED_AT, url)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        if name is not None:
            serve_harness.remove(name)
    assert done.returncode == 0, done.stderr[-3000:]
    if expected is not None:
        assert done.stdout.strip().splitlines()[-1] == expected.strip()
