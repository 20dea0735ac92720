"""The Kubernetes manifests: well-formed, consistent, and runnable by the code they deploy."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import typer

from cloud_service.settings import CloudSettings

NAMESPACED = {
    "ConfigMap",
    "Deployment",
    "PersistentVolumeClaim",
    "PodDisruptionBudget",
    "Secret",
    "Service",
    "StatefulSet",
}
WORKLOADS = {
    "edgeloop-api": "Deployment",
    "edgeloop-verifier": "StatefulSet",
    "edgeloop-distill-worker": "Deployment",
}


def _find(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def _cli(program: str) -> Any:
    """The click command behind an installed program (typer builds it from the app)."""
    from cloud_service.cli import app as cloud_app
    from simulations.cli import app as distill_app

    apps = {"cloud-service": cloud_app, "edgeloop": distill_app}
    return typer.main.get_command(apps[program])


def _parse_command(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The sub-command path and its parsed options, as the real CLI would parse ``argv``."""
    command = _cli(argv[0])
    args = argv[1:]
    path: list[str] = []
    while hasattr(command, "get_command"):  # a group: the next word picks the sub-command
        name, args = args[0], args[1:]
        sub = command.get_command(command.make_context(argv[0], [name]), name)
        assert sub is not None, f"{' '.join(argv)}: no command {name!r}"
        path.append(name)
        command = sub
    ctx = command.make_context(" ".join([argv[0], *path]), list(args))
    return path, dict(ctx.params)


def test_every_document_is_a_named_object_in_the_namespace(manifests: list[dict[str, Any]]) -> None:
    kinds = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    assert len(kinds) == len(manifests), "an object is defined twice"
    for m in manifests:
        assert m.get("apiVersion") and m.get("kind") and m["metadata"].get("name")
        if m["kind"] in NAMESPACED:
            assert m["metadata"].get("namespace") == "edgeloop", m["metadata"]["name"]
    for name, kind in WORKLOADS.items():
        _find(manifests, kind, name)


def test_workloads_run_real_commands(manifests: list[dict[str, Any]]) -> None:
    api = _container(_find(manifests, "Deployment", "edgeloop-api"))
    path, params = _parse_command(api["command"])
    assert path == ["api"] and params["host"] == "0.0.0.0" and params["port"] == 8080
    verifier = _container(_find(manifests, "StatefulSet", "edgeloop-verifier"))
    path, params = _parse_command(verifier["command"])
    assert path == ["verifier"] and params["host"] == "0.0.0.0" and params["port"] == 8081
    worker = _container(_find(manifests, "Deployment", "edgeloop-distill-worker"))
    path, params = _parse_command(worker["command"])
    assert path == ["jobs", "worker"] and params["lease_s"] == 30
    assert params["health_port"] == 8082
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert worker["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert worker["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert ports["health"] == params["health_port"]


def test_http_probes_call_endpoints_on_declared_ports(manifests: list[dict[str, Any]]) -> None:
    for name in ("edgeloop-api", "edgeloop-verifier"):
        container = _container(_find(manifests, WORKLOADS[name], name))
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["http"] == int(container["command"][container["command"].index("--port") + 1])
        probes = {k: container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
        assert probes["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"
        for probe in probes.values():
            assert probe["httpGet"]["port"] in ports
            assert probe["periodSeconds"] > 0 and probe.get("failureThreshold", 3) >= 1
        # Liveness never depends on the database or the broker: an outage must not
        # restart every replica at once, it only takes them out of the Service.
        assert probes["livenessProbe"]["httpGet"]["path"] != "/readyz"


def test_the_probed_endpoints_answer(tmp_path: Path) -> None:
    """/healthz, /readyz and /metrics, as served by the API and by the verifier's health app."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient

    from cloud_service.api import create_app

    settings = CloudSettings(
        data_dir=tmp_path, database_url=f"sqlite:///{tmp_path / 'probe.db'}", rollout_tick_s=0
    )
    for health_only in (False, True):
        with TestClient(create_app(settings, health_only=health_only)) as client:
            assert client.get("/healthz").status_code == 200
            assert client.get("/readyz").status_code == 200
            metrics = client.get("/metrics")
            assert metrics.status_code == 200 and b"edgeloop_" in metrics.content


def test_rolling_updates(manifests: list[dict[str, Any]]) -> None:
    for name in ("edgeloop-api", "edgeloop-distill-worker"):
        strategy = _find(manifests, "Deployment", name)["spec"]["strategy"]
        assert strategy["type"] == "RollingUpdate"
        assert strategy["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": 0}
    # The verifier rolls pod by pod under stable names: its broker session (and what
    # queued in it for the shared subscription) belongs to the pod's name.
    verifier = _find(manifests, "StatefulSet", "edgeloop-verifier")
    assert verifier["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    env = {e["name"]: e for e in _container(verifier).get("env", [])}
    client_id = env["EDGELOOP_VERIFIER_CLIENT_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert client_id == "metadata.name"


def test_resources(manifests: list[dict[str, Any]]) -> None:
    verifier = _container(_find(manifests, "StatefulSet", "edgeloop-verifier"))
    resources = verifier["resources"]
    # Extended resources: the request must equal the limit.
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    for name, kind in WORKLOADS.items():
        container = _container(_find(manifests, kind, name))
        assert container["resources"]["requests"]["cpu"]
        assert container["resources"]["requests"]["memory"]
        assert container["resources"]["limits"]["memory"]


def test_references_resolve(manifests: list[dict[str, Any]]) -> None:
    """Every ConfigMap, Secret, volume claim and port a pod names exists."""
    objects = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    for name, kind in WORKLOADS.items():
        workload = _find(manifests, kind, name)
        pod = workload["spec"]["template"]
        assert (
            workload["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        )
        container = _container(workload)
        for source in container["envFrom"]:
            if "configMapRef" in source:
                assert ("ConfigMap", source["configMapRef"]["name"]) in objects
            else:
                assert ("Secret", source["secretRef"]["name"]) in objects
        for item in container.get("env", []):
            ref = item.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                secret = _find(manifests, "Secret", ref["name"])
                assert ref["key"] in secret["stringData"]
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "secret" in volume:
                assert ("Secret", volume["secret"]["secretName"]) in objects
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert ("PersistentVolumeClaim", claim) in objects
        if container["securityContext"].get("readOnlyRootFilesystem"):
            mounted = {m["mountPath"] for m in container["volumeMounts"]}
            assert {"/var/lib/edgeloop", "/tmp"} <= mounted
    for service in (m for m in manifests if m["kind"] == "Service"):
        name = service["metadata"]["name"]
        pod = _find(manifests, WORKLOADS[name], name)["spec"]["template"]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        port_names = {p["name"] for p in _container({"spec": {"template": pod}})["ports"]}
        assert all(p["targetPort"] in port_names for p in service["spec"]["ports"])


def _pod_environment(manifests: list[dict[str, Any]], name: str) -> dict[str, str]:
    """The EDGELOOP_* variables a workload's pod sees, its Secrets filled with the examples."""
    container = _container(_find(manifests, WORKLOADS[name], name))
    variables: dict[str, str] = {}
    for source in container["envFrom"]:
        if "configMapRef" in source:
            variables.update(_find(manifests, "ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            secret = _find(manifests, "Secret", source["secretRef"]["name"])
            variables.update(secret["stringData"])
    for item in container.get("env", []):
        if "value" in item:
            variables[item["name"]] = item["value"]
        elif "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            variables[item["name"]] = _find(manifests, "Secret", ref["name"])["stringData"][
                ref["key"]
            ]
        else:
            assert item["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            variables[item["name"]] = f"{name}-0"
    return variables


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_config_and_secrets_make_valid_production_settings(
    manifests: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Every EDGELOOP_* variable a pod gets is a real setting, and together they pass the
    production checks (no development default is left)."""
    variables = _pod_environment(manifests, name)
    fields = set(CloudSettings.model_fields)
    for variable in variables:
        assert variable.startswith("EDGELOOP_"), variable
        assert variable.removeprefix("EDGELOOP_").lower() in fields, f"{variable} is no setting"
    for variable in list(os.environ):
        if variable.startswith("EDGELOOP_"):
            monkeypatch.delenv(variable)
    for variable, value in variables.items():
        monkeypatch.setenv(variable, value)
    settings = CloudSettings.load()
    assert settings.env == "production" and settings.production_problems() == []
    assert settings.blob_url is not None and settings.blob_url.startswith("s3://")
    assert settings.mqtt.username in {"edgeloop-verifier", "edgeloop-api"}
    if name == "edgeloop-verifier":
        assert settings.verifier_client_id == "edgeloop-verifier-0"
    # The data dir the pods mount is the one the settings use.
    assert str(settings.data_dir) == "/var/lib/edgeloop"
    assert str(settings.resolved_teacher_model).startswith("/var/lib/edgeloop/models/")
