"""Projection to 10,000 and 100,000 cameras: broker load, verifier hosts, storage per day.

    edgeloop sim project [--cameras 10000,100000] [--fleet-json F] [--cost-json C] [--json]

Arithmetic on measured figures, each named with where it comes from:

* bytes per stored sample: rows written through the verifier's own code path
  (``crud.insert_samples`` / ``crud.insert_verdicts`` on the real schema, migrated
  with Alembic) into a scratch database, then ``pg_total_relation_size`` (table,
  indexes and TOAST) divided by the rows; on SQLite the growth of the file. A fleet
  run's database (``edgeloop sim fleet --json``) gives the same figure from the
  verifier itself;
* the share of frames forwarded, from the cost model's accuracy run on the
  reference stream (``--cost-json``), or given;
* verifier samples/s per host: for a stated host shape (``--host-cores``, and
  ``--host-teacher-per-s`` for the teacher's measured rate on its accelerator), from
  ``make bench``'s verifier CPU per sample beyond the teacher and the decode, the
  decode's and (on a CPU host) the teacher's (``host_capacity``); else from a fleet
  run's last healthy step, else ``make bench``'s end-to-end figure. On this
  project's CPU-only machine that is a CPU figure; for a GPU verifier pass
  ``--verifier-per-s`` with the GPU host's measured end-to-end rate (the bench's GPU
  section measures the teacher alone, an upper bound: ingest, decode and the database
  also bound a host);
* envelope and image bytes, from ``make bench``'s envelope section.

Message rates count PUBLISH packets the broker receives and delivers (QoS 1
PUBACKs travel as well, one per PUBLISH in each direction, and are not counted).
Receipts are batched per agent over 50 ms windows, so at forward rates well under
20 samples/s per agent there is about one receipt per sample: an upper bound.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = [
    "PROJECTED",
    "HostShape",
    "ProjectionInputs",
    "host_capacity",
    "measure_row_bytes",
    "project",
    "project_many",
    "projected_cells",
]

SECONDS_PER_DAY = 86_400
# A typical ten-class verdict and edge answer, as the verifier and the agent store them.
_TEACHER_SCORES = [0.9123, 0.0312, 0.0111, 0.0101, 0.0099, 0.0088, 0.0077, 0.0066, 0.0012, 0.0011]
_EDGE_SCORES = [0.61, 0.2, 0.05, 0.04, 0.03, 0.02, 0.02, 0.01, 0.01, 0.01]


@dataclass(frozen=True)
class ProjectionInputs:
    """What the projection multiplies; ``sources`` says where each figure came from."""

    camera_fps: float
    forwarded_share: float
    verifier_per_s: float  # one verifier host, end to end
    cloud_utilisation: float
    envelope_bytes: int
    image_bytes: int  # what the blob store keeps per sample
    sample_row_bytes: float
    verdict_row_bytes: float
    verdict_bytes: int
    heartbeat_s: float
    status_bytes: int
    receipt_flush_s: float


@dataclass(frozen=True)
class HostShape:
    """A verifier host as stated: its CPU cores and, with an accelerator, the teacher's
    measured batched samples/s on it (None: the teacher runs on the host's CPU)."""

    cores: int
    teacher_per_s: float | None = None


def host_capacity(shape: HostShape, cloud: dict[str, Any]) -> tuple[float, str]:
    """Samples/s one verifier host of ``shape`` sustains, from ``make bench``'s cloud
    figures, and how it was reached.

    Per sample the host's cores pay the verifier's own CPU beyond the teacher and the
    JPEG decode (``verifier_overhead_ms_per_sample_1p``, goal 1 of the performance
    issue) and the decode; on a CPU host the teacher's inference as well
    (``teacher_cpu_ms_per_sample``). With an accelerator, the host sustains the lower
    of what its cores feed and what the teacher infers.
    """
    try:
        overhead = float(cloud["verifier_overhead_ms_per_sample_1p"])
        decode = float(cloud["decode_cpu_ms_per_sample"])
        teacher_cpu = float(cloud["teacher_cpu_ms_per_sample"])
    except (KeyError, TypeError) as exc:
        raise KeyError(
            f"the bench's cloud section has no {exc}: run `make bench` (its cloud section"
            " measures the verifier process) first"
        ) from None
    per_sample = overhead + decode + (teacher_cpu if shape.teacher_per_s is None else 0.0)
    fed = shape.cores * 1000.0 / per_sample
    if shape.teacher_per_s is None:
        how = (
            f"{shape.cores} cores / ({overhead:g} ms verifier + {decode:g} ms decode +"
            f" {teacher_cpu:g} ms teacher on the CPU) per sample"
        )
        return fed, how
    how = (
        f"min({shape.cores} cores / ({overhead:g} ms verifier + {decode:g} ms decode) ="
        f" {fed:,.0f}/s, teacher {shape.teacher_per_s:,.0f}/s)"
    )
    return min(fed, shape.teacher_per_s), how


def project(cameras: int, i: ProjectionInputs) -> dict[str, Any]:
    """Rates, hosts and bytes per day for ``cameras`` cameras, one agent each."""
    samples = cameras * i.camera_fps * i.forwarded_share  # per second
    per_agent = i.camera_fps * i.forwarded_share
    # One receipt per flush window with samples in it: at most one per sample, at most
    # 1/flush per agent.
    receipts = cameras * min(per_agent, 1.0 / i.receipt_flush_s)
    heartbeats = cameras / i.heartbeat_s
    publishes_in = samples + heartbeats + samples + receipts  # agents' + the verifier's
    deliveries_out = samples + heartbeats + samples + receipts  # to the verifier and agents
    hosts = samples / (i.verifier_per_s * i.cloud_utilisation)
    per_day = samples * SECONDS_PER_DAY
    return {
        "cameras": cameras,
        "frames_per_s": cameras * i.camera_fps,
        "samples_per_s": samples,
        "broker_publishes_in_per_s": publishes_in,
        "broker_deliveries_out_per_s": deliveries_out,
        "broker_messages_per_s": publishes_in + deliveries_out,
        "broker_connections": cameras + 1,
        "broker_mbit_per_s": (
            samples * i.envelope_bytes * 2
            + samples * i.verdict_bytes * 2
            + heartbeats * i.status_bytes * 2
        )
        * 8
        / 1e6,
        "verifier_hosts": math.ceil(hosts),
        "verifier_hosts_exact": hosts,
        "db_rows_per_day": per_day * 2,  # a samples row and a verdicts row per sample
        "db_bytes_per_day": per_day * (i.sample_row_bytes + i.verdict_row_bytes),
        "blob_bytes_per_day": per_day * i.image_bytes,
    }


def project_many(cameras: list[int], i: ProjectionInputs) -> list[dict[str, Any]]:
    return [project(n, i) for n in cameras]


def measure_row_bytes(database_url: str | None = None, *, rows: int = 5000) -> dict[str, Any]:
    """Bytes per sample row and per verdict row on the real schema, through the real CRUD.

    With no URL: a scratch PostgreSQL database on 127.0.0.1:5432 when one answers
    (dropped afterwards), else a SQLite file.
    """
    if database_url is not None:
        return _measure_rows(database_url, rows)
    from simulations.databases import fresh_database

    with (
        tempfile.TemporaryDirectory(prefix="edgeloop-rows-", ignore_cleanup_errors=True) as scratch,
        fresh_database(prefix="edgeloop_rows", fallback=Path(scratch) / "rows.db") as url,
    ):
        return _measure_rows(url, rows)


def _measure_rows(database_url: str, rows: int) -> dict[str, Any]:
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    from cloud_service.db import crud
    from cloud_service.db.session import make_engine, make_session_factory, upgrade_database
    from cloud_service.ingest import IngestSample, sample_row
    from shared.ids import new_sample_id
    from shared.messages import SampleHeader

    upgrade_database(database_url)
    engine = make_engine(database_url)
    sessions = make_session_factory(engine)
    sqlite_file = (
        Path(make_url(database_url).database or "") if engine.dialect.name == "sqlite" else None
    )
    size_before = sqlite_file.stat().st_size if sqlite_file else 0
    now = datetime.now(UTC)
    import numpy as np

    pixels = np.zeros((1, 1, 3), np.uint8)
    for start in range(0, rows, 1000):
        sample_rows, verdict_rows = [], []
        for k in range(start, min(rows, start + 1000)):
            header = SampleHeader(
                sample_id=new_sample_id(),
                fleet="warehouse-eu-1",
                agent=f"conveyor-cam-{k % 500:03d}",
                captured_at=now,
                model_name="edgeloop-student",
                model_version="2026.11.29-3",
                scores=_EDGE_SCORES,
                predicted=0,
                confidence=0.61,
                route_reason="low_confidence",
                priority=6,
                image_format="jpeg",
                image_width=64,
                image_height=64,
                image_bytes=2501,
            )
            sample = IngestSample(header, b"", pixels)
            sample_rows.append(sample_row(sample, now, sample.image_key))
            verdict_rows.append(
                {
                    "sample_id": header.sample_id,
                    "teacher_model": "teacher",
                    "teacher_version": "2026.11.29-1",
                    "scores": _TEACHER_SCORES,
                    "label": 0,
                    "confidence": 0.9123,
                    "agrees_with_edge": True,
                    "review": False,
                    "review_reasons": [],
                    "verified_at": now + timedelta(milliseconds=30),
                    "latency_s": 0.03,
                }
            )
        with sessions.begin() as session:
            crud.insert_samples(session=session, rows=sample_rows)
        with sessions.begin() as session:
            crud.insert_verdicts(session=session, rows=verdict_rows)
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("ANALYZE samples"))
            s_bytes = int(conn.scalar(text("SELECT pg_total_relation_size('samples')")) or 0)
            v_bytes = int(conn.scalar(text("SELECT pg_total_relation_size('verdicts')")) or 0)
            how = "pg_total_relation_size (table + indexes + TOAST) / rows"
        else:
            s_bytes = v_bytes = 0
            how = "SQLite file growth / rows (samples and verdicts together)"
    engine.dispose()
    if sqlite_file is not None:
        total = sqlite_file.stat().st_size - size_before
        wal = sqlite_file.with_name(sqlite_file.name + "-wal")
        total += wal.stat().st_size if wal.exists() else 0
        # One file: the sample figure carries both rows (and their indexes).
        s_bytes, v_bytes = total, 0
    return {
        "database": engine.dialect.name,
        "rows": rows,
        "sample_row_bytes": round(s_bytes / rows, 1),
        "verdict_row_bytes": round(v_bytes / rows, 1),
        "method": how,
    }


def status_bytes() -> int:
    """Bytes of one agent heartbeat as the agent encodes it, with its telemetry filled in."""
    from shared.messages import AgentStatus, encode_message

    status = AgentStatus(
        fleet="warehouse-eu-1",
        agent="conveyor-cam-042",
        state="online",
        sent_at=datetime.now(UTC),
        model_version="2026.11.29-3",
        provider="CPUExecutionProvider",
        frames_per_s=10.0,
        latency_p50_ms=2.43,
        latency_p99_ms=6.56,
        forward_rate=0.05,
        spool_depth=0,
        dropped_frames=0,
        agreement_rate=0.97,
        cpu_percent=31.5,
        memory_mb=160.4,
    )
    return len(encode_message(status))


def build_inputs(
    *,
    measured: Any,
    prices: Any,
    forwarded_share: float,
    rows: dict[str, Any],
    image_bytes: int,
) -> tuple[ProjectionInputs, dict[str, str]]:
    """The projection's inputs from the cost model's measured figures and stated prices."""
    from cloud_service.settings import CloudSettings
    from edge_agent.settings import AgentSettings

    heartbeat = float(AgentSettings.model_fields["heartbeat_s"].default)
    flush = float(CloudSettings.model_fields["receipt_flush_ms"].default) / 1000
    inputs = ProjectionInputs(
        camera_fps=prices.camera_fps,
        forwarded_share=forwarded_share,
        verifier_per_s=measured.verifier_per_s,
        cloud_utilisation=prices.cloud_utilisation,
        envelope_bytes=measured.envelope_bytes,
        image_bytes=image_bytes,
        sample_row_bytes=rows["sample_row_bytes"],
        verdict_row_bytes=rows["verdict_row_bytes"],
        verdict_bytes=measured.verdict_bytes,
        heartbeat_s=heartbeat,
        status_bytes=status_bytes(),
        receipt_flush_s=flush,
    )
    sources = {
        "camera_fps": "assumption (simulations.cost.Prices)",
        "verifier_per_s": measured.sources["verifier_per_s"],
        "cloud_utilisation": "assumption (simulations.cost.Prices)",
        "envelope_bytes": measured.sources["envelope_bytes"],
        "verdict_bytes": measured.sources["verdict_bytes"],
        "sample_row_bytes": f"measured: {rows.get('method', '')} on {rows.get('database')},"
        f" {rows.get('rows')} rows",
        "verdict_row_bytes": "measured, as sample_row_bytes",
        "heartbeat_s": "edge_agent AgentSettings.heartbeat_s default",
        "status_bytes": "encode_message(AgentStatus) with telemetry, measured here",
        "receipt_flush_s": "cloud_service CloudSettings.receipt_flush_ms default",
    }
    return inputs, sources


# What a projection gives per fleet size: label, key, format ("gb": bytes as GB).
PROJECTED = (
    ("frames/s at the cameras", "frames_per_s", "{:,.0f}"),
    ("samples/s forwarded", "samples_per_s", "{:,.0f}"),
    ("broker publishes in /s", "broker_publishes_in_per_s", "{:,.0f}"),
    ("broker deliveries out /s", "broker_deliveries_out_per_s", "{:,.0f}"),
    ("broker messages /s (in + out)", "broker_messages_per_s", "{:,.0f}"),
    ("broker connections", "broker_connections", "{:,}"),
    ("broker traffic, Mbit/s", "broker_mbit_per_s", "{:,.1f}"),
    ("verifier hosts", "verifier_hosts", "{:,}"),
    ("DB rows/day", "db_rows_per_day", "{:,.0f}"),
    ("DB GB/day", "db_bytes_per_day", "gb"),
    ("blob GB/day", "blob_bytes_per_day", "gb"),
)


def projected_cells(rows: list[dict[str, Any]], key: str, fmt: str) -> list[str]:
    """One ``PROJECTED`` line's cells, a fleet size each ("-" where a row lacks it)."""
    return [
        "-" if key not in r else f"{r[key] / 1e9:,.1f}" if fmt == "gb" else fmt.format(r[key])
        for r in rows
    ]


def print_projection(report: dict[str, Any], console: Console) -> None:
    """One column per fleet size; then the inputs and their sources."""
    rows = report["projection"]
    table = Table(title="projection (one agent per camera)")
    table.add_column("")
    for r in rows:
        table.add_column(f"{r['cameras']:,} cameras", justify="right")
    for label, key, fmt in PROJECTED:
        table.add_row(label, *projected_cells(rows, key, fmt))
    console.print(table)
    console.print("[bold]inputs[/]")
    inputs = report["inputs"]
    for key, value in inputs.items():
        console.print(f"  {key} = {value}  ({report['sources'].get(key, '')})", highlight=False)
    console.print(report["verifier_note"], highlight=False)


def inputs_dict(i: ProjectionInputs) -> dict[str, Any]:
    return asdict(i)
