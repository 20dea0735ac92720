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

SECTIONS = ["envelope", "models", "agent", "cloud", "delivery"]
RESULTS = Path(__file__).resolve().parent / "results"


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
    markdown = [f"# EdgeLoop benchmarks, {report['started_at']}", ""]
    markdown.append("Machine: " + ", ".join(f"{k}={v}" for k, v in report["machine"].items()))
    for name in wanted:
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        module = importlib.import_module(f"bench.{name}")
        section = module.run(quick=args.quick)
        section["seconds"] = round(time.perf_counter() - start, 1)
        report["sections"][name] = section
        markdown += ["", f"## {name}", ""]
        for table in section.get("tables", []):
            markdown += [table, ""]
            print(table, flush=True)

    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    payload = json.dumps(report, indent=2, default=str)
    text = "\n".join(markdown) + "\n"
    for stem in (stamp, "latest"):
        (RESULTS / f"{stem}.json").write_text(payload)
        (RESULTS / f"{stem}.md").write_text(text)
    print(f"results: {RESULTS / (stamp + '.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
