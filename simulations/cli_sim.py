"""``edgeloop sim``: fleet load, the cost of each processing location, the projection."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from shared.console import JsonOption, fail, print_json
from shared.errors import EdgeLoopError

__all__ = ["sim_app"]

sim_app = typer.Typer(
    help="Simulations: fleet load on one machine, cost by processing location, projection.",
    no_args_is_help=True,
)

# Tables are wide; progress goes to stderr so --json output stays parseable.
_out = Console(width=160)
_err = Console(stderr=True, width=160)


BenchOption = typer.Option(
    [Path("bench/results/latest.json")],
    "--bench",
    help="make bench's results; repeat to fill sections missing from the first (first wins).",
)


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        fail(f"{what} must be comma-separated integers, e.g. 50,100,200; got {text!r}")
    if not values or any(v < 1 for v in values):
        fail(f"{what} must be positive integers; got {text!r}")
    return values


def _read_json(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        fail(f"cannot read {path}: {exc}")
    if not isinstance(data, dict):
        fail(f"{path} holds no JSON object")
    return data


def _write(path: Path | None, report: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(report, indent=2, sort_keys=True, default=str))


@sim_app.command("fleet")
def fleet_command(
    sizes: str = typer.Option("50,100,200,400,800", help="Fleet sizes to sweep (agents)."),
    rate: float = typer.Option(1.0, min=0.01, max=1000, help="Samples/s each agent forwards."),
    duration: float = typer.Option(20.0, min=1, help="Measured seconds per fleet size."),
    warmup: float = typer.Option(3.0, min=0, help="Unmeasured seconds before each window."),
    drain: float = typer.Option(20.0, min=0, help="Seconds to wait for outstanding verdicts."),
    image_px: int = typer.Option(208, min=16, max=4096, help="Camera crop side (JPEG q90)."),
    teacher: str = typer.Option(
        "auto",
        help="auto (full reference if cached, else quick), reference, quick, demo, or a path.",
    ),
    broker_url: str | None = typer.Option(
        None, help="Broker to load (mqtt://...); a private Mosquitto when unset."
    ),
    database_url: str | None = typer.Option(
        None, help="SQLAlchemy URL; a fresh PostgreSQL database on 127.0.0.1, else SQLite."
    ),
    out: Path | None = typer.Option(None, help="Also write the JSON report to this file."),
    as_json: bool = JsonOption,
) -> None:
    """Sweep the fleet size against the real broker and verifier; print the table and the knee."""
    from simulations.fleet import FleetConfig, print_fleet, run_fleet

    config = FleetConfig(
        sizes=_ints(sizes, "--sizes"),
        rate_per_agent=rate,
        duration_s=duration,
        warmup_s=warmup,
        drain_s=drain,
        image_px=image_px,
        teacher=teacher,
        broker_url=broker_url,
        database_url=database_url,
    )
    try:
        report = run_fleet(config, console=_err)
    except EdgeLoopError as exc:
        fail(exc.message)
    _write(out, report)
    if as_json:
        print_json(report)
    else:
        print_fleet(report, _out)


@sim_app.command("cost")
def cost_command(
    threshold: float = typer.Option(
        0.6, min=0.0, max=1.01, help="Hybrid: forward frames below this student confidence."
    ),
    audit_share: float = typer.Option(0.01, min=0.0, max=1.0, help="Hybrid: audit share."),
    frames: int = typer.Option(2000, min=50, max=200_000, help="Reference stream frames."),
    drifts: str = typer.Option("clean,blur:0.8", help="Streams to measure: clean and/or drifts."),
    frame_px: int = typer.Option(64, help="Envelope size from the bench: 64, 224 or 640."),
    bench: list[Path] = BenchOption,
    fleet_json: Path | None = typer.Option(None, help="A fleet report (edgeloop sim fleet)."),
    verifier_per_s: float | None = typer.Option(
        None, min=0.001, help="Verifier samples/s per host, measured elsewhere (e.g. a GPU host)."
    ),
    verifier_kind: str = typer.Option("cpu", help="cpu or gpu: which instance price applies."),
    set_: list[str] = typer.Option(
        [], "--set", help="Override a stated price or assumption: NAME=VALUE (repeatable)."
    ),
    plot: Path = typer.Option(Path("cost.png"), help="Where to save the PNG plot."),
    out: Path | None = typer.Option(None, help="Also write the JSON report to this file."),
    as_json: bool = JsonOption,
) -> None:
    """Edge-only vs cloud-only vs hybrid: latency, accuracy, cost per camera-hour; a sweep."""
    from simulations.cost import parse_price_overrides, print_cost, run_cost

    if verifier_kind not in ("cpu", "gpu"):
        fail(f"--verifier-kind must be cpu or gpu, got {verifier_kind!r}")
    try:
        prices = parse_price_overrides(set_)
    except ValueError as exc:
        fail(str(exc))
    try:
        report = run_cost(
            bench_path=bench,
            fleet_report=_read_json(fleet_json),
            prices=prices,
            threshold=threshold,
            audit_share=audit_share,
            frames=frames,
            drifts=tuple(d.strip() for d in drifts.split(",") if d.strip()),
            frame_px=frame_px,
            verifier_per_s=verifier_per_s,
            verifier_kind=verifier_kind,
            plot=plot,
            console=_err,
        )
    except (EdgeLoopError, OSError, KeyError, StopIteration) as exc:
        fail(f"cost model: {exc}")
    _write(out, report)
    if as_json:
        print_json(report)
    else:
        print_cost(report, _out)


@sim_app.command("project")
def project_command(
    cameras: str = typer.Option("10000,100000", help="Fleet sizes to project (cameras)."),
    cost_json: Path | None = typer.Option(
        None, help="A cost report (edgeloop sim cost --out): its forwarded share and inputs."
    ),
    forward_share: float | None = typer.Option(
        None, min=0.0, max=1.0, help="Share of frames forwarded (instead of measuring it)."
    ),
    threshold: float = typer.Option(0.6, min=0.0, max=1.01, help="When measuring the share."),
    stream: str = typer.Option("clean", help="Which stream of the cost report gives the share."),
    fleet_json: Path | None = typer.Option(None, help="A fleet report (edgeloop sim fleet)."),
    verifier_per_s: float | None = typer.Option(
        None, min=0.001, help="Verifier samples/s per host measured elsewhere (e.g. a GPU host)."
    ),
    host_cores: int | None = typer.Option(
        None,
        min=1,
        max=1024,
        help="Verifier host shape: its CPU cores; hosts come from the bench's verifier CPU"
        " per sample (goal 1) instead of an end-to-end rate.",
    ),
    host_teacher_per_s: float | None = typer.Option(
        None,
        min=0.001,
        help="With --host-cores: the teacher's measured batched samples/s on the host's"
        " accelerator (without it the teacher runs on the host's CPU).",
    ),
    frame_px: int = typer.Option(64, help="Envelope and image size from the bench: 64/224/640."),
    bench: list[Path] = BenchOption,
    database_url: str | None = typer.Option(
        None, help="Where to measure row bytes; a scratch PostgreSQL database, else SQLite."
    ),
    rows: int = typer.Option(5000, min=100, max=1_000_000, help="Rows to measure bytes on."),
    set_: list[str] = typer.Option([], "--set", help="Override a stated assumption: NAME=VALUE."),
    as_json: bool = JsonOption,
) -> None:
    """Broker messages/s, verifier hosts, database and blob bytes/day at 10k and 100k cameras."""
    from simulations.cost import (
        accuracy_curve,
        load_measured,
        measure_stream,
        merge_bench,
        parse_price_overrides,
    )
    from simulations.projection import (
        HostShape,
        build_inputs,
        host_capacity,
        measure_row_bytes,
        print_projection,
        project,
    )

    counts = _ints(cameras, "--cameras")
    if host_teacher_per_s is not None and host_cores is None:
        fail("--host-teacher-per-s states a host's accelerator: give --host-cores with it")
    if host_cores is not None and verifier_per_s is not None:
        fail("give either --verifier-per-s or a host shape (--host-cores), not both")
    try:
        prices = parse_price_overrides(set_)
    except ValueError as exc:
        fail(str(exc))
    fleet = _read_json(fleet_json)
    cost = _read_json(cost_json)
    try:
        host_note = ""
        if host_cores is not None:
            shape = HostShape(host_cores, host_teacher_per_s)
            cloud, cloud_cite = merge_bench(bench)["cloud"]
            verifier_per_s, host_note = host_capacity(shape, cloud)
            host_note = f"{cloud_cite}: {host_note}"
        measured = load_measured(
            bench,
            fleet_report=fleet,
            frame_px=frame_px,
            verifier_per_s=verifier_per_s,
            verifier_kind="gpu" if verifier_per_s and host_teacher_per_s else "cpu",
        )
        if host_note:
            measured.sources["verifier_per_s"] = host_note
        share_source = "given on the command line"
        if forward_share is None and cost is not None:
            stream = stream if stream in cost["tables"] else next(iter(cost["tables"]))
            hybrid = cost["tables"][stream][2]
            forward_share = float(hybrid["verified_share"])
            share_source = f"cost report: {hybrid['location']} on the {stream} reference stream"
        if forward_share is None:
            run = measure_stream(frames=2000, console=_err)
            point = accuracy_curve(
                run["student_confidence"],
                run["student_correct"],
                run["teacher_correct"],
                (threshold,),
            )[0]
            forward_share = point.forwarded_share
            share_source = (
                f"measured: {run['models']} student on {run['frames']} clean reference-stream"
                f" frames, threshold {threshold:g} + 1% audit"
            )
        storage = (fleet or {}).get("storage", {})
        if storage.get("sample_row_bytes") and storage.get("samples_stored", 0) >= 1000:
            # The verifier's own rows, written under load: preferred over a scratch measure.
            row_bytes = {
                "database": storage["database"],
                "rows": storage["samples_stored"],
                "sample_row_bytes": storage["sample_row_bytes"],
                "verdict_row_bytes": storage["verdict_row_bytes"],
                "method": "fleet run: pg_total_relation_size of the verifier's tables / rows",
            }
        else:
            row_bytes = measure_row_bytes(database_url, rows=rows)
        envelope, envelope_cite = merge_bench(bench)["envelope"]
        image_bytes = int(envelope[f"{frame_px}px"]["image_bytes"])
    except (EdgeLoopError, OSError, KeyError) as exc:
        fail(f"projection: {exc}")
    inputs, sources = build_inputs(
        measured=measured,
        prices=prices,
        forwarded_share=forward_share,
        rows=row_bytes,
        image_bytes=image_bytes,
    )
    sources["forwarded_share"] = share_source
    sources["image_bytes"] = f"{envelope_cite}: envelope.'{frame_px}px'.image_bytes"
    report = {
        "projection": [project(n, inputs) for n in counts],
        "inputs": {k: v for k, v in vars(inputs).items()},
        "sources": sources,
        "row_bytes": row_bytes,
        "verifier_note": (
            f"verifier hosts from {inputs.verifier_per_s:,.0f} samples/s per host"
            f" ({measured.sources['verifier_per_s']}) at {inputs.cloud_utilisation:.0%}"
            " planned utilisation."
            + (
                f" A stated host of {host_cores} cores"
                + (
                    f" whose accelerator runs the teacher at {host_teacher_per_s:g}/s."
                    if host_teacher_per_s
                    else " running the teacher on its CPU."
                )
                if host_cores is not None
                else " On this CPU-only machine that is a CPU figure; for a GPU host state"
                " its shape (--host-cores, --host-teacher-per-s) or pass its measured"
                " end-to-end rate (--verifier-per-s)."
            )
        ),
    }
    if as_json:
        print_json(report)
    else:
        print_projection(report, _out)


if __name__ == "__main__":
    sim_app()
