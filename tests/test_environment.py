"""What benchmark results record about the host (benchmarks/environment.py)."""

import subprocess
import sys

from benchmarks.environment import commit, has_bytecode, numa_cpus, parse_cpulist


def test_cpulists_parse_as_the_kernel_writes_them():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("\n") == []


def test_numa_nodes_are_read_from_a_sysfs_tree(tmp_path):
    for node, cpulist in ((0, "0-15,32-47"), (1, "16-31,48-63")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    (tmp_path / "possible").write_text("0-1\n")
    assert numa_cpus(str(tmp_path)) == {0: 32, 1: 32}
    assert numa_cpus(str(tmp_path / "absent")) == {}


def test_the_commit_is_git_s_and_marks_changed_files(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no checkout around tmp_path counts

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    assert commit(str(tmp_path)) is None  # not a checkout
    git("init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert commit(str(tmp_path)) == head
    (tmp_path / "b.txt").write_text("untracked\n")
    assert commit(str(tmp_path)) == head
    (tmp_path / "a.txt").write_text("two\n")
    assert commit(str(tmp_path)) == head + "+dirty"


def test_bytecode_is_found_where_a_package_was_compiled(tmp_path, monkeypatch):
    package = tmp_path / "compiled_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert has_bytecode("compiled_pkg") is False
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], check=True)
    assert has_bytecode("compiled_pkg") is True
    assert has_bytecode("no_such_package_here") is None
