"""Write docs/performance.md from the benchmark results: every figure's one written place.

    python -m bench.report            # or: make docs
    python -m bench.report --check    # exit 1 when docs/performance.md is not what the results give

The document is rendered from ``bench/results/latest.json`` (what ``make bench`` last
wrote), the closed-loop, fleet and projection runs under ``bench/results/simulations/``,
and the docstrings of the modules that measured them (their method). Nothing in it is
typed by hand, so it cannot disagree with the results; ``tests/bench`` checks that the
committed file is exactly what this module renders.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

from bench.run import goals_table
from simulations.loop_table import table_header, table_rows
from simulations.projection import PROJECTED, projected_cells

__all__ = ["DOC", "RESULTS", "Inputs", "load_inputs", "main", "render_performance"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "performance.md"
_CLOSED_LOOP = "closed-loop.json"
_FLEET_GLOB = "fleet*.json"
PROJECTION = "projection.json"
# How `make bench` writes it: a 16-core verifier host running the teacher on its CPU,
# the forwarded share of the committed cost run, 224 px frames' envelopes.
PROJECTION_COMMAND = (
    "edgeloop sim project --host-cores 16 --frame-px 224"
    " --cost-json bench/results/simulations/cost.json --json"
)

# The instruction-set flags that bench.models records, as a reader knows them.
_CPU_FLAGS = {
    "avx2": "AVX2",
    "avx512f": "AVX-512F",
    "avx512_vnni": "AVX-512 VNNI",
    "avx_vnni": "AVX-VNNI",
}

_METHOD = """\
Every figure comes from one run of `make bench` (`python -m bench.run`) on the host
above, except a section that run left out (`--only`): it keeps the figures of the
last full-size run on the same CPU, and says so. A goal's figure is a ratio of two
things measured side by side in that run, taking turns round by round, so a
neighbour's load slows both sides alike; the raw baselines use the same decode,
session and thread settings as the product. The host is a shared VM whose CPU model
and instruction set change from one day to the next, and INT8's advantage with them:
compare runs only on the same host. Each section below says what it measures and
how (from its benchmark module), then gives that run's tables."""

Inputs = dict[str, Any]


class ReportInputError(ValueError):
    """A results file is missing or is not what ``make bench`` writes."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ReportInputError(f"{path} does not exist: run `make bench` first") from exc
    except json.JSONDecodeError as exc:
        raise ReportInputError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ReportInputError(f"{path} holds a {type(data).__name__}, expected an object")
    return data


def load_inputs(results: Path = RESULTS) -> Inputs:
    """The benchmark results and the simulation runs under ``results``."""
    bench = _read_json(results / "latest.json")
    for key in ("started_at", "machine", "sections"):
        if key not in bench:
            raise ReportInputError(f"{results / 'latest.json'} has no {key!r}")
    simulations = results / "simulations"
    closed = simulations / _CLOSED_LOOP
    return {
        "bench": bench,
        "closed_loop": _read_json(closed) if closed.exists() else None,
        "fleet": {p.name: _read_json(p) for p in sorted(simulations.glob(_FLEET_GLOB))},
        "projection": _read_json(projection)
        if (projection := simulations / PROJECTION).exists()
        else None,
    }


def _module_doc(module: str) -> tuple[str, str]:
    """A module's docstring, read without importing it: (first paragraph, the rest)."""
    path = ROOT / Path(*module.split(".")).with_suffix(".py")
    doc = ast.get_docstring(ast.parse(path.read_text())) if path.exists() else None
    if not doc:
        return module, ""
    head, _, rest = doc.partition("\n\n")
    # Only blank lines go: an indented usage line stays a code block.
    return " ".join(head.split()), rest.strip("\n").rstrip()


def _host(bench: dict[str, Any]) -> list[str]:
    machine = bench["machine"]
    models = bench["sections"].get("models", {}).get("figures", {}).get("machine", {})
    flags = [name for key, name in _CPU_FLAGS.items() if models.get(key)]
    if models:
        isa = ", ".join(flags) if flags else "none of " + ", ".join(_CPU_FLAGS.values())
    else:
        isa = "not recorded (the models section did not run)"
    providers = ", ".join(machine.get("ort_providers", [])) or "-"
    sections = ", ".join(
        f"{name} ({section.get('seconds', '-')} s"
        + (f", from the run of {section['carried_from']})" if section.get("carried_from") else ")")
        for name, section in bench["sections"].items()
    )
    rows = [
        ("started", bench["started_at"]),
        (
            "mode",
            "quick (`--quick`: small models, fewer repeats)" if bench.get("quick") else "full",
        ),
        ("CPU", f"{machine.get('cpu', '-')}, {machine.get('cores', '-')} logical CPUs"),
        ("instruction sets", isa),
        ("platform", machine.get("platform", "-")),
        (
            "software",
            f"Python {machine.get('python', '-')}, NumPy {machine.get('numpy', '-')}, "
            f"ONNX Runtime {machine.get('onnxruntime', '-')}, torch {machine.get('torch', '-')}",
        ),
        ("ONNX Runtime providers", providers),
        ("CUDA", "yes" if machine.get("cuda") else "no"),
        ("sections run", sections),
    ]
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]


def _bench_sections(bench: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for name, section in bench["sections"].items():
        title, method = _module_doc(f"bench.{name}")
        lines += [f"### {name}", "", title, ""]
        if section.get("carried_from"):
            lines += [
                f"Not run this time (`--only`): these figures are from the run of"
                f" {section['carried_from']} on the same CPU.",
                "",
            ]
        if method:
            lines += [method, ""]
        for table in section.get("tables", []):
            lines += [table.strip(), ""]
    return lines


def _closed_loop(run: dict[str, Any]) -> list[str]:
    title, _ = _module_doc("simulations.closed_loop")
    header = table_header(run)
    rows = table_rows(run)
    columns = run.get("goal_columns", {})
    goals = [
        f"| {name} | {_shown(value)} | {columns.get(name, '-')} |"
        for name, value in sorted(run.get("goals", {}).items())
    ]
    return [
        "## The closed loop",
        "",
        title,
        "",
        f"`edgeloop loop --drift {run['drift']} --rounds {run['rounds_requested']}` with "
        f"{run['agents']} agents, {'quick' if run.get('quick') else 'the reference'} models, "
        f"{run['before']['frames']} evaluation frames per column; the run took "
        f"{run['wall_s']} s, a round {run['round_s']} s from trigger to every agent serving "
        f"the new model, on {run['samples_stored']} stored samples "
        f"(`bench/results/simulations/{_CLOSED_LOOP}`).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        "| goal | met | read from |",
        "|---|---|---|",
        *goals,
        "",
    ]


def _shown(value: Any) -> str:
    return {True: "yes", False: "no", None: "-"}.get(value, str(value))


def _smallest_fleet(item: tuple[str, dict[str, Any]]) -> tuple[int, str]:
    """Fleet runs in order of their smallest fleet size, then by file name."""
    name, run = item
    return min(run.get("config", {}).get("sizes") or [0]), name


def _fleet(name: str, run: dict[str, Any]) -> list[str]:
    config, knee = run.get("config", {}), run.get("knee", {})
    lines = [
        f"`edgeloop sim fleet --sizes {','.join(str(s) for s in config.get('sizes', []))}` "
        f"(`bench/results/simulations/{name}`): agents at {config.get('rate_per_agent', '-')} "
        f"sample/s each, {run.get('payload_bytes', '-')} B envelopes, {run.get('broker', '-')}, "
        f"MQTT {run.get('protocol', '-')}, the {run.get('teacher', '-')}, "
        f"{run.get('storage', {}).get('database', '-')}, {run.get('machine', {}).get('cpus', '-')} "
        "CPUs.",
        "",
        "| agents | offered/s | verdicts/s | p50 ms | p99 ms | lost | verifier cores | healthy |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for step in run.get("steps", []):
        lines.append(
            f"| {step['agents']} | {step['offered_per_s']} | {step['achieved_per_s']} | "
            f"{step['p50_ms']} | {step['p99_ms']} | {step['lost']} | "
            f"{step.get('verifier_cpu_cores', '-')} | {'yes' if step['healthy'] else 'no'} |"
        )
    lines.append("")
    healthy = (
        f"Healthy up to {knee.get('last_healthy_agents')} agents "
        f"({knee.get('last_healthy_per_s')} verdicts/s)"
    )
    if knee.get("knee_agents"):
        lines.append(f"{healthy}; the knee at {knee['knee_agents']} agents: {knee.get('reason')}.")
    else:
        lines.append(f"{healthy}; no knee within these sizes.")
    return [*lines, ""]


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _projection(run: dict[str, Any]) -> list[str]:
    """Goal 5: the fleet projection `make bench` writes from this run's figures."""
    rows = run.get("projection", [])
    lines = [
        "## Fleet projection",
        "",
        f"`{PROJECTION_COMMAND}` (`bench/results/simulations/{PROJECTION}`, written by"
        " `make bench` after its run): what a fleet of cameras needs, from the figures"
        " above. " + _sentence(str(run.get("verifier_note", ""))),
        "",
        "| | " + " | ".join(f"{r['cameras']:,} cameras" for r in rows) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for label, key, fmt in PROJECTED:
        lines.append(f"| {label} | " + " | ".join(projected_cells(rows, key, fmt)) + " |")
    lines += ["", "| input | value | from |", "|---|---|---|"]
    sources = run.get("sources", {})
    for name, value in run.get("inputs", {}).items():
        shown = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
        lines.append(f"| {name} | {shown} | {sources.get(name, '-')} |")
    return [*lines, ""]


def render_performance(inputs: Inputs) -> str:
    """docs/performance.md as the results give it."""
    bench = inputs["bench"]
    lines = [
        "# Performance",
        "",
        "<!-- Generated by `python -m bench.report` (`make docs`) from bench/results/; "
        "edit the benchmarks, not this file. -->",
        "",
        "What EdgeLoop's benchmarks measured, rendered from `bench/results/latest.json`",
        "(`make bench`) and the simulation runs in `bench/results/simulations/`. Regenerate",
        "with `make docs` after `make bench`; a test fails while this file differs from",
        "what the results give.",
        "",
        "## The host",
        "",
        *_host(bench),
        "",
        "## Method",
        "",
        _METHOD,
        "",
        "## Goals",
        "",
        *goals_table(bench.get("goals", [])),
        "",
        "## The benchmarks",
        "",
        *_bench_sections(bench),
    ]
    if inputs.get("closed_loop"):
        lines += _closed_loop(inputs["closed_loop"])
    fleet = inputs.get("fleet") or {}
    if fleet:
        title, _ = _module_doc("simulations.fleet")
        lines += ["## Fleet load", "", title, ""]
        for name, run in sorted(fleet.items(), key=_smallest_fleet):
            lines += _fleet(name, run)
    if inputs.get("projection"):
        lines += _projection(inputs["projection"])
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results folder")
    parser.add_argument("--out", type=Path, default=DOC, help="the document to write")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the document differs"
    )
    args = parser.parse_args(argv)
    try:
        text = render_performance(load_inputs(args.results))
    except ReportInputError as exc:
        parser.error(str(exc))
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run `make docs`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
