"""The Grafana dashboard and Prometheus configuration match the metrics the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from tests.deploy.conftest import DEPLOY, load_documents

ROOT = Path(__file__).resolve().parents[2]
# Series Prometheus makes itself for every target; no process of ours exports them.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
# Where metrics are defined; a new module that defines some must be added here.
METRIC_MODULES = {"cloud_service/metrics.py", "edge_agent/telemetry.py"}

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
}
_PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless", "inf", "nan",
}  # fmt: skip


def _series_names(registry: CollectorRegistry) -> set[str]:
    """Every series name the registry's collectors export, with the exposition suffixes."""
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return names


def exported_series() -> set[str]:
    """The series of the cloud processes (API, verifier) and of the edge agent."""
    from cloud_service.metrics import CloudMetrics
    from edge_agent.telemetry import Telemetry

    return _series_names(CloudMetrics().registry) | _series_names(Telemetry().registry)


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, labels and keywords left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors ($__rate_interval)
    text = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text
    )  # grouping labels
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        name, rest = match.group(), text[match.end() :].lstrip()
        if rest.startswith("(") or name.lower() in _PROMQL_WORDS:
            continue  # a function or aggregation, or a keyword
        names.add(name)
    return names


def _dashboard() -> dict[str, Any]:
    return dict(json.loads((DEPLOY / "grafana" / "edgeloop.json").read_text()))


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    queries = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                queries.append((inner["title"], target["expr"]))
    return queries


def test_the_query_parser_finds_metric_names() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, pod) (rate(edgeloop_a_bucket{x="y"}[5m])))'
        ' / on (pod) group_left sum without (le) (edgeloop_b) > bool 0 or up{job="z"}'
    )
    assert promql_metric_names(expr) == {"edgeloop_a_bucket", "edgeloop_b", "up"}


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    exported = exported_series()
    assert "edgeloop_verifier_queue_delay_seconds_bucket" in exported  # the suffixes are there
    queries = _queries(_dashboard())
    assert len(queries) >= 20
    used: set[str] = set()
    for title, expr in queries:
        names = promql_metric_names(expr)
        assert names, f"panel {title!r}: no metric in {expr!r}"
        unknown = names - exported - PROMETHEUS_SERIES
        assert not unknown, f"panel {title!r} queries {sorted(unknown)}, which no process exports"
        used |= names
    # The dashboard covers every family the verifier and the API export.
    from cloud_service.metrics import CloudMetrics

    families = {family.name for family in CloudMetrics().registry.collect()}
    uncovered = {f for f in families if not any(name.startswith(f) for name in used)}
    assert not uncovered, f"metrics with no panel: {sorted(uncovered)}"


def test_metrics_are_defined_only_where_the_test_looks() -> None:
    definition = re.compile(r"\b(Counter|Gauge|Histogram|Summary|Info|Enum)\(\s*\n?\s*\"")
    found = set()
    for package in ("shared", "edge_agent", "cloud_service", "distill", "kernels", "simulations"):
        for path in (ROOT / package).rglob("*.py"):
            source = path.read_text()
            if "prometheus_client" in source and definition.search(source):
                found.add(path.relative_to(ROOT).as_posix())
    assert found == METRIC_MODULES


def test_dashboard_is_well_formed() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"].strip("${}") in variables
            assert panel["targets"]


def test_prometheus_scrapes_the_pods_the_manifests_run(manifests: list[dict[str, Any]]) -> None:
    (config,) = load_documents(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    pods = jobs["edgeloop"]
    assert pods["metrics_path"] == "/metrics"
    keep = {
        tuple(rule["source_labels"]): rule["regex"]
        for rule in pods["relabel_configs"]
        if rule.get("action") == "keep"
    }
    part_of = keep[("__meta_kubernetes_pod_label_app_kubernetes_io_part_of",)]
    port_name = keep[("__meta_kubernetes_pod_container_port_name",)]
    scraped = set()
    for workload in manifests:
        if workload["kind"] not in {"Deployment", "StatefulSet"}:
            continue
        template = workload["spec"]["template"]
        if template["metadata"]["labels"].get("app.kubernetes.io/part-of") != part_of:
            continue
        for container in template["spec"]["containers"]:
            if any(re.fullmatch(port_name, p["name"]) for p in container.get("ports", [])):
                scraped.add(workload["metadata"]["name"])
    # The distill worker serves no /metrics yet, so it is not a target.
    assert scraped == {"edgeloop-api", "edgeloop-verifier"}
    # The dashboard groups by the labels the relabelling makes.
    targets = {rule.get("target_label") for rule in pods["relabel_configs"]}
    assert {"component", "pod"} <= targets
