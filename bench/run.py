"""Run every benchmark; write JSON and a markdown table under bench/results/.

    python -m bench.run [--quick] [--only models,envelope]

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


def _goal(name: str, value: Any, target: float) -> dict[str, Any]:
    if isinstance(value, int | float):
        status = "met" if value >= target else "not met"
        return {
            "goal": name,
            "measured": round(float(value), 3),
            "target": f">= {target}",
            "status": status,
        }
    return {"goal": name, "measured": "-", "target": f">= {target}", "status": value}


def goal_summary(sections: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal of the performance issue with its measured ratio (from this run only)."""
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
    return [
        _goal(
            "verifier serving efficiency (batched / raw ORT)",
            cloud.get("serving_efficiency", not_run),
            0.85,
        ),
        _goal("dynamic batching (batch 32 / batch 1)", cloud.get("batching_speedup", not_run), 4.0),
        *[
            _goal(f"agent HTTP / raw ORT, same JPEG decode ({model})", row.get(key, not_run), 0.8)
            for model, row in (agent or {"-": {}}).items()
            for key in ["http_vs_raw_decode"]
        ],
        *[
            _goal(f"agent video / raw ORT, same video read ({model})", row.get(key, not_run), 0.8)
            for model, row in (agent or {"-": {}}).items()
            for key in ["video_vs_raw_video"]
        ],
        _goal(
            "pipeline / raw Mosquitto, 20 KB payloads", cloud.get("e2e_vs_raw_mqtt", not_run), 0.5
        ),
        _goal(
            "pipeline, 2 verifier processes / raw Mosquitto, 20 KB payloads",
            cloud.get("e2e_workers_vs_raw_mqtt") or not_run,
            0.5,
        ),
        _goal(
            "GPU: teacher TRT INT8 / CUDA FP32, batch 32",
            gpu.get("trt_int8_vs_cuda_fp32_batch32", no_trt),
            2.0,
        ),
        _goal(
            "GPU: kernels share of memory bandwidth (min)", min(kernels) if kernels else no_gpu, 0.6
        ),
    ]


def render_markdown(report: dict[str, Any]) -> str:
    """The markdown twin of a results JSON: the machine, the goals table, each section's tables."""
    machine = ", ".join(f"{k}={v}" for k, v in report["machine"].items())
    lines = [f"# EdgeLoop benchmarks, {report['started_at']}", "", "Machine: " + machine]
    lines += ["## Goals", "", *goals_table(report.get("goals", [])), ""]
    for name, section in report["sections"].items():
        lines += ["", f"## {name}", ""]
        for table in section.get("tables", []):
            lines += [table, ""]
    return "\n".join(lines) + "\n"


def goals_table(goals: list[dict[str, Any]]) -> list[str]:
    """The goal summary as markdown table lines."""
    table = ["| goal | measured | target | status |", "|---|---|---|---|"]
    return table + [
        f"| {g['goal']} | {g['measured']} | {g['target']} | {g['status']} |" for g in goals
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
    for name in wanted:
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        module = importlib.import_module(f"bench.{name}")
        section = module.run(quick=args.quick)
        section["seconds"] = round(time.perf_counter() - start, 1)
        report["sections"][name] = section
        for table in section.get("tables", []):
            print(table, flush=True)

    report["goals"] = goal_summary(report["sections"])
    print("\n".join(goals_table(report["goals"])), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
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
