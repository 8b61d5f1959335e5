"""What benchmark results record about the host's NUMA layout (benchmarks/environment.py)."""

from benchmarks.environment import numa_cpus, parse_cpulist


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

