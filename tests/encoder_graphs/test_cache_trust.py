"""The compile cache's key: signatures that refuse what another key or a changed byte made, an
operator's key file shared by nodes, and a per-node key made once, private to the service user."""

from __future__ import annotations

import logging
import os
import stat
import threading

import pytest

from encoder_graphs.cache_trust import HEADER, NODE_KEY, CacheKeyError, Signer, Untrusted, node_key, signer

KEY = b"0123456789abcdef" * 4


def test_a_signature_holds_for_its_name_and_bytes_only():
    key = Signer(KEY, "test")
    signed = key.sign("k/artifacts.bin", b"payload")
    assert signed.startswith(HEADER) and key.verify("k/artifacts.bin", signed) == b"payload"
    assert signed.count(b"\n") == 1 and b"payload" not in signed.split(b"\n")[0]
    refused = {
        "unsigned": (b"payload", "no signature header"),
        "short": (HEADER + b"ab\n", "no signature header"),
        "other name": (key.sign("other/artifacts.bin", b"payload"), "does not match"),
        "other key": (Signer(KEY[::-1], "other").sign("k/artifacts.bin", b"payload"), "does not match"),
        "a byte changed": (signed[:-1] + b"P", "does not match"),
        "a byte added": (signed + b"\n", "does not match"),
        "header changed": (signed.replace(b"v1", b"v2"), "no signature header"),
    }
    for case, (blob, why) in refused.items():
        with pytest.raises(Untrusted, match=why):
            key.verify("k/artifacts.bin", blob)
            pytest.fail(case)


def test_a_key_id_names_the_key_without_revealing_it():
    assert Signer(KEY, "a").key_id == Signer(KEY, "b").key_id != Signer(KEY[::-1], "a").key_id
    assert KEY.hex()[:16] not in Signer(KEY, "a").key_id and len(Signer(KEY, "a").key_id) == 16


def test_a_key_file_is_shared_by_nodes_and_its_faults_are_configuration_errors(tmp_path, monkeypatch):
    key_file = tmp_path / "secret" / "key"
    key_file.parent.mkdir()
    key_file.write_bytes(KEY + b"\n")
    key_file.chmod(0o644)  # as a Kubernetes secret is mounted by default: the operator's to manage
    found = []
    for node in ("node1", "node2"):
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / node))
        found.append(signer(str(key_file), tmp_path / "cache"))
    assert found[0].key == found[1].key == KEY and str(key_file) in found[0].source
    assert not (tmp_path / "node1").exists()  # no node key made where a key file is given
    key_file.write_bytes(b"short\n")
    with pytest.raises(CacheKeyError, match=r"compile_cache_key_file .*key: holds 5 bytes, fewer than 32"):
        signer(str(key_file), tmp_path / "cache")
    with pytest.raises(CacheKeyError, match="No such file"):
        signer(str(tmp_path / "absent"), tmp_path / "cache")
    inside = tmp_path / "cache" / "key"
    inside.parent.mkdir()
    inside.write_bytes(KEY)
    with pytest.raises(CacheKeyError, match="inside graphs.compile_cache"):
        signer(str(inside), tmp_path / "cache")


def test_a_node_key_is_made_once_private_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    path = tmp_path / "state" / NODE_KEY
    made = []
    threads = [threading.Thread(target=lambda: made.append(signer(None, tmp_path / "cache"))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({s.key for s in made}) == 1 and len(made[0].key) >= 32 and str(path) in made[0].source
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporaries left
    assert node_key(path) == made[0].key
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "other"))
    assert signer(None, tmp_path / "cache").key != made[0].key  # another node: another key


def test_a_node_key_others_may_read_a_link_or_one_inside_the_cache_is_refused_and_the_cache_goes_unused(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    path = tmp_path / "state" / NODE_KEY
    node_key(path)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert signer(None, tmp_path / "cache") is None
    assert "compile cache" in caplog.text and "mode 0600" in caplog.text and str(path) in caplog.text
    (tmp_path / "planted").write_bytes(KEY)
    (tmp_path / "planted").chmod(0o600)
    path.unlink()
    os.symlink(tmp_path / "planted", path)
    with pytest.raises(ValueError, match="regular file"):
        node_key(path)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "cache" / "state"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert signer(None, tmp_path / "cache") is None  # a node key inside the cache it signs
    assert "inside graphs.compile_cache" in caplog.text and not (tmp_path / "cache").exists()
