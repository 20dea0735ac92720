"""``edgeloop jobs``: schedule, run, list, show, cancel, logs, and the distill worker.

The commands talk to the database directly (``database_url`` of the cloud settings),
as the API does: the same functions, the same checks, no server needed. ``worker``
runs a distill worker in this process until SIGTERM/SIGINT.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from cloud_service.db.session import make_engine, make_session_factory, upgrade_database
from cloud_service.jobs import queue as jobs
from cloud_service.jobs import schedules
from cloud_service.jobs.worker import serve_worker
from cloud_service.settings import CloudSettings
from shared.console import ConfigOption, JsonOption, fail, load_settings, print_json
from shared.errors import EdgeLoopError

jobs_app = typer.Typer(help="Distillation jobs: schedule, run, watch, cancel; run a worker.")
_console = Console()
_err_console = Console(stderr=True)


def _sessions(config: Path | None) -> tuple[CloudSettings, sessionmaker[Session]]:
    settings = load_settings(CloudSettings, config)
    url = settings.resolved_database_url
    alembic_log = logging.getLogger("alembic")
    alembic_log.setLevel(logging.WARNING)  # a command's output is its answer, not migrations
    try:
        upgrade_database(url)
    except EdgeLoopError as exc:
        fail(exc.message)
    # No pool: a command's connections close with its sessions, none is left open.
    return settings, make_session_factory(make_engine(url, poolclass=NullPool))


FleetOption = typer.Option(
    None,
    "--fleet",
    help="The fleet the job trains for (default: the only known fleet, when there is one).",
)


def _with_fleet(session: Session, fleet: str | None, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with the fleet resolved: --fleet, else --param fleet=, else the only one."""
    given = params.get("fleet")
    if fleet is not None and given is not None and given != fleet:
        fail(f"--fleet {fleet} and --param fleet={given} disagree; give one")
    chosen = jobs.resolve_fleet(session=session, fleet=fleet or given)
    return {**params, "fleet": chosen}


def _waiting_notice(session: Session) -> str | None:
    return jobs.queue_status(session=session).warning


def _params(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; values are read as JSON when they parse, else as text."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"bad --param {item!r}: expected KEY=VALUE, e.g. --param epochs=6")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _job_dict(job: Any, *, metrics: bool = False) -> dict[str, Any]:
    keys = [
        "id", "state", "fleet", "phase", "percent", "eta_s", "attempts", "max_attempts", "reason",
        "lease_owner", "result_version", "snapshot_id", "error", "params", "created_at",
        "started_at", "finished_at",
    ]  # fmt: skip
    out = {k: getattr(job, k) for k in keys if k != "fleet"}
    out["fleet"] = (job.params or {}).get("fleet")
    for k in ("created_at", "started_at", "finished_at"):
        out[k] = out[k].isoformat() if out[k] else None
    if metrics:
        out["metrics"] = job.metrics
    return out


def _guard(fn: Any) -> Any:
    try:
        return fn()
    except EdgeLoopError as exc:
        fail(exc.message)


@jobs_app.command("run")
def run_job(
    fleet: str | None = FleetOption,
    param: list[str] = typer.Option(
        [], "--param", "-p", help="KEY=VALUE job parameter (`edgeloop jobs params` lists them)."
    ),
    reason: str = typer.Option("run now (CLI)", help="Why, for the log."),
    max_attempts: int = typer.Option(3, min=1, max=20),
    config: Path | None = ConfigOption,
    as_json: bool = JsonOption,
) -> None:
    """Queue a job now (a distill worker picks it up)."""
    _, sessions = _sessions(config)

    def go() -> tuple[dict[str, Any], str | None]:
        with sessions.begin() as s:
            job = jobs.enqueue(
                session=s,
                params=_with_fleet(s, fleet, _params(param)),
                reason=reason,
                max_attempts=max_attempts,
            )
            out = _job_dict(job)
        with sessions() as s:
            return out, _waiting_notice(s)

    out, notice = _guard(go)
    if as_json:
        print_json(out)
        return
    _console.print(f"queued job {out['id']} for fleet {out['fleet']}")
    if notice:
        _err_console.print(f"warning: {notice}", markup=False)


@jobs_app.command("params")
def job_params(as_json: bool = JsonOption) -> None:
    """The parameters a job takes (--param KEY=VALUE): type, default, range, meaning."""
    rows = jobs.job_parameter_docs()
    if as_json:
        print_json(rows)
        return
    table = Table(title="job parameters (--param KEY=VALUE)")
    for col in ("name", "type", "default", "range", "meaning"):
        table.add_column(col, overflow="fold")
    for r in rows:
        default = "-" if r["default"] is None else json.dumps(r["default"])
        table.add_row(r["name"], r["type"], default, r["range"] or "", r["meaning"])
    _console.print(table)


@jobs_app.command("list")
def list_jobs(
    state: list[str] = typer.Option([], "--state", help="Only jobs in this state."),
    limit: int = typer.Option(50, min=1, max=1000),
    config: Path | None = ConfigOption,
    as_json: bool = JsonOption,
) -> None:
    """The latest jobs, newest first."""
    _, sessions = _sessions(config)
    with sessions() as s:
        rows = _guard(
            lambda: [_job_dict(j) for j in jobs.list_jobs(session=s, states=state, limit=limit)]
        )
        status = jobs.queue_status(session=s)
    if as_json:
        print_json(rows)
        return
    table = Table(title="distill jobs")
    for col in ("id", "state", "fleet", "phase", "%", "attempts", "version", "reason"):
        table.add_column(col)
    for r in rows:
        shown = r["state"]
        if shown == "queued" and status.waiting_without_worker:
            shown = "queued (no worker)"
        table.add_row(
            str(r["id"]), shown, r["fleet"] or "", r["phase"] or "", f"{r['percent']:.0f}",
            f"{r['attempts']}/{r['max_attempts']}", r["result_version"] or "", r["reason"] or "",
        )  # fmt: skip
    _console.print(table)
    if status.warning:
        _console.print(f"warning: {status.warning}", markup=False)


@jobs_app.command("show")
def show_job(job_id: int, config: Path | None = ConfigOption, as_json: bool = JsonOption) -> None:
    """One job with its parameters and metrics."""
    _, sessions = _sessions(config)
    with sessions() as s:
        out = _guard(lambda: _job_dict(jobs.get_job(session=s, job_id=job_id), metrics=True))
        status = jobs.queue_status(session=s)
    if out["state"] == "queued":
        out["waiting"] = status.warning or f"{status.live_workers} distill worker(s) live"
    if as_json:
        print_json(out)
        return
    for key, value in out.items():
        if key not in ("metrics", "waiting"):
            _console.print(f"[bold]{key}[/]: {value}", highlight=False)
    if out["state"] == "queued" and status.warning:
        _console.print(f"warning: {status.warning}", markup=False)
    gate = out["metrics"].get("gate")
    if gate:
        _console.print(f"[bold]gate[/]: {gate}")
    evaluation = out["metrics"].get("evaluation")
    if evaluation:
        table = Table(title="evaluation (top-1)")
        table.add_column("data")
        for model in evaluation:
            table.add_column(model, justify="right")
        for data in next(iter(evaluation.values())):
            table.add_row(data, *(f"{100 * evaluation[m][data]:.1f}" for m in evaluation))
        _console.print(table)


@jobs_app.command("cancel")
def cancel_job(job_id: int, config: Path | None = ConfigOption) -> None:
    """Cancel a queued job, or ask a running one to stop."""
    _, sessions = _sessions(config)

    def go() -> str:
        with sessions.begin() as s:
            return jobs.cancel(session=s, job_id=job_id).state

    state = _guard(go)
    _console.print(f"job {job_id}: {'cancelled' if state == 'cancelled' else 'cancel requested'}")


@jobs_app.command("logs")
def job_logs(
    job_id: int,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until it ends."),
    config: Path | None = ConfigOption,
) -> None:
    """A job's log lines (``--follow`` until the job ends)."""
    _, sessions = _sessions(config)
    after = 0
    for _ in range(100_000):  # bounded: about a day of following at 1 s
        with sessions() as s:
            lines = _guard(lambda a=after: jobs.read_logs(session=s, job_id=job_id, after_id=a))
            state = jobs.get_job(session=s, job_id=job_id).state
            for line in lines:
                _console.print(f"{line.at:%H:%M:%S} {line.level:7} {line.message}", markup=False)
                after = line.id
        if not follow or state in ("succeeded", "failed", "cancelled"):
            return
        time.sleep(1.0)


@jobs_app.command("schedule")
def schedule(
    name: str = typer.Argument(..., help="A unique name."),
    cron: str | None = typer.Option(None, help="Five-field cron, UTC, e.g. '0 3 * * *'."),
    every: float | None = typer.Option(None, help="An interval in seconds."),
    new_samples: int | None = typer.Option(
        None, help="Trigger: this many new verified samples since the serving model."
    ),
    max_forward_rate: float | None = typer.Option(None, help="Drift trigger: forward rate bound."),
    max_disagreement: float | None = typer.Option(
        None, help="Drift trigger: teacher disagreement bound."
    ),
    window_s: float = typer.Option(900.0, help="Drift trigger: the window, seconds."),
    fleet: str | None = FleetOption,
    param: list[str] = typer.Option(
        [], "--param", "-p", help="KEY=VALUE job parameter (`edgeloop jobs params` lists them)."
    ),
    disable: bool = typer.Option(False, help="Create it disabled."),
    config: Path | None = ConfigOption,
    as_json: bool = JsonOption,
) -> None:
    """Create a schedule: --cron, --every, --new-samples, or a drift bound."""
    drift = max_forward_rate is not None or max_disagreement is not None
    chosen = [cron is not None, every is not None, new_samples is not None, drift]
    if sum(chosen) != 1:
        fail("give exactly one of --cron, --every, --new-samples, or drift bounds")
    trigger: dict[str, Any] = {}
    if cron is not None:
        kind, expression = "cron", cron
    elif every is not None:
        kind, expression = "interval", f"{every:g}"
    elif new_samples is not None:
        kind, expression, trigger = "trigger", "new_samples", {"min_samples": new_samples}
    else:
        kind, expression = "trigger", "drift"
        trigger = {"window_s": window_s}
        if max_forward_rate is not None:
            trigger["max_forward_rate"] = max_forward_rate
        if max_disagreement is not None:
            trigger["max_disagreement"] = max_disagreement
    _, sessions = _sessions(config)

    def go() -> dict[str, Any]:
        with sessions.begin() as s:
            sch = schedules.create_schedule(
                session=s,
                name=name,
                kind=kind,
                expression=expression,
                trigger=trigger,
                params=_with_fleet(s, fleet, _params(param)),
                enabled=not disable,
            )
            return _schedule_dict(sch)

    out = _guard(go)
    if as_json:
        print_json(out)
    else:
        _console.print(
            f"schedule {out['id']} {out['name']} for fleet {out['fleet']}:"
            f" {out['kind']} {out['expression']}"
        )


def _schedule_dict(x: Any) -> dict[str, Any]:
    return {
        "id": x.id,
        "name": x.name,
        "fleet": (x.params or {}).get("fleet"),
        "kind": x.kind,
        "expression": x.expression,
        "trigger": x.trigger,
        "params": x.params,
        "enabled": x.enabled,
        "last_run_at": x.last_run_at.isoformat(timespec="seconds") if x.last_run_at else None,
        "next_run_at": x.next_run_at.isoformat(timespec="seconds") if x.next_run_at else None,
        "last_job_id": x.last_job_id,
    }


@jobs_app.command("schedules")
def list_schedules(
    enable: int | None = typer.Option(None, help="Enable this schedule id."),
    disable: int | None = typer.Option(None, help="Disable this schedule id."),
    delete: int | None = typer.Option(None, help="Delete this schedule id."),
    run_now: int | None = typer.Option(None, "--run-now", help="Queue this schedule's job now."),
    config: Path | None = ConfigOption,
    as_json: bool = JsonOption,
) -> None:
    """List schedules; --enable/--disable/--delete/--run-now ID act on one first."""
    _, sessions = _sessions(config)

    def act() -> None:
        with sessions.begin() as s:
            if enable is not None:
                schedules.set_enabled(session=s, schedule_id=enable, enabled=True)
            if disable is not None:
                schedules.set_enabled(session=s, schedule_id=disable, enabled=False)
            if delete is not None:
                schedules.delete_schedule(session=s, schedule_id=delete)
            if run_now is not None:
                job = schedules.run_now(session=s, schedule_id=run_now)
                if not as_json:
                    _console.print(f"queued job {job.id}")

    _guard(act)
    with sessions() as s:
        rows = [_schedule_dict(x) for x in schedules.list_schedules(session=s)]
    if as_json:
        print_json(rows)
        return
    if not rows:
        _console.print("no schedules (create one with `edgeloop jobs schedule NAME ...`)")
        return
    table = Table(title="schedules (times UTC)")
    for col in ("id", "name", "fleet", "when", "on", "next run", "last job"):
        table.add_column(col, no_wrap=col in ("name", "fleet", "next run"))
    for r in rows:
        when = f"{r['kind']} {r['expression']}"
        if r["trigger"]:
            when += " " + ", ".join(f"{k}={v}" for k, v in sorted(r["trigger"].items()))
        next_run = r["next_run_at"][:16].replace("T", " ") if r["next_run_at"] else "-"
        table.add_row(
            str(r["id"]), r["name"], r["fleet"] or "", when, "yes" if r["enabled"] else "no",
            next_run, "-" if r["last_job_id"] is None else str(r["last_job_id"]),
        )  # fmt: skip
    _console.print(table)


@jobs_app.command("worker")
def worker(
    lease_s: float = typer.Option(30.0, min=1.0, help="Lease length; renewed every third."),
    poll_s: float = typer.Option(2.0, min=0.05, help="How often an idle worker looks."),
    max_jobs: int | None = typer.Option(None, min=1, help="Exit after this many jobs."),
    health_port: int | None = typer.Option(
        None, min=0, max=65535, help="Serve /healthz and /readyz on this port (probes)."
    ),
    health_host: str = typer.Option("0.0.0.0", help="Address of the probe server."),
    config: Path | None = ConfigOption,
) -> None:
    """Run a distill worker until SIGTERM/SIGINT (a running job is requeued on stop)."""
    settings = load_settings(CloudSettings, config)

    def started(w: Any) -> None:
        _console.print(f"distill worker {w.owner} on {settings.resolved_database_url}")

    w = _guard(
        lambda: serve_worker(
            settings,
            lease_s=lease_s,
            poll_s=poll_s,
            max_jobs=max_jobs,
            health_host=health_host,
            health_port=health_port,
            on_start=started,
        )
    )
    _console.print(f"ran {len(w.finished)} job(s): {w.finished}")
