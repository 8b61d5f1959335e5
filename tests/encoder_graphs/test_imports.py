"""Import boundaries: the budget and packing math needs neither torch nor transformers, and
`encoder_graphs` never imports transformers or `models.attention` (only `models.protocol`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_budgets_config_and_packing_import_without_torch_transformers_or_pydantic():
    """`sys.modules[name] = None` makes any import of that name fail, as if not installed."""
    code = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'pydantic', 'models'):\n"
        "    sys.modules[name] = None\n"
        "import encoder_graphs.budgets, encoder_graphs.config, encoder_graphs.packing\n"
        "from encoder_graphs import GraphConfig, budget_ladder, pack_items\n"
        "assert budget_ladder(GraphConfig(), 64).budgets[-1] == 8192\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr


def test_encoder_graphs_imports_neither_transformers_nor_models_attention():
    code = (
        "import importlib, pkgutil, sys\n"
        "import encoder_graphs\n"
        "for module in pkgutil.iter_modules(encoder_graphs.__path__):\n"
        "    importlib.import_module(f'encoder_graphs.{module.name}')\n"
        "found = [name for name in ('transformers', 'models.attention', 'models.qwen', 'ray') if name in sys.modules]\n"
        "assert not found, found\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
