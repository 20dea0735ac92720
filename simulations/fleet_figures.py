"""The fleet simulation's figures: per step, the knee, storage per sample, the table.

A step's figures are measured on the agents' side (``fleet_agents.Ledger``): throughput
is the verdicts that arrived in the measured window, capture-to-verdict latency runs
from the ``captured_at`` the agent put in the header to the verdict's arrival, and a
sample without a verdict after the drain counts as lost. CPU is read per process
(with its children) around the window.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

from simulations.fleet_agents import Ledger

__all__ = [
    "FleetStep",
    "cpu_seconds",
    "find_knee",
    "percentile_ms",
    "print_fleet",
    "step_figures",
    "storage_figures",
]


@dataclass
class FleetStep:
    """The figures of one fleet size."""

    agents: int
    rate_per_agent: float
    offered_per_s: float  # nominal: agents x rate
    published_per_s: float  # what the generator actually sent in the window
    achieved_per_s: float  # verdicts received in the window
    receipts_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    published: int
    lost: int
    loss_share: float
    generator_cpu_cores: float  # CPU seconds per wall second of this process
    generator_lag_p99_ms: float  # how late the generator published against its schedule
    verifier_cpu_cores: float | None
    broker_cpu_cores: float | None
    window_s: float
    backlog_in: int = 0  # earlier steps' samples still without a verdict when this one began
    verifier_cpu_ms_per_verdict: float | None = None  # the verifier's CPU time per verdict
    load_avg_1m: float = 0.0  # the machine's 1-minute load average as the window ended
    healthy: bool = False

    def row(self) -> dict[str, Any]:
        return asdict(self)


def cpu_seconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        times = proc.cpu_times()
        total = times.user + times.system
        for child in proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                t = child.cpu_times()
                total += t.user + t.system
        return float(total)
    except psutil.Error:
        return None


def percentile_ms(values: Sequence[float], q: float) -> float | None:
    return None if not values else round(float(np.percentile(values, q)) * 1000, 1)


# --- the knee ----------------------------------------------------------------------


def find_knee(
    steps: Sequence[FleetStep],
    *,
    ratio: float = 0.9,
    p99_limit_s: float = 1.0,
    p99_factor: float = 5.0,
) -> dict[str, Any]:
    """Mark each step healthy or not and name the knee: the step after the last healthy one.

    A step is healthy when achieved throughput is at least ``ratio`` of the load the
    generator sent, nothing was lost, its p99 is within ``max(p99_limit_s,
    p99_factor x the first step's p99)``, and it did not start behind (no backlog
    from an earlier step). Unhealthy steps below the last healthy one (a passing
    hiccup, such as a neighbour's burst on a shared machine) are listed, not taken
    for the knee.
    """
    base = next((s.p99_ms for s in steps if s.p99_ms is not None), None)
    bound_ms = max(p99_limit_s * 1000, p99_factor * base) if base is not None else None
    for step in steps:
        # Against what the generator really sent: a starved generator is not a slow cloud.
        sent = step.published_per_s
        tracks = sent > 0 and step.achieved_per_s >= ratio * sent
        tail_ok = step.p99_ms is not None and (bound_ms is None or step.p99_ms <= bound_ms)
        step.healthy = bool(tracks and step.lost == 0 and tail_ok and step.backlog_in == 0)
    healthy_at = [i for i, s in enumerate(steps) if s.healthy]
    last_ok = steps[healthy_at[-1]] if healthy_at else None
    after = healthy_at[-1] + 1 if healthy_at else 0
    knee = steps[after] if after < len(steps) else None
    hiccups = [s.agents for s in steps[: healthy_at[-1] if healthy_at else 0] if not s.healthy]
    capacity = max((s.achieved_per_s for s in steps), default=0.0)
    reason = None
    if knee is not None:
        why = []
        if knee.achieved_per_s < ratio * knee.published_per_s:
            why.append(
                f"achieved {knee.achieved_per_s:.0f}/s < {ratio:.0%} of offered"
                f" {knee.published_per_s:.0f}/s"
            )
        if knee.lost:
            why.append(f"{knee.lost} samples without a verdict after the drain")
        if knee.backlog_in:
            why.append(f"started behind by {knee.backlog_in} samples")
        if knee.p99_ms is None or (bound_ms is not None and knee.p99_ms > bound_ms):
            why.append(f"p99 {knee.p99_ms} ms > {bound_ms:.0f} ms" if bound_ms else "no verdicts")
        reason = "; ".join(why)
    short = [s.agents for s in steps if s.published_per_s < 0.95 * s.offered_per_s]
    return {
        "generator_short_at": short,  # sizes where the generator sent < 95% of its schedule
        "unhealthy_below_knee": hiccups,
        "knee_agents": knee.agents if knee else None,
        "last_healthy_agents": last_ok.agents if last_ok else None,
        "last_healthy_per_s": last_ok.achieved_per_s if last_ok else None,
        "max_achieved_per_s": capacity,
        "p99_bound_ms": bound_ms,
        "reason": reason,
    }


def step_figures(
    step: int,
    agents: int,
    rate_per_agent: float,
    ledger: Ledger,
    window: tuple[float, float],
    cpu: dict[str, float | None],
    lags: list[float],
    backlog_in: int,
) -> FleetStep:
    w0, w1 = window
    span = w1 - w0
    ids = [sid for sid, s in ledger.step_of.items() if s == step]
    in_window = [sid for sid in ids if w0 <= ledger.captured[sid] < w1]
    # Every verdict that arrived in the window counts: after an overloaded step the
    # verifier works through the earlier backlog first, and that is throughput too.
    verdicts_in_window = sum(1 for t in ledger.verdict_at.values() if w0 <= t < w1)
    receipts_in_window = sum(1 for sid in ids if w0 <= ledger.receipt_at.get(sid, -1) < w1)
    latencies = [
        ledger.verdict_at[sid] - ledger.captured[sid]
        for sid in in_window
        if sid in ledger.verdict_at
    ]
    lost = sum(1 for sid in ids if sid not in ledger.verdict_at)
    return FleetStep(
        agents=agents,
        rate_per_agent=rate_per_agent,
        offered_per_s=round(agents * rate_per_agent, 1),
        published_per_s=round(len(in_window) / span, 1),
        achieved_per_s=round(verdicts_in_window / span, 1),
        receipts_per_s=round(receipts_in_window / span, 1),
        p50_ms=percentile_ms(latencies, 50),
        p99_ms=percentile_ms(latencies, 99),
        mean_ms=round(float(np.mean(latencies)) * 1000, 1) if latencies else None,
        published=len(ids),
        lost=lost,
        loss_share=round(lost / max(1, len(ids)), 4),
        generator_cpu_cores=round(cpu["generator"] or 0.0, 3),
        generator_lag_p99_ms=percentile_ms(lags, 99) or 0.0,
        verifier_cpu_cores=None if cpu["verifier"] is None else round(cpu["verifier"], 3),
        broker_cpu_cores=None if cpu["broker"] is None else round(cpu["broker"], 3),
        window_s=round(span, 2),
        backlog_in=backlog_in,
        verifier_cpu_ms_per_verdict=(
            round(cpu["verifier"] * span / verdicts_in_window * 1000, 2)
            if cpu["verifier"] is not None and verdicts_in_window
            else None
        ),
    )


def storage_figures(database_url: str, blob_dir: Path) -> dict[str, Any]:
    """Bytes per stored sample: table + index + TOAST bytes of samples and verdicts, blobs."""
    from sqlalchemy import create_engine, func, select, text

    from cloud_service.db.models import Sample
    from cloud_service.db.models import Verdict as VerdictRow

    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            samples = int(conn.scalar(select(func.count()).select_from(Sample)) or 0)
            verdicts = int(conn.scalar(select(func.count()).select_from(VerdictRow)) or 0)
            if engine.dialect.name == "postgresql":
                s_bytes = int(conn.scalar(text("SELECT pg_total_relation_size('samples')")) or 0)
                v_bytes = int(conn.scalar(text("SELECT pg_total_relation_size('verdicts')")) or 0)
            else:
                s_bytes = v_bytes = 0
    finally:
        engine.dispose()
    blob_bytes = sum(p.stat().st_size for p in blob_dir.rglob("*") if p.is_file())
    out: dict[str, Any] = {
        "database": engine.dialect.name,
        "samples_stored": samples,
        "verdicts_stored": verdicts,
        "blob_bytes_per_sample": round(blob_bytes / samples, 1) if samples else None,
    }
    if s_bytes:
        out["sample_row_bytes"] = round(s_bytes / max(1, samples), 1)
        out["verdict_row_bytes"] = round(v_bytes / max(1, verdicts), 1)
    return out


def print_fleet(report: dict[str, Any], console: Console) -> None:
    """The sweep as a table, then the knee."""
    table = Table(
        title=f"fleet load: {report['teacher']}, {report['payload_bytes']} B envelopes,"
        f" {report['config']['rate_per_agent']}/s per agent"
    )
    heads = [
        "agents", "offered/s", "sent/s", "verdicts/s", "p50 ms", "p99 ms", "lost",
        "backlog in", "gen CPU", "verifier CPU", "CPU ms/verdict", "broker CPU", "load", "ok",
    ]  # fmt: skip
    for head in heads:
        table.add_column(head, justify="right")
    for s in report["steps"]:

        def cores(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        table.add_row(
            str(s["agents"]),
            f"{s['offered_per_s']:.0f}",
            f"{s['published_per_s']:.0f}",
            f"{s['achieved_per_s']:.0f}",
            str(s["p50_ms"]),
            str(s["p99_ms"]),
            str(s["lost"]),
            str(s.get("backlog_in", 0)),
            cores(s["generator_cpu_cores"]),
            cores(s["verifier_cpu_cores"]),
            cores(s.get("verifier_cpu_ms_per_verdict")),
            cores(s["broker_cpu_cores"]),
            cores(s.get("load_avg_1m")),
            "yes" if s["healthy"] else "no",
        )
    console.print(table)
    knee = report["knee"]
    if knee["knee_agents"] is None:
        console.print(
            f"no knee up to {report['steps'][-1]['agents']} agents"
            f" (max {knee['max_achieved_per_s']:.0f} verdicts/s)"
        )
    else:
        console.print(
            f"knee at {knee['knee_agents']} agents: {knee['reason']}. Last healthy:"
            f" {knee['last_healthy_agents']} agents at {knee['last_healthy_per_s']} verdicts/s;"
            f" most achieved: {knee['max_achieved_per_s']:.0f} verdicts/s.",
            highlight=False,
        )
    if knee.get("generator_short_at"):
        console.print(
            f"[yellow]the generator sent under 95% of its schedule at"
            f" {knee['generator_short_at']} agents: those rows understate the offered load[/]"
        )
    if knee.get("unhealthy_below_knee"):
        console.print(
            f"unhealthy below the knee (passing): {knee['unhealthy_below_knee']} agents",
            highlight=False,
        )
    console.print(
        f"generator: at most {report['generator_peak_cpu_cores']:.2f} cores"
        f" ({report['generator_peak_machine_share']:.0%} of {report['machine']['cpus']} CPUs);"
        f" storage: {report['storage']}",
        highlight=False,
    )
