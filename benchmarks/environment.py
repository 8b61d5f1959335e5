"""What every saved benchmark result records first: the command, the device, the versions, the date."""

from __future__ import annotations

import os
import platform
import sys
import time
from importlib import metadata

import torch
import transformers


def environment() -> dict:
    from deployments.http import http_ingress  # Ray's flags, as the service started from here reads them

    return {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ray": _version("ray"),
        "triton": _version("triton"),
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "cpus": len(os.sched_getaffinity(0)),  # the CPUs this process may use
        "http_ingress": http_ingress(),
        "date": time.strftime("%Y-%m-%d"),
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
