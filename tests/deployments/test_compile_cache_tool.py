"""The pre-build tool signs with the key replicas will verify with, and says so; a key it cannot
use stops it before the model loads."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from deployments.encoder.compile_cache import main
from encoder_graphs.cache_trust import NODE_KEY, Signer, read_key

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cpu_config(tmp_path) -> Path:
    """`configs/local.yaml` (the tiny tower on CPU) with a compile cache under `tmp_path`."""
    config = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    config["applications"][0]["args"]["graphs"] = {
        "max_budget_tokens": 256,
        "fine_budget_steps": 1,
        "compile": True,
        "compile_cache": str(tmp_path / "cache"),
    }
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_it_signs_with_the_key_file_replicas_hold(cpu_config, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    key_file = tmp_path / "cluster.key"
    key_file.write_text("ab" * 32 + "\n")
    assert main(["--config", str(cpu_config), "--key-file", str(key_file)]) == 0
    key_id = Signer(read_key(key_file), "cluster").key_id
    assert f"compile cache {tmp_path / 'cache' / key_id}/" in capsys.readouterr().out
    assert not (tmp_path / "state").exists()  # no node key made


def test_without_a_key_file_it_signs_with_this_machines_key_and_warns(
    cpu_config, tmp_path, monkeypatch, capsys, caplog
):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    with caplog.at_level(logging.WARNING):
        assert main(["--config", str(cpu_config)]) == 0
    assert "only replicas on this machine will trust what is saved" in caplog.text
    key_id = Signer(read_key(tmp_path / "state" / NODE_KEY), "node").key_id
    assert f"compile cache {tmp_path / 'cache' / key_id}/" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("key", "message"),
    [("short", "holds 5 bytes, fewer than 32"), (None, "No such file"), ("inside", "inside graphs.compile_cache")],
)
def test_a_key_it_cannot_use_stops_it_naming_the_file(cpu_config, tmp_path, monkeypatch, key, message):
    monkeypatch.setattr(
        "deployments.encoder.compile_cache.load_encoder", lambda config: pytest.fail("loaded the model")
    )
    key_file = tmp_path / ("cache" if key == "inside" else "") / "cluster.key"
    if key is not None:
        key_file.parent.mkdir(exist_ok=True)
        key_file.write_text("short" if key == "short" else "ab" * 32)
    with pytest.raises(SystemExit, match=f"graphs.compile_cache_key_file .*{message}"):
        main(["--config", str(cpu_config), "--key-file", str(key_file)])


def test_its_help_says_which_key_it_signs_with(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "compile_cache_key_file" in " ".join(capsys.readouterr().out.split())
