"""The package's module graph: no import circle, the serving path and the warm-up never import each
other (`EncoderRunner` wires them over their shared parts), and no module over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "encoder_graphs"
MAX_LINES = 500


def package_imports() -> dict[str, set[str]]:
    """Each module of `encoder_graphs` and the package modules it imports (at any depth in its
    source: a lazy or TYPE_CHECKING import counts too)."""
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module:  # from .name import ...
                    found.add(node.module.split(".")[0])
                elif node.level == 1:  # from . import name
                    found.update(alias.name for alias in node.names)
                elif node.module and node.module.startswith("encoder_graphs."):
                    found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("encoder_graphs."))
        graph[path.stem] = found & modules - {path.stem}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for name in graph[todo.pop()]:
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def test_no_module_of_encoder_graphs_imports_itself_through_others():
    graph = package_imports()
    assert {"runner", "serving", "warmup", "parts"} <= graph.keys()
    circles = sorted(name for name in graph if name in reachable(graph, name))
    assert circles == [], circles


def test_the_serving_path_and_the_warm_up_know_only_their_shared_parts():
    graph = package_imports()
    assert not {"warmup", "runner", "warm_capture", "graph_checks"} & reachable(graph, "serving")
    assert not {"serving", "runner"} & reachable(graph, "warmup")
    assert {"serving", "warmup", "parts"} <= graph["runner"]


def test_no_module_of_encoder_graphs_is_over_500_lines():
    lengths = {path.name: len(path.read_text().splitlines()) for path in PACKAGE.glob("*.py")}
    assert not {name: n for name, n in lengths.items() if n > MAX_LINES}
