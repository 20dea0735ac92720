"""``edgeloop jobs``: schedule, run, list, show, cancel, logs, and the distill worker.

The commands talk to the database directly (``database_url`` of the cloud settings),
as the API does: the same functions, the same checks, no server needed. ``worker``
runs a distill worker in this process until SIGTERM/SIGINT.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy.orm import Session, sessionmaker

from cloud_service.settings import CloudSettings
from distill import jobs, schedules
from shared.console import ConfigOption, JsonOption, fail, load_settings, print_json
from shared.errors import EdgeLoopError

jobs_app = typer.Typer(help="Distillation jobs: schedule, run, watch, cancel; run a worker.")
_console = Console()


def _sessions(config: Path | None) -> tuple[CloudSettings, sessionmaker[Session]]:
    from cloud_service.db.session import make_engine, make_session_factory, upgrade_database

    settings = load_settings(CloudSettings, config)
    url = settings.resolved_database_url
    upgrade_database(url)
    return settings, make_session_factory(make_engine(url))


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
        "id", "state", "phase", "percent", "eta_s", "attempts", "max_attempts", "reason",
        "lease_owner", "result_version", "snapshot_id", "error", "params", "created_at",
        "started_at", "finished_at",
    ]  # fmt: skip
    out = {k: getattr(job, k) for k in keys}
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
    param: list[str] = typer.Option([], "--param", "-p", help="KEY=VALUE job parameter."),
    reason: str = typer.Option("run now (CLI)", help="Why, for the log."),
    max_attempts: int = typer.Option(3, min=1, max=20),
    config: Path | None = ConfigOption,
    as_json: bool = JsonOption,
) -> None:
    """Queue a job now (a distill worker picks it up)."""
    _, sessions = _sessions(config)

    def go() -> dict[str, Any]:
        with sessions.begin() as s:
            job = jobs.enqueue(
                session=s, params=_params(param), reason=reason, max_attempts=max_attempts
            )
            return _job_dict(job)

    out = _guard(go)
    if as_json:
        print_json(out)
    else:
        _console.print(f"queued job {out['id']}")


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
    if as_json:
        print_json(rows)
        return
    table = Table(title="distill jobs")
    for col in ("id", "state", "phase", "%", "attempts", "version", "reason"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            str(r["id"]), r["state"], r["phase"] or "", f"{r['percent']:.0f}",
            f"{r['attempts']}/{r['max_attempts']}", r["result_version"] or "", r["reason"] or "",
        )  # fmt: skip
    _console.print(table)


@jobs_app.command("show")
def show_job(job_id: int, config: Path | None = ConfigOption, as_json: bool = JsonOption) -> None:
    """One job with its parameters and metrics."""
    _, sessions = _sessions(config)
    with sessions() as s:
        out = _guard(lambda: _job_dict(jobs.get_job(session=s, job_id=job_id), metrics=True))
    if as_json:
        print_json(out)
        return
    for key, value in out.items():
        if key != "metrics":
            _console.print(f"[bold]{key}[/]: {value}")
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
    param: list[str] = typer.Option([], "--param", "-p", help="KEY=VALUE job parameter."),
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
                params=_params(param),
                enabled=not disable,
            )
            return {
                "id": sch.id,
                "name": sch.name,
                "kind": sch.kind,
                "expression": sch.expression,
                "trigger": sch.trigger,
                "enabled": sch.enabled,
                "next_run_at": sch.next_run_at.isoformat() if sch.next_run_at else None,
            }

    out = _guard(go)
    if as_json:
        print_json(out)
    else:
        _console.print(f"schedule {out['id']} {out['name']}: {out['kind']} {out['expression']}")


@jobs_app.command("schedules")
def list_schedules(
    enable: int | None = typer.Option(None, help="Enable this schedule id."),
    disable: int | None = typer.Option(None, help="Disable this schedule id."),
    run_now: int | None = typer.Option(None, "--run-now", help="Queue this schedule's job now."),
    config: Path | None = ConfigOption,
    as_json: bool = JsonOption,
) -> None:
    """List schedules; --enable/--disable/--run-now ID act on one first."""
    _, sessions = _sessions(config)

    def act() -> None:
        with sessions.begin() as s:
            if enable is not None:
                schedules.set_enabled(session=s, schedule_id=enable, enabled=True)
            if disable is not None:
                schedules.set_enabled(session=s, schedule_id=disable, enabled=False)
            if run_now is not None:
                job = schedules.run_now(session=s, schedule_id=run_now)
                _console.print(f"queued job {job.id}")

    _guard(act)
    with sessions() as s:
        rows = [
            {
                "id": x.id,
                "name": x.name,
                "kind": x.kind,
                "expression": x.expression,
                "trigger": x.trigger,
                "enabled": x.enabled,
                "last_run_at": x.last_run_at.isoformat() if x.last_run_at else None,
                "next_run_at": x.next_run_at.isoformat() if x.next_run_at else None,
            }
            for x in schedules.list_schedules(session=s)
        ]
    if as_json:
        print_json(rows)
        return
    for r in rows:
        _console.print(r)


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
    from contextlib import nullcontext

    from cloud_service.announce import MqttAnnouncer
    from cloud_service.api.state import load_signing_key
    from cloud_service.blobs import open_blob_store
    from distill.cache import reference_model_path
    from distill.health import HealthServer
    from distill.pipeline import PipelineServices, make_runner
    from distill.worker import DistillWorker

    settings, sessions = _sessions(config)

    def ref(alias: str) -> Path | None:
        try:
            return reference_model_path(alias)
        except EdgeLoopError:
            return None

    work_dir = settings.data_dir / "distill"
    work_dir.mkdir(parents=True, exist_ok=True)
    services = PipelineServices(
        sessions=sessions,
        blobs=open_blob_store(settings),
        work_dir=work_dir,
        signing_key=load_signing_key(settings),
        announcer=MqttAnnouncer(settings.mqtt, client_id=f"{settings.announcer_client_id}-distill"),
        topics=settings.topics,
        base_checkpoint=ref("student.pt"),
        serving_model=ref("student-int8"),
        teacher_model=ref("teacher"),
    )
    w = DistillWorker(sessions, runner=make_runner(services), lease_s=lease_s, poll_s=poll_s)

    def on_signal(signum: int, frame: Any) -> None:
        _console.print(f"signal {signum}: stopping after handing back the current job")
        w.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _console.print(f"distill worker {w.owner} on {settings.resolved_database_url}")
    probes = (
        HealthServer(w.health, health_host, health_port)
        if health_port is not None
        else nullcontext()
    )
    with probes:
        ran = w.run(max_jobs=max_jobs)
    _console.print(f"ran {ran} job(s): {w.finished}")
