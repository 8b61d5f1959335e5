"""One command line for the tools: each tool runs through it as through its own module."""

import subprocess
import sys

from deployments.cli import TOOLS, main
from deployments.config import reference_markdown


def test_validate_and_config_reference_through_the_one_entry_point(capsys):
    assert main(["validate", "configs/local.yaml"]) == 0
    assert capsys.readouterr().out.strip() == "ok: configs/local.yaml"
    assert main(["config-reference"]) == 0
    assert capsys.readouterr().out.strip() == reference_markdown().strip()


def test_a_bad_config_fails_and_an_unknown_tool_lists_the_tools(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "applications:\n  - name: a\n    import_path: deployments.app:build_app\n    args: {model: {famly: qwen3-vl}}\n"
    )
    assert main(["validate", str(bad)]) == 1
    assert "famly" in capsys.readouterr().out
    assert main(["no-such-tool"]) == 2
    listed = capsys.readouterr().err
    assert all(name in listed for name in TOOLS)


def test_python_dash_m_deployments_runs_a_tool():
    done = subprocess.run(
        [sys.executable, "-m", "deployments", "validate", "configs/local.yaml"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "ok: configs/local.yaml" in done.stdout, done.stderr[-2000:]
