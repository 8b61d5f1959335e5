"""What benchmark results record about the host (benchmarks/common/environment.py)."""

import os
import shutil
import subprocess

import pytest

from benchmarks.common.environment import commit, numa_cpus, parse_cpulist, tree


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


@pytest.fixture
def git_env(monkeypatch, tmp_path):
    """git as a bare install runs it: no user or system configuration, no checkout around tmp_path."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))

    def git(where, *args):
        return subprocess.run(
            ["git", "-C", str(where), "-c", "user.name=t", "-c", "user.email=t@t", *args],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    return git


def test_the_commit_is_git_s_and_marks_changed_files(tmp_path, git_env):
    assert commit(str(tmp_path)) is None  # not a checkout
    git_env(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git_env(tmp_path, "add", "a.txt")
    git_env(tmp_path, "commit", "-q", "-m", "one")
    head = git_env(tmp_path, "rev-parse", "--short", "HEAD")
    assert commit(str(tmp_path)) == head
    (tmp_path / "b.txt").write_text("untracked\n")
    assert commit(str(tmp_path)) == head
    (tmp_path / "a.txt").write_text("two\n")
    assert commit(str(tmp_path)) == head + "+dirty"


def test_a_copy_inside_another_checkout_has_no_commit(tmp_path, git_env):
    git_env(tmp_path, "init", "-q")
    (tmp_path / "copy").mkdir()
    assert commit(str(tmp_path / "copy")) is None


def test_no_git_no_commit(tmp_path, git_env, monkeypatch):
    git_env(tmp_path, "init", "-q")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert commit(str(tmp_path)) is None


def test_the_tree_names_the_code_as_it_is_even_where_history_is_stale(tmp_path, git_env):
    assert tree(str(tmp_path)) is None  # not a checkout
    git_env(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("scratch/\n")
    (tmp_path / "a.txt").write_text("one\n")
    git_env(tmp_path, "add", "-A")
    git_env(tmp_path, "commit", "-q", "-m", "one")
    assert tree(str(tmp_path)) == git_env(tmp_path, "rev-parse", "HEAD^{tree}")
    # a newer commit's files over an older .git (as a copy of the working tree with a stale
    # history): the tree is the newer commit's, found by its tree hash
    written = (tmp_path / "a.txt").stat().st_mtime_ns
    (tmp_path / "a.txt").write_text("two\n")
    # rewritten within the timestamp resolution of the index's write (same size, same mtime, as
    # a fast write on a filesystem or a git without nanoseconds sees it): git's racy check must
    # still see the change, which needs the index's own mtime
    git_env(tmp_path, "config", "core.trustctime", "false")
    os.utime(tmp_path / "a.txt", ns=(written, written))
    os.utime(tmp_path / ".git" / "index", ns=(written, written))
    (tmp_path / "new.txt").write_text("new\n")
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "probe.txt").write_text("ignored\n")
    objects = sorted(p.name for p in (tmp_path / ".git" / "objects").rglob("*"))
    ran = tree(str(tmp_path))
    assert not git_env(tmp_path, "diff", "--cached", "--name-only")  # the checkout's index is untouched
    assert sorted(p.name for p in (tmp_path / ".git" / "objects").rglob("*")) == objects  # and its objects
    git_env(tmp_path, "add", "-A")
    git_env(tmp_path, "commit", "-q", "-m", "two")
    assert ran == git_env(tmp_path, "rev-parse", "HEAD^{tree}")
