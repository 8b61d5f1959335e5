"""One Ray cluster and one Serve instance per test session; applications deployed from our YAMLs.

`deploy("configs/local.yaml")` reads the YAML exactly as `serve run` does (ServeDeploySchema),
and deploys it through Serve's config path (the controller imports `deployments.app:build_app`
and applies the YAML's `deployments:` overrides). Several YAMLs can be live at once: the
harness deploys the union of every application asked for so far; an application whose
config did not change is left running.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import ray
import yaml
from ray import serve
from ray.serve._private import api as serve_api
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeHarness:
    current: ServeHarness | None = None
    """The session's harness once a test has asked for it."""

    def __init__(self, num_cpus: int | None = 4, deploy_timeout_s: float = 180):
        """`num_cpus`: logical CPUs of the local cluster (tests use 4 with `num_cpus: 0` replicas;
        None lets Ray count the machine's cores, as on a GPU host). `deploy_timeout_s`: how long
        `deploy` waits for the application to run (a compiled GPU replica's startup is minutes)."""
        self.deploy_timeout_s = deploy_timeout_s
        self.metrics_port = free_port()
        if not ray.is_initialized():
            ray.init(
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                _metrics_export_port=self.metrics_port,
                _system_config={"metrics_report_interval_ms": 1000},
            )
        self.port = free_port()
        self.http_options = {"host": "127.0.0.1", "port": self.port}
        self.client = serve_api.serve_start(http_options=self.http_options, proxy_location="HeadOnly")
        self.apps: dict[str, ServeApplicationSchema] = {}
        ServeHarness.current = self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def deploy(
        self,
        yaml_path: str,
        name: str | None = None,
        route_prefix: str | None = None,
        deployments: dict[str, dict] | None = None,
        wait: bool = True,
        deployment_entries: list[dict] | None = None,
        **overrides,
    ) -> str:
        """Deploy the YAML's (first) application; returns its base URL. `overrides` merge into its
        `args`; `deployments` merges Serve options into its `deployments:` entries by name, and
        `deployment_entries` replaces those entries first. `wait=False`: return at once (for
        applications that are meant to fail)."""
        config = yaml.safe_load((ROOT / yaml_path).read_text())
        app = dict(config["applications"][0])
        app["name"] = name or app["name"]
        app["route_prefix"] = route_prefix or app.get("route_prefix", "/")
        app["args"] = _merge(app.get("args", {}), overrides)
        if deployment_entries is not None:
            app["deployments"] = deployment_entries
        for entry in app.get("deployments", []):
            entry.update((deployments or {}).get(entry["name"], {}))
        schema = ServeApplicationSchema.model_validate(app)
        if self.apps.get(schema.name) != schema:
            self.apps[schema.name] = schema
            deploy = ServeDeploySchema(
                applications=list(self.apps.values()), http_options=self.http_options, proxy_location="HeadOnly"
            )
            self.client.deploy_apps(deploy, _blocking=False)
        url = self.base_url + (schema.route_prefix.rstrip("/") if schema.route_prefix != "/" else "")
        if wait:
            self.wait_running(schema.name, self.deploy_timeout_s)
            self.wait_healthy(url, self.deploy_timeout_s)
        return url

    def wait_healthy(self, url: str, timeout_s: float = 30) -> None:
        """Until the router answers `/health` 200: Serve reports the application RUNNING before the
        router's own reading of the encoder replicas (every `fleet.REFRESH_S`) has seen one run."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{url}/health not 200 after {timeout_s} s")

    def remove(self, name: str) -> None:
        """Delete an application (and stop redeploying it with the others)."""
        if self.apps.pop(name, None) is not None:  # the declarative config without it deletes it
            deploy = ServeDeploySchema(
                applications=list(self.apps.values()), http_options=self.http_options, proxy_location="HeadOnly"
            )
            self.client.deploy_apps(deploy, _blocking=False)

    def wait_running(self, name: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            app = serve.status().applications.get(name)
            if app is not None and app.status == "RUNNING":
                return
            if app is not None and app.status == "DEPLOY_FAILED":
                raise RuntimeError(f"application {name} failed to deploy: {app.message}")
            time.sleep(0.5)
        raise TimeoutError(
            f"application {name} not running after {timeout_s} s: {serve.status().applications.get(name)}"
        )

    def http(self, timeout: float = 120, **options) -> httpx.Client:
        return httpx.Client(timeout=timeout, **options)


REMOVE = object()
"""An override value that removes the key from the YAML's `args` (e.g. a GPU-only engine argument on CPU)."""
UNCOMPILED = {"compile": False, "precompile_regions": False}
"""`graphs` overrides for a GPU config run on CPU or against a reference: the tower uncompiled, as the
references run it (compiling costs minutes on a small CPU host and is not what those tests check)."""


def _merge(base: dict, overrides: dict) -> dict:
    merged = dict(base)
    for key, value in overrides.items():
        if value is REMOVE:
            merged.pop(key, None)
            continue
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merge(merged[key], value) if both else value  # a dict replaces a number
    return merged
