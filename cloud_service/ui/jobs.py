"""The review UI's distillation pages: jobs (run now, watch, cancel) and schedules
(create, enable, disable, delete), admin only, under /ui.

Thin routes over ``cloud_service.jobs.queue`` and ``cloud_service.jobs.schedules``. A
job's page shows its metrics as tables (``metric_tables``) and its log as the worker
wrote it: one reason line per failure, never a traceback (that goes to the worker's own
log).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from sqlalchemy.orm import Session

from cloud_service.jobs import queue as jobs
from cloud_service.jobs import schedules
from cloud_service.jobs.tables import DistillJob, JobLog
from cloud_service.ui.deps import AdminUserDep, CsrfDep, UiUser
from cloud_service.web.deps import SessionDep
from shared.errors import ContractError, EdgeLoopError

__all__ = ["job_view", "metric_tables", "router"]

router = APIRouter(prefix="/ui", include_in_schema=False)
templates = Jinja2Templates(directory=str(Path(__file__).resolve().parent / "templates"))

_FORM_TEXT = Annotated[str, Form(max_length=8)]
_OTHER_PARAMS = Annotated[str, Form(max_length=4000)]


def _page(request: Request, name: str, user: UiUser, **context: Any) -> HTMLResponse:
    context.update(
        user=user, nav=name.removesuffix(".html"), notice=request.query_params.get("notice")
    )
    return templates.TemplateResponse(request, name, context)


def _back(notice: str, to: str = "/ui/jobs") -> RedirectResponse:
    return RedirectResponse(f"{to}?notice={quote(notice)}", status_code=303)


def form_params(
    *, session: Session, fleet: str, epochs: str, min_samples: str, quick: str, other: str
) -> dict[str, Any]:
    """A job's parameters from the form: the fleet, the common fields, and ``KEY=VALUE``
    lines (values read as JSON when they parse, else as text); checked as the API does."""
    params: dict[str, Any] = {}
    for line in other.splitlines():
        if not line.strip():
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ContractError(f"bad parameter line {line.strip()!r}: expected KEY=VALUE")
        try:
            params[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            params[key.strip()] = value.strip()
    for key, text in (("epochs", epochs), ("min_samples", min_samples)):
        if text.strip():
            params[key] = int(text) if text.strip().isdigit() else text.strip()
    if quick:
        params["quick"] = True
    params["fleet"] = jobs.resolve_fleet(session=session, fleet=fleet.strip() or None)
    return jobs.validate_params(params)


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "—" if value is None else ("yes" if value else "no")
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value) if len(value) <= 12 else f"{len(value)} values"
    return str(value)


def _rows(data: dict[str, Any], prefix: str = "") -> list[list[str]]:
    rows: list[list[str]] = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows += _rows(value, f"{name}.")
        else:
            rows.append([name, _fmt(value)])
    return rows


# How the page names a task's gate metric (shared.tasks); others show as written.
_METRIC_NAMES = {"top1_accuracy": "top-1", "map50": "mAP@0.5"}
# Further evaluations a task's job reports beside the gate's metric, each a models by
# data sets table of its own.
_MORE_EVALUATIONS = {"evaluation_map50_95": "mAP@0.5:0.95"}


def _evaluation_table(evaluation: Any, metric_name: str) -> dict[str, Any] | None:
    if not isinstance(evaluation, dict) or not evaluation:
        return None
    data_sets = list(next(iter(evaluation.values())))
    return {
        "title": f"Evaluation ({metric_name}, %)",
        "columns": ["model", *data_sets],
        "rows": [
            [model, *(f"{100 * float(by.get(d, 0.0)):.1f}" for d in data_sets)]
            for model, by in evaluation.items()
        ],
    }


def metric_tables(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """A job's metrics as tables the page draws: the evaluation as models by data sets
    (in the gate's metric, %, then any further metric the task reports), the gate,
    then each other section as name/value rows."""
    tables: list[dict[str, Any]] = []
    gate = metrics.get("gate")
    metric = str(gate.get("metric") or "") if isinstance(gate, dict) else ""
    evaluations = [(metrics.get("evaluation"), _METRIC_NAMES.get(metric, metric or "top-1"))]
    evaluations += [(metrics.get(key), name) for key, name in _MORE_EVALUATIONS.items()]
    for evaluation, name in evaluations:
        table = _evaluation_table(evaluation, name)
        if table is not None:
            tables.append(table)
    scalars: dict[str, Any] = {}
    for key, value in metrics.items():
        if key in ("evaluation", "history", "params", *_MORE_EVALUATIONS):
            continue
        if isinstance(value, dict):
            rows = _rows(value)
            if rows:
                title = key.replace("_", " ").capitalize()
                tables.append({"title": title, "columns": ["name", "value"], "rows": rows})
        else:
            scalars[key] = value
    history = metrics.get("history")
    if isinstance(history, list) and history:
        scalars["epochs run"] = len(history)
    if scalars:
        tables.insert(0, {"title": "Summary", "columns": ["name", "value"], "rows": _rows(scalars)})
    return tables


def job_view(job: DistillJob, logs: list[JobLog], *, waiting: str | None = None) -> dict[str, Any]:
    """A job and its new log lines as the job page's script draws them."""
    return {
        "id": job.id,
        "state": job.state,
        "fleet": (job.params or {}).get("fleet"),
        "phase": job.phase,
        "percent": round(float(job.percent or 0.0), 1),
        "eta_s": job.eta_s,
        "cancel_requested": job.cancel_requested,
        "metrics": job.metrics or {},
        "metric_tables": metric_tables(job.metrics or {}),
        "error": job.error,
        "waiting": waiting if job.state == "queued" else None,
        "result_version": job.result_version,
        "logs": [
            {"id": line.id, "at": line.at.strftime("%H:%M:%S"), "level": line.level,
             "message": line.message}
            for line in logs
        ],
    }  # fmt: skip


def _view(session: Session, job_id: int, after: int = 0) -> dict[str, Any]:
    job = jobs.get_job(session=session, job_id=job_id)
    logs = jobs.read_logs(session=session, job_id=job_id, after_id=after, limit=500)
    return job_view(job, logs, waiting=jobs.queue_status(session=session).warning)


@router.get("/jobs")
def jobs_page(request: Request, session: SessionDep, user: AdminUserDep) -> HTMLResponse:
    return _page(
        request,
        "jobs.html",
        user,
        jobs=jobs.list_jobs(session=session),
        schedules=schedules.list_schedules(session=session),
        fleets=jobs.known_fleets(session=session),
        params=jobs.job_parameter_docs(),
        queue=jobs.queue_status(session=session),
    )


@router.post("/jobs")
def run_job(
    session: SessionDep,
    user: AdminUserDep,
    _csrf: CsrfDep,
    fleet: Annotated[str, Form(max_length=64)] = "",
    epochs: _FORM_TEXT = "",
    min_samples: _FORM_TEXT = "",
    quick: _FORM_TEXT = "",
    other: _OTHER_PARAMS = "",
) -> Response:
    try:
        params = form_params(
            session=session,
            fleet=fleet,
            epochs=epochs,
            min_samples=min_samples,
            quick=quick,
            other=other,
        )
        job = jobs.enqueue(session=session, params=params, reason=f"run now by {user.username}")
    except EdgeLoopError as exc:
        return _back(exc.message)
    return RedirectResponse(f"/ui/jobs/{job.id}", status_code=303)


@router.post("/schedules")
def add_schedule(
    session: SessionDep,
    _admin: AdminUserDep,
    _csrf: CsrfDep,
    name: Annotated[str, Form(max_length=64)],
    kind: Annotated[str, Form(max_length=16)],
    expression: Annotated[str, Form(max_length=256)],
    fleet: Annotated[str, Form(max_length=64)] = "",
    epochs: _FORM_TEXT = "",
    min_samples: _FORM_TEXT = "",
    quick: _FORM_TEXT = "",
    other: _OTHER_PARAMS = "",
) -> Response:
    try:
        params = form_params(
            session=session,
            fleet=fleet,
            epochs=epochs,
            min_samples=min_samples,
            quick=quick,
            other=other,
        )
        schedules.create_schedule(
            session=session, name=name, kind=kind, expression=expression, params=params
        )
    except EdgeLoopError as exc:
        return _back(exc.message)
    return _back(f"schedule {name} created for fleet {params['fleet']}")


@router.post("/schedules/{schedule_id}/{action}")
def change_schedule(
    schedule_id: int, action: str, session: SessionDep, _admin: AdminUserDep, _csrf: CsrfDep
) -> Response:
    """Enable, disable or delete a schedule (the buttons in its row)."""
    try:
        schedule = schedules.get_schedule(session=session, schedule_id=schedule_id)
        name = schedule.name
        if action in ("enable", "disable"):
            schedules.set_enabled(
                session=session, schedule_id=schedule_id, enabled=action == "enable"
            )
        elif action == "delete":
            schedules.delete_schedule(session=session, schedule_id=schedule_id)
        else:
            raise ContractError(f"unknown schedule action {action!r}: enable, disable, delete")
    except EdgeLoopError as exc:
        return _back(exc.message)
    return _back(f"schedule {name} {action}d")


@router.get("/jobs/{job_id}")
def job_page(
    request: Request, job_id: int, session: SessionDep, user: AdminUserDep
) -> HTMLResponse:
    return _page(request, "job.html", user, job=_view(session, job_id))


@router.get("/api/jobs/{job_id}")
def job_json(
    job_id: int, session: SessionDep, _admin: AdminUserDep, after: int = 0
) -> dict[str, Any]:
    """The job's state and the log lines after ``after`` (the page polls this)."""
    return _view(session, job_id, after)


@router.post("/api/jobs/{job_id}/cancel")
def cancel_job(
    job_id: int, session: SessionDep, _admin: AdminUserDep, _csrf: CsrfDep
) -> dict[str, Any]:
    job = jobs.cancel(session=session, job_id=job_id)
    return job_view(job, [])
