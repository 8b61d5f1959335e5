"""The KubeRay manifest (configs/kuberay/rayservice-gpu.yaml) is one a cluster accepts: its RayService
validates against KubeRay's published CRD schema, its embedded Serve config against Serve's schema and
ours, and it serves configs/multi-gpu.yaml's application with the pods, volumes and autoscaling that
application needs."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import jsonschema
import pytest
import yaml

from deployments.config import deployment_ladder
from deployments.validation import validate

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "configs/kuberay/rayservice-gpu.yaml"
CRD = ROOT / "tests/data/kuberay/ray.io_rayservices.yaml"
CRD_SHA256 = "0a8fc325e6e22b9231c1f282b309555e2ecf94227ca20a03df3d1d9a403907ab"
"""Of the published file (KubeRay v1.7.0), below the header our copy adds."""


def closed(schema):
    """The schema with every object that lists its properties closed to others: the API server's
    strict field validation (kubectl's default) refuses an unknown field, where a plain JSON Schema
    would let a misspelt key through. Objects marked `x-kubernetes-preserve-unknown-fields` stay open."""
    if isinstance(schema, list):
        return [closed(part) for part in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: closed(value) for key, value in schema.items()}
    open_ = schema.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in schema
    if "properties" in schema and not open_:
        schema["additionalProperties"] = False
    return schema


@pytest.fixture(scope="module")
def rayservice_schema() -> dict:
    text = CRD.read_text()
    lines = text.splitlines(keepends=True)
    header = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    published = "".join(lines[header:])
    assert hashlib.sha256(published.encode()).hexdigest() == CRD_SHA256, "the CRD copy differs from KubeRay's"
    crd = yaml.load(text, Loader=yaml.CSafeLoader)
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "RayService"
    (v1,) = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    assert v1["served"] and v1["storage"]
    return closed(v1["schema"]["openAPIV3Schema"])


def manifest() -> tuple[dict, dict]:
    """(the PersistentVolumeClaim, the RayService)."""
    claim, service = yaml.safe_load_all(MANIFEST.read_text())
    assert claim["kind"] == "PersistentVolumeClaim" and service["kind"] == "RayService"
    return claim, service


def serve_config(service: dict) -> dict:
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def errors(schema: dict, document: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_the_rayservice_validates_against_kuberays_crd(rayservice_schema):
    _, service = manifest()
    assert service["apiVersion"] == "ray.io/v1"
    assert errors(rayservice_schema, service) == []


def test_the_crd_check_refuses_a_misspelt_or_mistyped_field(rayservice_schema):
    """The check can fail: the mistakes a hand-edited manifest makes are refused, each by name."""
    _, service = manifest()
    misspelt = copy.deepcopy(service)
    group = misspelt["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["maxReplica"] = group.pop("maxReplicas")
    assert any("maxReplica" in error for error in errors(rayservice_schema, misspelt))
    mistyped = copy.deepcopy(service)
    mistyped["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] = "yes"
    assert any("enableInTreeAutoscaling" in error for error in errors(rayservice_schema, mistyped))


def test_the_embedded_serve_config_is_the_multi_gpu_application():
    """serveConfigV2 passes Serve's schema and our build's checks, and is configs/multi-gpu.yaml's
    application but for where the compile cache and its key live (the pods' volumes)."""
    from ray.serve.schema import ServeDeploySchema

    _, service = manifest()
    embedded = serve_config(service)
    ServeDeploySchema.model_validate(embedded)
    (app,) = embedded["applications"]
    deployment_ladder(validate(app["args"], devices=False))
    shipped = yaml.safe_load((ROOT / "configs/multi-gpu.yaml").read_text())
    for paths in (embedded, shipped):
        graphs = paths["applications"][0]["args"]["graphs"]
        graphs.pop("compile_cache"), graphs.pop("compile_cache_key_file", None)
    assert embedded == shipped


def test_the_cluster_gives_the_application_its_gpus_cache_and_key():
    """One encoder replica per GPU pod, the worker group bounded as the policy's replicas are, Ray's
    autoscaler on, the compile cache on the shared claim and its key from the Secret."""
    claim, service = manifest()
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    (app,) = serve_config(service)["applications"]
    encoder = {d["name"]: d for d in app["deployments"]}["EncoderReplica"]
    scaling = encoder["autoscaling_config"]
    (group,) = cluster["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus == encoder["ray_actor_options"]["num_gpus"] == 1
    assert (group["minReplicas"], group["maxReplicas"]) == (scaling["min_replicas"], scaling["max_replicas"])
    assert int(container["resources"]["limits"]["cpu"]) >= encoder["ray_actor_options"]["num_cpus"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
    graphs = app["args"]["graphs"]
    cache = next(name for name, path in mounts.items() if graphs["compile_cache"].startswith(path + "/"))
    assert volumes[cache]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # every GPU pod mounts it
    key = next(name for name, path in mounts.items() if graphs["compile_cache_key_file"].startswith(path + "/"))
    assert "secret" in volumes[key]
    head = cluster["headGroupSpec"]
    routers = {d["name"]: d for d in app["deployments"]}["EncoderRouter"]
    router_cpus = routers["num_replicas"] * routers["ray_actor_options"]["num_cpus"]
    assert float(head["rayStartParams"]["num-cpus"]) >= router_cpus
