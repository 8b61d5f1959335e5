"""What every saved benchmark result records first: the command, the device, the versions, the date."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata

import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def environment() -> dict:
    from deployments.router.http import http_ingress  # Ray's flags, as the service started from here reads them

    return {
        "command": " ".join(sys.argv),
        "commit": commit(ROOT),
        "tree": tree(ROOT),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ray": _version("ray"),
        "triton": _version("triton"),
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "cpus": len(os.sched_getaffinity(0)),  # the CPUs this process may use
        "numa_nodes": len(numa_cpus()),
        "gpu_numa_nodes": gpu_numa_nodes(),  # a replica's host work runs where its GPU is attached, or not
        "http_ingress": http_ingress(),
        # set: no process keeps the .pyc it compiles, so every Ray worker compiles its sources as it starts
        "dont_write_bytecode": bool(sys.flags.dont_write_bytecode),
        "date": time.strftime("%Y-%m-%d"),
    }


def numa_cpus(root: str = "/sys/devices/system/node") -> dict[int, int]:
    """CPUs per NUMA node, from sysfs; empty where it is not there."""
    nodes = {}
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        if name.startswith("node") and name[4:].isdigit():
            with open(os.path.join(root, name, "cpulist")) as cpulist:
                nodes[int(name[4:])] = len(parse_cpulist(cpulist.read()))
    return nodes


def parse_cpulist(text: str) -> list[int]:
    """The CPUs of a kernel cpulist such as "0-15,32-47" (empty for an empty list)."""
    cpus = []
    for part in filter(None, text.strip().split(",")):
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def gpu_numa_nodes() -> list[int]:
    """The NUMA node each visible GPU is attached to (-1: the kernel does not say)."""
    nodes = []
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(index)
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        try:
            with open(f"/sys/bus/pci/devices/{bus}/numa_node") as node:
                nodes.append(int(node.read()))
        except (OSError, ValueError):
            nodes.append(-1)
    return nodes


def _git(root: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "--no-optional-locks", "-C", root, *args], capture_output=True, text=True, timeout=10, env=env
    )


def _is_checkout_top(root: str) -> bool:
    """Whether `root` is a checkout's top (a copy inside some other repository is not)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    return top.returncode == 0 and os.path.realpath(top.stdout.strip()) == os.path.realpath(root)


def commit(root: str) -> str | None:
    """The checkout's commit at `root`, "+dirty" where tracked files differ from it ("+unknown":
    git could not say); None where `root` is not itself a checkout's top (a copy inside some other
    repository reports nothing, not that repository's commit) or git is missing."""
    try:
        if not _is_checkout_top(root):
            return None
        head = _git(root, "rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return None
        changed = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    if changed.returncode != 0:
        return head.stdout.strip() + "+unknown"
    return head.stdout.strip() + ("+dirty" if changed.stdout.strip() else "")


def tree(root: str) -> str | None:
    """The git tree hash of the checkout's files as they are, tracked or not unless ignored (a
    nested repository counts at its commit): it names the code that ran also where the checkout's
    history is stale (`git log --all --format='%H %T'` finds a committed tree). Hashed through a
    scratch index and object folder: the checkout's index and objects are left as they were.
    None as for `commit`."""
    try:
        if not _is_checkout_top(root):
            return None
        objects = _git(root, "rev-parse", "--git-path", "objects")
        index = _git(root, "rev-parse", "--git-path", "index")
        if objects.returncode != 0 or index.returncode != 0:
            return None
        with tempfile.TemporaryDirectory() as scratch:
            scratch_index = os.path.join(scratch, "index")
            with contextlib.suppress(OSError):  # stat data spares hashing; its mtime keeps git's racy check
                shutil.copy2(os.path.join(root, index.stdout.strip()), scratch_index)
            os.mkdir(os.path.join(scratch, "objects"))
            env = {
                **os.environ,
                "GIT_INDEX_FILE": scratch_index,
                "GIT_OBJECT_DIRECTORY": os.path.join(scratch, "objects"),
                "GIT_ALTERNATE_OBJECT_DIRECTORIES": os.path.join(root, objects.stdout.strip()),
            }
            if _git(root, "add", "-A", env=env).returncode != 0:
                return None
            written = _git(root, "write-tree", env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return written.stdout.strip() if written.returncode == 0 else None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
