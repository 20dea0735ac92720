"""Pages and fetch endpoints of the review UI, under /ui.

Thin routes: each checks its input, calls one function of ``cloud_service.ui.store``
(or crud, registry, rollout), and renders a template or returns JSON.
"""

from __future__ import annotations

import csv
import hmac
import io
import json
import secrets
import zipfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, urlsplit

from fastapi import APIRouter, Body, FastAPI, Form, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from pydantic import BaseModel, Field
from sqlalchemy import select

from cloud_service import registry, rollout
from cloud_service.api.deps import BlobsDep, SessionDep, StateDep
from cloud_service.db import crud
from cloud_service.db.models import Agent, Sample
from cloud_service.errors import ConflictError, NotFoundError
from cloud_service.ui import charts, store
from cloud_service.ui import jobs as ui_jobs
from cloud_service.ui.auth import LOGIN_CSRF_COOKIE, SESSION_COOKIE
from cloud_service.ui.deps import (
    AdminUserDep,
    CsrfDep,
    LoginRequired,
    NotAllowed,
    SignerDep,
    UiUser,
    UserDep,
)
from shared.errors import EdgeLoopError

__all__ = ["mount_ui", "router"]

HERE = Path(__file__).resolve().parent
templates = Jinja2Templates(directory=str(HERE / "templates"))
router = APIRouter(prefix="/ui", include_in_schema=False)
OFFLINE_AFTER_S = 120.0  # a heartbeat older than this shows as stale


def _page(
    request: Request, name: str, user: UiUser | None, status_code: int = 200, **context: Any
) -> HTMLResponse:
    context.update(
        user=user, nav=name.removesuffix(".html"), notice=request.query_params.get("notice")
    )
    return templates.TemplateResponse(request, name, context, status_code=status_code)


def _safe_next(target: str | None) -> str:
    """Only a path on this site (no scheme, no host) may follow a login."""
    if not target or not target.startswith("/") or target.startswith("//"):
        return "/ui/queue"
    parts = urlsplit(target)
    return target if not parts.scheme and not parts.netloc else "/ui/queue"


# --- login -------------------------------------------------------------------


@router.get("/login")
def login_page(request: Request, next: str | None = None, error: str | None = None) -> HTMLResponse:
    token = secrets.token_urlsafe(24)
    response = _page(
        request, "login.html", None, next=_safe_next(next), error=error, login_csrf=token
    )
    response.set_cookie(
        LOGIN_CSRF_COOKIE, token, httponly=True, samesite="strict", path="/ui/login", max_age=3600
    )
    return response


@router.post("/login")
def login(
    request: Request,
    state: StateDep,
    signer: SignerDep,
    username: Annotated[str, Form(max_length=64)],
    password: Annotated[str, Form(max_length=256)],
    csrf_token: Annotated[str, Form(max_length=128)] = "",
    next: Annotated[str, Form(max_length=2048)] = "/ui/queue",
) -> Response:
    cookie = request.cookies.get(LOGIN_CSRF_COOKIE, "")
    if not cookie or not hmac.compare_digest(cookie, csrf_token):
        return _page(
            request,
            "login.html",
            None,
            status_code=403,
            next=_safe_next(next),
            error="The login form expired; try again.",
            login_csrf=cookie or "",
        )
    with state.sessions.begin() as session:
        user = crud.authenticate_user(session=session, username=username, password=password)
        ident = (user.id, user.session_generation) if user else None
    if ident is None:
        token = secrets.token_urlsafe(24)
        response = _page(
            request,
            "login.html",
            None,
            status_code=401,
            next=_safe_next(next),
            error="Unknown user or wrong password.",
            login_csrf=token,
        )
        response.set_cookie(
            LOGIN_CSRF_COOKIE,
            token,
            httponly=True,
            samesite="strict",
            path="/ui/login",
            max_age=3600,
        )
        return response
    redirect = RedirectResponse(_safe_next(next), status_code=303)
    redirect.set_cookie(
        SESSION_COOKIE,
        signer.sign(user_id=ident[0], generation=ident[1]),
        max_age=int(signer.ttl_s),
        httponly=True,
        samesite="lax",
        secure=request.url.scheme == "https",
        path="/",
    )
    redirect.delete_cookie(LOGIN_CSRF_COOKIE, path="/ui/login")
    return redirect


@router.post("/logout")
def logout(_user: CsrfDep) -> Response:
    redirect = RedirectResponse("/ui/login", status_code=303)
    redirect.delete_cookie(SESSION_COOKIE, path="/")
    return redirect


@router.get("")
@router.get("/")
def home(_user: UserDep) -> Response:
    return RedirectResponse("/ui/queue", status_code=303)


# --- queue -------------------------------------------------------------------


def _filter(request: Request) -> store.QueueFilter:
    return store.QueueFilter.from_query(request.query_params)


@router.get("/queue")
def queue(request: Request, session: SessionDep, user: UserDep) -> HTMLResponse:
    flt = _filter(request)
    page = store.queue_page(session=session, flt=flt)
    rows = []
    for sample, verdict in page.rows:
        n = len(sample.edge_scores)
        names = store.class_names(
            session=session, model_name=sample.model_name, model_version=sample.model_version, n=n
        )
        rows.append({"s": sample, "v": verdict, "names": names})
    agents = list(session.scalars(select(Agent.agent_id).order_by(Agent.agent_id).limit(500)))
    return _page(
        request,
        "queue.html",
        user,
        flt=flt,
        rows=rows,
        total=page.total,
        pages=page.pages,
        agents=agents,
        statuses=store.STATUSES,
        reasons=store.ROUTE_REASONS,
        sorts=list(store.SORTS),
        page_sizes=store.PAGE_SIZES,
    )


@router.post("/queue/bulk")
def bulk(
    request: Request,
    session: SessionDep,
    user: CsrfDep,
    action: Annotated[str, Form()],
    ids: Annotated[list[str], Form()],
    label: Annotated[str, Form()] = "",
    back: Annotated[str, Form(max_length=4096)] = "",
) -> Response:
    chosen = int(label) if label.strip().isdigit() else None
    result = store.bulk_review(
        session=session, sample_ids=ids[:1000], action=action, label=chosen, reviewer=user.username
    )
    notice = f"{action}: {len(result['done'])} done"
    if result["skipped"]:
        notice += f", {len(result['skipped'])} skipped (changed meanwhile by someone else)"
    query = back.lstrip("?")
    sep = "&" if query else ""
    return RedirectResponse(f"/ui/queue?{query}{sep}notice={quote(notice)}", status_code=303)


# --- review ------------------------------------------------------------------


def _view(session: Any, sample: Sample) -> dict[str, Any]:
    _, verdict, _ = crud.get_sample(session=session, sample_id=sample.sample_id)
    return store.sample_view(session=session, sample=sample, verdict=verdict)


@router.get("/review/{sample_id}")
def review_page(
    request: Request, sample_id: str, session: SessionDep, user: UserDep
) -> HTMLResponse:
    flt = _filter(request)
    sample, verdict, _ = crud.get_sample(session=session, sample_id=sample_id)
    view = store.sample_view(session=session, sample=sample, verdict=verdict)
    return _page(request, "review.html", user, flt=flt, sample=view, query=flt.query_string())


@router.get("/review")
def review_first(request: Request, session: SessionDep, user: UserDep) -> Response:
    """The first sample of the filter (the queue's "start reviewing")."""
    flt = _filter(request).without_page()
    page = store.queue_page(session=session, flt=flt)
    if not page.rows:
        return RedirectResponse(f"/ui/queue?{flt.query_string()}&notice=nothing+to+review", 303)
    first = page.rows[0][0].sample_id
    return RedirectResponse(f"/ui/review/{first}?{flt.query_string()}", status_code=303)


@router.get("/samples/{sample_id}/image")
def sample_image(sample_id: str, session: SessionDep, blobs: BlobsDep, _user: UserDep) -> Response:
    sample, _, _ = crud.get_sample(session=session, sample_id=sample_id)
    return Response(
        blobs.get(sample.image_key),
        media_type=f"image/{sample.image_format}",
        headers={"Cache-Control": "private, max-age=86400"},
    )


@router.get("/api/samples/{sample_id}")
def sample_json(sample_id: str, session: SessionDep, _user: UserDep) -> dict[str, Any]:
    sample, verdict, _ = crud.get_sample(session=session, sample_id=sample_id)
    return store.sample_view(session=session, sample=sample, verdict=verdict)


@router.get("/api/samples/{sample_id}/neighbour")
def sample_neighbour(
    request: Request,
    sample_id: str,
    session: SessionDep,
    _user: UserDep,
    direction: Annotated[str, Query(pattern="^(next|prev)$")] = "next",
) -> dict[str, Any]:
    flt = _filter(request)
    sample, _, _ = crud.get_sample(session=session, sample_id=sample_id)
    found = store.neighbour(session=session, flt=flt, sample=sample, forward=direction == "next")
    after = None
    if found is not None:
        after = store.sample_view(session=session, sample=found[0], verdict=found[1])
    return {"sample": after}


class ReviewIn(BaseModel):
    action: str = Field(pattern="^(label|discard)$")
    label: int | None = Field(default=None, ge=0, le=999)
    token: str = Field(max_length=64)
    query: str = Field(default="", max_length=4096)


@router.post("/api/samples/{sample_id}/review")
def review(
    sample_id: str, body: Annotated[ReviewIn, Body()], session: SessionDep, user: CsrfDep
) -> dict[str, Any]:
    """Review one sample and answer with the next one of the filter (one round trip)."""
    result = store.review_sample(
        session=session,
        sample_id=sample_id,
        action=body.action,
        label=body.label,
        token=body.token,
        reviewer=user.username,
    )
    flt = store.QueueFilter.from_query(_parse_qs(body.query))
    sample, _, _ = crud.get_sample(session=session, sample_id=sample_id)
    found = store.neighbour(session=session, flt=flt, sample=sample, forward=True)
    after = store.sample_view(session=session, sample=found[0], verdict=found[1]) if found else None
    return {"done": result.action, "token": result.token, "undo": result.undo, "next": after}


def _parse_qs(query: str) -> dict[str, str]:
    from urllib.parse import parse_qsl

    return dict(parse_qsl(query.lstrip("?"), keep_blank_values=True))


class UndoIn(BaseModel):
    sample_id: str = Field(pattern=r"^[0-9a-f-]{36}$")
    previous: str = Field(max_length=16)
    label_id: int | None = None
    token: str = Field(max_length=64)


@router.post("/api/undo")
def undo(body: Annotated[UndoIn, Body()], session: SessionDep, user: CsrfDep) -> dict[str, Any]:
    store.undo_review(
        session=session,
        sample_id=body.sample_id,
        previous=body.previous,
        label_id=body.label_id,
        token=body.token,
        user=user.username,
    )
    sample, verdict, _ = crud.get_sample(session=session, sample_id=body.sample_id)
    return {"sample": store.sample_view(session=session, sample=sample, verdict=verdict)}


# --- export ------------------------------------------------------------------

EXPORT_COLUMNS = [
    "sample_id", "label", "class_name", "source", "labeled_by", "agent_id", "fleet",
    "captured_at", "model_version", "edge_label", "edge_confidence", "teacher_label",
    "teacher_confidence", "route_reason",
]  # fmt: skip


@router.get("/export")
def export(
    request: Request,
    session: SessionDep,
    blobs: BlobsDep,
    _user: UserDep,
    format: Annotated[str, Query(pattern="^(zip|csv|json)$")] = "csv",
) -> Response:
    """Labelled samples under the queue's filter: CSV, JSON, or a zip of class folders."""
    rows = store.export_rows(session=session, flt=_filter(request))
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    if format == "json":
        body = json.dumps([{k: r[k] for k in EXPORT_COLUMNS} for r in rows], indent=1)
        return _download(body.encode(), "application/json", f"edgeloop-labels-{stamp}.json")
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=EXPORT_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    if format == "csv":
        return _download(text.getvalue().encode(), "text/csv", f"edgeloop-labels-{stamp}.csv")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        # Images are JPEG/PNG already: storing them beats deflating them again.
        for row in rows:
            folder = _folder(row["class_name"])
            try:
                data = blobs.get(row["image_key"])
            except EdgeLoopError:
                continue  # a blob removed by retention: the CSV still lists the sample
            ext = "jpg" if row["image_format"] == "jpeg" else row["image_format"]
            archive.writestr(f"{folder}/{row['sample_id']}.{ext}", data)
        archive.writestr("labels.csv", text.getvalue())
    return _download(buffer.getvalue(), "application/zip", f"edgeloop-labels-{stamp}.zip")


def _folder(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip(".")
    return cleaned or "_"


def _download(data: bytes, media_type: str, filename: str) -> Response:
    return Response(
        data,
        media_type=media_type,
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )


# --- agents, dashboard, models --------------------------------------------------


@router.get("/agents")
def agents_page(request: Request, session: SessionDep, user: UserDep) -> HTMLResponse:
    agents, _ = crud.list_agents(session=session, limit=1000)
    now = datetime.now(UTC)
    rows = []
    for agent in agents:
        age = (now - agent.last_seen_at).total_seconds() if agent.last_seen_at else None
        online = agent.state == "online" and age is not None and age < OFFLINE_AFTER_S
        rows.append({"a": agent, "t": agent.telemetry or {}, "online": online, "age": age})
    return _page(request, "agents.html", user, rows=rows)


@router.get("/dashboard")
def dashboard(
    request: Request,
    session: SessionDep,
    state: StateDep,
    user: UserDep,
    hours: Annotated[int, Query(ge=1, le=24 * 90)] = 48,
) -> HTMLResponse:
    data = store.dashboard_series(session=session, hours=hours)
    series = data["series"]
    figures = [
        charts.line_chart(series["forwarded"], title="Samples forwarded per bucket"),
        charts.line_chart(series["agreement"], title="Edge-teacher agreement", y_max=1.0),
        charts.line_chart(series["accuracy"], title="Edge accuracy (audit samples)", y_max=1.0),
        charts.line_chart(series["latency_ms"], title="Verifier latency (mean)", unit=" ms"),
    ]
    queue_depth = None
    worker = state.worker
    if worker is not None:
        queue_depth = worker.batcher.depth
    return _page(
        request,
        "dashboard.html",
        user,
        figures=figures,
        stats=crud.stats(session=session),
        flagged=data["flagged"],
        pending=data["pending"],
        queue_depth=queue_depth,
        hours=hours,
    )


@router.get("/models")
def models_page(request: Request, session: SessionDep, user: UserDep) -> HTMLResponse:
    versions = registry.list_versions(session=session)
    rollouts = []
    for item in rollout.list_rollouts(session=session, limit=50):
        _, events = rollout.get_rollout(session=session, rollout_id=item.id)
        rollouts.append({"r": item, "events": events})
    return _page(request, "models.html", user, versions=versions, rollouts=rollouts)


@router.post("/rollouts/{rollout_id}/{action}")
def rollout_action(
    rollout_id: int,
    action: str,
    session: SessionDep,
    state: StateDep,
    user: AdminUserDep,
    _csrf: CsrfDep,
) -> Response:
    if action not in ("promote", "abort"):
        raise NotFoundError(f"no rollout action {action!r}")
    fn = rollout.promote_rollout if action == "promote" else rollout.abort_rollout
    try:
        fn(
            session=session,
            announcer=state.get_announcer(),
            topics=state.settings.topics,
            rollout_id=rollout_id,
            reason=f"{action}d by {user.username} in the review UI",
        )
        notice = f"rollout {rollout_id}: {action}d"
    except ConflictError as exc:
        notice = exc.message
    return RedirectResponse(f"/ui/models?notice={quote(notice)}", status_code=303)


# --- distillation jobs and schedules (admin) ------------------------------------------


def _job_params(epochs: str, min_samples: str, quick: str) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if epochs.strip():
        params["epochs"] = int(epochs) if epochs.strip().isdigit() else epochs
    if min_samples.strip():
        params["min_samples"] = int(min_samples) if min_samples.strip().isdigit() else min_samples
    if quick:
        params["quick"] = True
    return params


@router.get("/jobs")
def jobs_page(request: Request, session: SessionDep, user: AdminUserDep) -> HTMLResponse:
    return _page(
        request,
        "jobs.html",
        user,
        jobs=ui_jobs.list_jobs(session=session),
        schedules=ui_jobs.list_schedules(session=session),
    )


@router.post("/jobs")
def run_job(
    session: SessionDep,
    user: AdminUserDep,
    _csrf: CsrfDep,
    epochs: Annotated[str, Form(max_length=8)] = "",
    min_samples: Annotated[str, Form(max_length=8)] = "",
    quick: Annotated[str, Form(max_length=8)] = "",
) -> Response:
    try:
        job = ui_jobs.run_now(
            session=session,
            params=_job_params(epochs, min_samples, quick),
            reason=f"run now by {user.username}",
        )
    except EdgeLoopError as exc:
        return RedirectResponse(f"/ui/jobs?notice={quote(exc.message)}", status_code=303)
    return RedirectResponse(f"/ui/jobs/{job.id}", status_code=303)


@router.post("/schedules")
def add_schedule(
    session: SessionDep,
    _admin: AdminUserDep,
    _csrf: CsrfDep,
    name: Annotated[str, Form(max_length=64)],
    kind: Annotated[str, Form(max_length=16)],
    expression: Annotated[str, Form(max_length=256)],
    epochs: Annotated[str, Form(max_length=8)] = "",
    min_samples: Annotated[str, Form(max_length=8)] = "",
    quick: Annotated[str, Form(max_length=8)] = "",
) -> Response:
    try:
        ui_jobs.create_schedule(
            session=session,
            name=name,
            kind=kind,
            expression=expression,
            params=_job_params(epochs, min_samples, quick),
        )
        notice = f"schedule {name} created"
    except EdgeLoopError as exc:
        notice = exc.message
    return RedirectResponse(f"/ui/jobs?notice={quote(notice)}", status_code=303)


@router.get("/jobs/{job_id}")
def job_page(
    request: Request, job_id: int, session: SessionDep, user: AdminUserDep
) -> HTMLResponse:
    job = ui_jobs.get_job(session=session, job_id=job_id)
    view = ui_jobs.job_view(job, ui_jobs.read_logs(session=session, job_id=job_id))
    return _page(request, "job.html", user, job=view)


@router.get("/api/jobs/{job_id}")
def job_json(
    job_id: int, session: SessionDep, _admin: AdminUserDep, after: int = 0
) -> dict[str, Any]:
    """The job's state and the log lines after ``after`` (the page polls this)."""
    job = ui_jobs.get_job(session=session, job_id=job_id)
    return ui_jobs.job_view(job, ui_jobs.read_logs(session=session, job_id=job_id, after_id=after))


@router.post("/api/jobs/{job_id}/cancel")
def cancel_job(
    job_id: int, session: SessionDep, _admin: AdminUserDep, _csrf: CsrfDep
) -> dict[str, Any]:
    job = ui_jobs.cancel_job(session=session, job_id=job_id)
    return ui_jobs.job_view(job, [])


# --- users (admin) ---------------------------------------------------------------


@router.get("/users")
def users_page(request: Request, session: SessionDep, user: AdminUserDep) -> HTMLResponse:
    return _page(request, "users.html", user, users=crud.list_users(session=session))


@router.post("/users")
def add_user(
    session: SessionDep,
    _admin: AdminUserDep,
    _csrf: CsrfDep,
    username: Annotated[str, Form(max_length=64)],
    password: Annotated[str, Form(max_length=256)],
    role: Annotated[str, Form(max_length=16)] = "reviewer",
) -> Response:
    try:
        crud.create_user(session=session, username=username, password=password, role=role)
        notice = f"user {username} added"
    except EdgeLoopError as exc:
        notice = exc.message
    return RedirectResponse(f"/ui/users?notice={quote(notice)}", status_code=303)


# --- mounting --------------------------------------------------------------------


def _wants_json(request: Request) -> bool:
    return request.url.path.startswith("/ui/api/") or "application/json" in request.headers.get(
        "accept", ""
    )


async def _login_required(request: Request, exc: Exception) -> Response:
    if _wants_json(request):
        return JSONResponse(
            {"detail": "your session expired or you are not signed in", "reason": "login"},
            status_code=401,
        )
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    if request.method != "GET":
        target = "/ui/queue"
    return RedirectResponse(f"/ui/login?next={quote(target)}", status_code=303)


async def _not_allowed(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, NotAllowed)
    if _wants_json(request):
        return JSONResponse({"detail": exc.message, "reason": "forbidden"}, status_code=403)
    user = getattr(request.state, "ui_user", None)
    return _page(
        request, "error.html", user, status_code=403, title="Not allowed", message=exc.message
    )


def mount_ui(app: FastAPI) -> None:
    """Add the review UI's routes, static files and error pages to ``app``."""
    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=str(HERE / "static")), name="ui-static")
    app.add_exception_handler(LoginRequired, _login_required)
    app.add_exception_handler(NotAllowed, _not_allowed)
