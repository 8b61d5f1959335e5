"""The operator files beside the code: the Grafana dashboard queries only metrics the service exports
(names read from deployments/metrics.py, as Ray exports them), and the GPU image's Dockerfile installs
this package on the Ray and Python that pyproject.toml names."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "configs" / "grafana" / "vlm-encoder-serve.json"
SERVE_TAGS = {"application", "deployment", "replica"}
"""The tags `ray.serve.metrics` adds to every metric of a replica."""


def declared_metrics() -> dict[str, tuple[str, set[str]]]:
    """name -> (kind, tag keys) of every `Counter`/`Gauge`/`Histogram` made in deployments/metrics.py."""
    found = {}
    for node in ast.walk(ast.parse((ROOT / "deployments" / "metrics.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in {"Counter", "Gauge", "Histogram"}:
            tags = next((k.value for k in node.keywords if k.arg == "tag_keys"), None)
            keys = {e.value for e in tags.elts} if isinstance(tags, ast.Tuple) else set()
            found[node.args[0].value] = (node.func.id, keys)
    return found


def exported(name: str, kind: str) -> set[str]:
    """The series names Ray's Prometheus exporter gives a metric (custom metrics get `ray_`)."""
    base = f"ray_{name}"
    return {
        "Counter": {f"{base}_total"},
        "Gauge": {base},
        "Histogram": {f"{base}_{s}" for s in ("bucket", "sum", "count")},
    }[kind]


def queries(dashboard: dict) -> list[str]:
    panels = [p for row in dashboard["panels"] for p in [row, *row.get("panels", [])]]
    found = [t["expr"] for p in panels for t in p.get("targets", [])]
    return found + [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]


def test_the_dashboard_queries_only_exported_metrics_and_shows_every_one():
    dashboard = json.loads(DASHBOARD.read_text())
    metrics = declared_metrics()
    assert len(metrics) >= 20  # the parse found the module's metrics
    names = {series for name, (kind, _) in metrics.items() for series in exported(name, kind)}
    tags = SERVE_TAGS | {"le"} | {key for _, keys in metrics.values() for key in keys}
    used = set()
    for expr in queries(dashboard):
        series = set(re.findall(r"\bray_\w+", expr))
        assert series, f"a query names no ray_ metric: {expr}"
        assert series <= names, f"{sorted(series - names)} are not exported by deployments/metrics.py: {expr}"
        used |= series
        for labels in re.findall(r"\bby \(([^)]*)\)", expr):
            unknown = {label.strip() for label in labels.split(",")} - tags
            assert not unknown, f"labels {sorted(unknown)} are not on these metrics: {expr}"
    shown = {name for name, (kind, _) in metrics.items() if exported(name, kind) & used}
    assert shown == set(metrics), f"not on the dashboard: {sorted(set(metrics) - shown)}"


def test_the_dashboard_is_importable_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and "datasource" in variables
            assert panel["targets"] and all(t["refId"] for t in panel["targets"])
    for expr in queries(dashboard):
        assert expr.count("(") == expr.count(")"), expr
        for variable in re.findall(r"\$(\w+)", expr):
            assert variable in variables or variable.startswith("__"), f"${variable} is not defined: {expr}"


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of each instruction of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_the_dockerfile_builds_on_the_ray_image_pyproject_pins_and_installs_the_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ray_pin = next(d for d in project["dependencies"] if d.startswith("ray[serve]"))
    ray_minor = re.search(r"==(\d+\.\d+)", ray_pin).group(1)
    instructions = dockerfile()
    known = {
        "FROM",
        "ARG",
        "ENV",
        "WORKDIR",
        "COPY",
        "RUN",
        "USER",
        "EXPOSE",
        "CMD",
        "ENTRYPOINT",
        "LABEL",
        "HEALTHCHECK",
    }
    assert {kind for kind, _ in instructions} <= known
    assert instructions[0][0] in {"FROM", "ARG"}
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for kind, a in instructions if kind == "ARG" and "=" in a}
    (base,) = [a for kind, a in instructions if kind == "FROM"]
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert re.fullmatch(rf"rayproject/ray:{re.escape(ray_minor)}\.\d+-py3\d+-cu\d+", image), image
    python = re.search(r"-py3(\d+)", image).group(1)
    assert int(python) >= int(project["requires-python"].removeprefix(">=3.")), image
    copied = " ".join(a for kind, a in instructions if kind == "COPY")
    for needed in ("pyproject.toml", "README.md", "models", "encoder_graphs", "deployments", "configs"):
        assert needed in copied, f"COPY does not bring {needed}"
    installs = [a for kind, a in instructions if kind == "RUN" and "pip install" in a]
    assert any(re.search(r"pip install .*--no-cache-dir.* \"?\.(\[\w+(,\w+)*\])?\"?(\s|$)", a) for a in installs), (
        installs
    )
    extras = set(re.findall(r"\.\[([\w,]+)\]", " ".join(installs)))
    assert all(set(e.split(",")) <= set(project["optional-dependencies"]) for e in extras), extras
    assert any(kind == "EXPOSE" and "8000" in a.split() for kind, a in instructions)
    cmd = next(a for kind, a in instructions if kind == "CMD")
    config = re.search(r"configs/[\w.-]+\.yaml", cmd).group(0)
    assert (ROOT / config).is_file(), config
