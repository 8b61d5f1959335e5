"""What every saved benchmark result records first: the command, the device, the versions, the date."""

from __future__ import annotations

import platform
import sys
import time

import torch
import transformers


def environment() -> dict:
    return {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
