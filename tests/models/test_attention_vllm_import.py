"""Looking for vLLM's FlashAttention-3 build (`attention: fa3`) leaves the process environment as it was.

Importing any of vLLM runs its package init, which sets environment variables for vLLM's own processes
(inductor's compile threads among them); an encoder that only asks for the kernel must not inherit
them. Each check runs in a fresh interpreter: vLLM's init runs once per process. Run by `.ci/vllm`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed; the vLLM CI step (.ci/vllm) installs it")

ROOT = Path(__file__).resolve().parents[2]


def changed_environment(code: str) -> dict:
    """Run `code` in a fresh interpreter, after importing `models.attention` (whose own imports may set
    variables, torch's inductor cache among them), and return the variables it changed, added or removed."""
    script = (
        "import json, os, sys\n"
        "from models.attention import fa3_varlen_function\n"
        "before = dict(os.environ)\n"
        f"{code}\n"
        "after = dict(os.environ)\n"
        "print(json.dumps({k: [before.get(k), after.get(k)] for k in set(before) | set(after)"
        " if before.get(k) != after.get(k)}))\n"
    )
    # A bare environment: this session may have imported vLLM already, whose variables a child would inherit.
    env = {key: os.environ[key] for key in ("PATH", "HOME", "LANG", "TMPDIR") if key in os.environ}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_vllm_changes_the_environment():
    """The control: without it the next test could not fail."""
    assert changed_environment("import vllm")


def test_looking_for_fa3_restores_the_environment():
    changed = changed_environment(
        "fa3_varlen_function()\nassert 'vllm' in sys.modules, 'the lookup did not import vLLM'"
    )
    assert changed == {}
