"""Run every benchmark; write JSON and a markdown table under bench/results/.

    python -m bench.run [--quick] [--only models,envelope]

``--only`` runs some sections and keeps the others in latest.* from the last
full-size run on the same CPU, each marked with the run it comes from.

Each section is a module in ``bench/`` with ``run(quick: bool) -> dict`` returning
``{"figures": {...}, "tables": ["markdown", ...]}``. Figures are ratios measured
side by side in one run, with medians of repeated runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import machine_info

SECTIONS = [
    "envelope",
    "models",
    "detectors",
    "agent",
    "spool",
    "uplink",
    "cloud",
    "delivery",
    "ui",
    "gpu",
]
RESULTS = Path(__file__).resolve().parent / "results"


HISTORY = "goal-history.json"  # each full run's goal figures, for the range column
CAMERA_SIZED = 224  # goal 3's students: input side at least this


def _goal(name: str, value: Any, target: str) -> dict[str, Any]:
    """One goal row; ``target`` is ">= x", "<= x" or "info" (reported, no goal)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return {"goal": name, "measured": "-", "target": target, "status": value}
    measured = round(float(value), 3)
    if target == "info":
        return {"goal": name, "measured": measured, "target": "info", "status": "reported"}
    op, bound = target.split()
    met = measured >= float(bound) if op == ">=" else measured <= float(bound)
    return {
        "goal": name,
        "measured": measured,
        "target": target,
        "status": "met" if met else "not met",
    }


def _latency_rows(cloud: dict[str, Any], not_run: str) -> list[dict[str, Any]]:
    """Goal 4: frame -> verdict at the agent at each load, beside the raw round trip."""
    latency = cloud.get("latency") or {}
    if not latency:
        return [_goal("frame -> verdict at the agent, p50 ms", not_run, "info")]
    rows = []
    for share, row in latency.items():
        at = f"at {share} of one verifier process's capacity"
        rows += [
            _goal(f"frame -> verdict at the agent, p50 ms, {at}", row["p50_ms"], "info"),
            _goal(f"frame -> verdict at the agent, p99 ms, {at}", row["p99_ms"], "info"),
            _goal(f"raw pub/sub round trip, p50 ms, {at}", row["raw_p50_ms"], "info"),
            _goal(f"raw pub/sub round trip, p99 ms, {at}", row["raw_p99_ms"], "info"),
        ]
    return rows


def _agent_rows(agent: dict[str, Any], not_run: str) -> list[dict[str, Any]]:
    """Goals 2 and 3 per camera-sized student, with its latency; smaller students' ratios
    as information."""
    rows: list[dict[str, Any]] = []
    for model, row in (agent or {"-": {}}).items():
        side = row.get("input_side")
        camera = isinstance(side, int | float) and side >= CAMERA_SIZED
        name = f"{model}, {side:.0f}px" if isinstance(side, int | float) else model
        ratio = ">= 0.9" if camera else "info"
        rows += [
            _goal(
                f"agent HTTP / raw ORT, same JPEG decode ({name})",
                row.get("http_vs_raw_decode", not_run),
                ratio,
            ),
            _goal(
                f"agent video / raw ORT, same video read ({name})",
                row.get("video_vs_raw_video", not_run),
                ratio,
            ),
        ]
        if not camera:
            continue
        for source in ("http", "video"):
            shown = "HTTP" if source == "http" else source
            rows += [
                _goal(
                    f"agent {shown} p50 ms ({name})", row.get(f"{source}_p50_ms", not_run), "info"
                ),
                _goal(
                    f"agent {shown} p99 ms ({name})", row.get(f"{source}_p99_ms", not_run), "info"
                ),
                _goal(
                    f"agent CPU ms per forwarded sample, {shown} ({name})",
                    row.get(f"{source}_forward_cpu_ms_per_sample", not_run),
                    "<= 0.5",
                ),
                _goal(
                    f"agent CPU ms per forwarded sample at its default routing, {shown} ({name})",
                    _default_routing_forward_cost(row, source, not_run),
                    "info",
                ),
            ]
    return rows


# Below this forwarded share the difference of two agents' CPU per frame, divided by
# the share, is mostly the host's noise.
_SHARE_TO_TELL = 0.05


def _default_routing_forward_cost(row: dict[str, Any], source: str, not_run: str) -> Any:
    """CPU per forwarded sample where the agent forwards what its default routing does:
    its CPU per frame less its twin's that forwards nothing, per forwarded frame.

    Goal 2 is measured with every frame forwarded, where a spool transaction, a
    publish and a receipt each serve many samples; a deployed agent forwards a tenth
    or so, one or two samples at a time, and pays those costs per sample.
    """
    keys = {
        "http": (
            "agent_cpu_ms_per_frame",
            "http_unforwarded_cpu_ms_per_frame",
            "http_forward_rate",
        ),
        "video": (
            "video_cpu_ms_per_frame",
            "video_unforwarded_cpu_ms_per_frame",
            "video_forward_rate",
        ),
    }[source]
    values = [row.get(key) for key in keys]
    if not all(isinstance(v, int | float) for v in values):
        return not_run
    forwarding, unforwarded, share = (float(v) for v in values)  # type: ignore[arg-type]
    if share < _SHARE_TO_TELL:
        return f"forwards {share:.1%}, too few to tell"
    return (forwarding - unforwarded) / share


def goal_summary(sections: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal of the performance issues with its figure from this run (ranges over
    runs are added by ``with_ranges``); retired goals stay as information."""
    cloud = sections.get("cloud", {}).get("figures", {})
    agent = sections.get("agent", {}).get("figures", {})
    gpu = sections.get("gpu", {}).get("figures", {})
    not_run = "not run"
    no_gpu = gpu.get("skipped", not_run) if gpu else not_run
    kernels = [
        v["share_of_peak"]
        for v in gpu.values()
        if isinstance(v, dict) and isinstance(v.get("share_of_peak"), int | float)
    ]
    # On a GPU machine without TensorRT the figure is missing for a reason of its own.
    no_trt = no_gpu
    if gpu and "skipped" not in gpu:
        no_trt = str(gpu.get("trt_int8_error") or "no TensorRT provider")[:80]

    def from_cloud(name: str, key: str, target: str) -> dict[str, Any]:
        value = cloud.get(key)
        return _goal(name, not_run if value is None else value, target)

    beyond = "verifier CPU ms per sample beyond the teacher and the decode"
    return [
        from_cloud(f"{beyond}, one process", "verifier_overhead_ms_per_sample_1p", "<= 0.5"),
        from_cloud(f"{beyond}, 2 processes", "verifier_overhead_ms_per_sample_2p", "<= 0.5"),
        *_agent_rows(agent, not_run),
        *_latency_rows(cloud, not_run),
        *(
            from_cloud(name, key, target)
            for name, key, target in (
                (
                    "verifier serving efficiency (batched / raw ORT)",
                    "serving_efficiency",
                    ">= 0.85",
                ),
                ("dynamic batching (batch 32 / batch 1)", "batching_speedup", ">= 4.0"),
                (
                    "pipeline / raw Mosquitto, 20 KB payloads (retired goal)",
                    "e2e_vs_raw_mqtt",
                    "info",
                ),
                (
                    "pipeline, 2 verifier processes / raw Mosquitto (retired goal)",
                    "e2e_workers_vs_raw_mqtt",
                    "info",
                ),
            )
        ),
        _goal(
            "GPU: teacher TRT INT8 / CUDA FP32, batch 32",
            gpu.get("trt_int8_vs_cuda_fp32_batch32", no_trt),
            ">= 2.0",
        ),
        _goal(
            "GPU: verifier batched samples/s / raw teacher batched",
            gpu.get("cuda_verifier_batched_vs_raw", no_gpu),
            ">= 0.8",
        ),
        _goal(
            "GPU: kernels share of memory bandwidth (min)",
            min(kernels) if kernels else no_gpu,
            ">= 0.6",
        ),
    ]


def with_ranges(
    goals: list[dict[str, Any]], history: list[dict[str, Any]], cpu: str
) -> list[dict[str, Any]]:
    """Each goal with the range of its figure over the full runs in ``history`` on a host
    with the same ``cpu`` (this run included when it is there)."""
    out = []
    for goal in goals:
        values = [
            run["goals"][goal["goal"]]
            for run in history
            if run.get("cpu") == cpu
            and isinstance(run.get("goals", {}).get(goal["goal"]), int | float)
        ]
        shown = (
            f"{min(values):g} - {max(values):g} ({len(values)} runs)" if len(values) > 1 else "-"
        )
        out.append({**goal, "range": shown})
    return out


def record_history(path: Path, report: dict[str, Any]) -> list[dict[str, Any]]:
    """Append this run's goal figures to ``path`` (a JSON list); the whole history."""
    history: list[dict[str, Any]] = json.loads(path.read_text()) if path.exists() else []
    history.append(
        {
            "started_at": report["started_at"],
            "cpu": report["machine"].get("cpu"),
            "sections": sorted(report["sections"]),
            "goals": {
                g["goal"]: g["measured"]
                for g in report["goals"]
                if isinstance(g["measured"], int | float)
            },
        }
    )
    path.write_text(json.dumps(history, indent=1) + "\n")
    return history


def _carried_sections(wanted: list[str], report: dict[str, Any]) -> dict[str, Any]:
    """The sections of the last full-size run on this CPU that this run leaves out, each
    marked with the run it comes from: ``--only`` refreshes some sections of latest.*
    and keeps the rest (nothing when the last run was quick or on another CPU)."""
    latest = RESULTS / "latest.json"
    if not latest.exists():
        return {}
    previous = json.loads(latest.read_text())
    if previous.get("quick") or previous.get("machine", {}).get("cpu") != report["machine"].get(
        "cpu"
    ):
        return {}
    return {
        name: {**section, "carried_from": section.get("carried_from") or previous["started_at"]}
        for name, section in previous.get("sections", {}).items()
        if name in SECTIONS and name not in wanted
    }


def render_markdown(report: dict[str, Any]) -> str:
    """The markdown twin of a results JSON: the machine, the goals table, each section's tables."""
    machine = ", ".join(f"{k}={v}" for k, v in report["machine"].items())
    lines = [f"# EdgeLoop benchmarks, {report['started_at']}", "", "Machine: " + machine]
    lines += ["## Goals", "", *goals_table(report.get("goals", [])), ""]
    for name, section in report["sections"].items():
        lines += ["", f"## {name}", ""]
        if section.get("carried_from"):
            lines += [f"Not run this time: from the run of {section['carried_from']}.", ""]
        for table in section.get("tables", []):
            lines += [table, ""]
    return "\n".join(lines) + "\n"


def goals_table(goals: list[dict[str, Any]]) -> list[str]:
    """The goal summary as markdown table lines."""
    table = [
        "| goal | last run | range over runs | target | status |",
        "|---|---|---|---|---|",
    ]
    return table + [
        f"| {g['goal']} | {g['measured']} | {g.get('range', '-')} | {g['target']} | {g['status']} |"
        for g in goals
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models and fewer repeats")
    parser.add_argument("--only", default="", help="comma-separated sections to run")
    args = parser.parse_args(argv)
    wanted = [s for s in args.only.split(",") if s] or SECTIONS
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")

    report: dict[str, Any] = {
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "quick": args.quick,
        "sections": {},
    }
    carried = _carried_sections(wanted, report) if args.only and not args.quick else {}
    for name in wanted:
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        module = importlib.import_module(f"bench.{name}")
        section = module.run(quick=args.quick)
        section["seconds"] = round(time.perf_counter() - start, 1)
        report["sections"][name] = section
        for table in section.get("tables", []):
            print(table, flush=True)

    # The history holds what this run measured; the report, with carried sections, all.
    report["goals"] = goal_summary(report["sections"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    history: list[dict[str, Any]] = []
    if not args.quick:  # quick runs use small models: their figures are not the goals'
        history = record_history(RESULTS / HISTORY, report)
    if carried:
        report["sections"] = {
            name: report["sections"].get(name) or carried[name]
            for name in SECTIONS
            if name in report["sections"] or name in carried
        }
        report["goals"] = goal_summary(report["sections"])
    report["goals"] = with_ranges(report["goals"], history, report["machine"].get("cpu", ""))
    print("\n".join(goals_table(report["goals"])), flush=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    payload = json.dumps(report, indent=2, default=str)
    text = render_markdown(json.loads(payload))  # exactly what the JSON gives
    for stem in (stamp, "latest"):
        (RESULTS / f"{stem}.json").write_text(payload)
        (RESULTS / f"{stem}.md").write_text(text)
    print(f"results: {RESULTS / (stamp + '.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
