"""Pages and fetch endpoints of the review UI, under /ui.

Thin routes: each checks its input, calls one function of ``cloud_service.ui.store``
(or crud, registry, rollout), and renders a template or returns JSON.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import inspect
import json
import secrets
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, urlsplit

from fastapi import APIRouter, Body, FastAPI, Form, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from pydantic import BaseModel, Field
from sqlalchemy import select
from starlette.exceptions import HTTPException as StarletteHTTPException

from cloud_service import exports, registry, rollout
from cloud_service.api.deps import BlobsDep, SessionDep, StateDep
from cloud_service.api.state import ApiState
from cloud_service.db import crud
from cloud_service.db.models import Agent
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
from shared.errors import ContractError, EdgeLoopError

__all__ = ["mount_ui", "router"]

HERE = Path(__file__).resolve().parent
templates = Jinja2Templates(directory=str(HERE / "templates"))
router = APIRouter(prefix="/ui", include_in_schema=False)
OFFLINE_AFTER_S = 120.0  # a heartbeat older than this shows as stale
UNDO_TTL_S = 3600.0  # a bulk discard can be undone for this long
TELEMETRY_KEYS = (
    "provider", "frames_per_s", "latency_p50_ms", "latency_p99_ms", "forward_rate",
    "spool_depth", "dropped_frames", "agreement_rate",
)  # fmt: skip


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
def logout(user: CsrfDep, state: StateDep) -> Response:
    """End the session server-side: bumping the user's session generation makes every cookie
    signed before now (this one, one copied from it, the user's other browsers) invalid."""
    with state.sessions.begin() as session:
        record = crud.get_user(session=session, user_id=user.id)
        if record is not None:
            record.session_generation += 1
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
def queue(request: Request, session: SessionDep, state: StateDep, user: UserDep) -> HTMLResponse:
    flt = _filter(request)
    classes = store.class_names_for(session=session, state=state)
    page = store.queue_page(session=session, flt=flt, classes=classes)
    rows = [{"s": s, "v": v, "names": classes.for_sample(s)} for s, v in page.rows]
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
        class_names=classes.known(),
        statuses=store.STATUSES,
        reasons=store.ROUTE_REASONS,
        sorts=list(store.SORTS),
        page_sizes=store.PAGE_SIZES,
        formats=EXPORT_FORMATS,
        undo=request.query_params.get("undo", "")[:8192],
    )


def _undo_key(state: ApiState) -> bytes:
    secret = state.settings.session_secret.get_secret_value().encode()
    return hashlib.sha256(b"edgeloop-ui-bulk-undo\0" + secret).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _undo_token(state: ApiState, user: UiUser, done: list[tuple[str, str]]) -> str:
    """A signed note of what a bulk discard changed: the user, when, each sample's status."""
    body = struct.pack(">IQ", user.id, int(time.time()))
    for sample_id, previous in done:
        body += uuid.UUID(sample_id).bytes + bytes([store.SAMPLE_STATUSES.index(previous)])
    mac = hmac.new(_undo_key(state), body, hashlib.sha256).digest()[:16]
    return f"{_b64(body)}.{_b64(mac)}"


def _read_undo_token(state: ApiState, user: UiUser, token: str) -> list[tuple[str, str]]:
    problem = ContractError("this undo is not valid any more; reload the queue", reason="invalid")
    body_text, _, mac_text = token.partition(".")
    try:
        body = base64.urlsafe_b64decode(body_text + "=" * (-len(body_text) % 4))
        mac = base64.urlsafe_b64decode(mac_text + "=" * (-len(mac_text) % 4))
    except ValueError as exc:
        raise problem from exc
    expected = hmac.new(_undo_key(state), body, hashlib.sha256).digest()[:16]
    if len(body) < 12 or (len(body) - 12) % 17 or not hmac.compare_digest(mac, expected):
        raise problem
    user_id, issued = struct.unpack(">IQ", body[:12])
    if user_id != user.id:
        raise ContractError("only the reviewer who discarded these samples can undo it")
    if time.time() - issued > UNDO_TTL_S:
        raise ContractError(f"an undo lasts {UNDO_TTL_S / 60:.0f} minutes; this one expired")
    items = []
    for at in range(12, len(body), 17):
        sample_id = str(uuid.UUID(bytes=body[at : at + 16]))
        index = body[at + 16]
        if index >= len(store.SAMPLE_STATUSES):
            raise problem
        items.append((sample_id, store.SAMPLE_STATUSES[index]))
    return items


def _to_queue(back: str, notice: str, **extra: str) -> RedirectResponse:
    query = back.lstrip("?")
    parts = [query] if query else []
    parts.append(f"notice={quote(notice)}")
    parts += [f"{key}={quote(value)}" for key, value in extra.items() if value]
    return RedirectResponse("/ui/queue?" + "&".join(parts), status_code=303)


@router.post("/queue/bulk")
def bulk(
    request: Request,
    session: SessionDep,
    state: StateDep,
    user: CsrfDep,
    action: Annotated[str, Form(max_length=16)],
    ids: Annotated[list[str], Form()] = [],  # noqa: B006
    label: Annotated[str, Form(max_length=128)] = "",
    back: Annotated[str, Form(max_length=4096)] = "",
    confirm: Annotated[str, Form(max_length=8)] = "",
) -> Response:
    """Confirm, relabel or discard the ticked samples; a discard asks first, then can be undone."""
    request.state.ui_back = "/ui/queue?" + back.lstrip("?")  # for the error page
    chosen = list(dict.fromkeys(ids))
    if action == "discard" and confirm != "yes":
        if not chosen:
            raise ContractError("no samples selected: tick at least one row", reason="invalid")
        if len(chosen) > store.MAX_BULK:
            raise ContractError(f"a bulk action takes at most {store.MAX_BULK} samples")
        return _page(request, "bulk_confirm.html", user, ids=chosen, back=back)
    result = store.bulk_review(
        session=session,
        sample_ids=chosen,
        action=action,
        label=label,
        reviewer=user.username,
        classes=store.class_names_for(session=session, state=state),
    )
    notice = f"{action}: {len(result.done)} done"
    if result.skipped:
        notice += f", {len(result.skipped)} skipped (changed meanwhile by someone else)"
    undo = ""
    if action == "discard" and result.done:
        undo = _undo_token(state, user, result.done)
        notice += "; Undo puts them back"
    return _to_queue(back, notice, undo=undo)


@router.post("/queue/undo")
def bulk_undo(
    session: SessionDep,
    state: StateDep,
    user: CsrfDep,
    token: Annotated[str, Form(max_length=8192)],
    back: Annotated[str, Form(max_length=4096)] = "",
) -> Response:
    """Undo a bulk discard: each sample still discarded gets its previous status back."""
    result = store.undo_bulk(session=session, items=_read_undo_token(state, user, token))
    notice = f"undo: {len(result.done)} samples restored"
    if result.skipped:
        notice += f", {len(result.skipped)} skipped (changed meanwhile)"
    return _to_queue(back, notice)


# --- review ------------------------------------------------------------------


@router.get("/review/{sample_id}")
def review_page(
    request: Request, sample_id: str, session: SessionDep, state: StateDep, user: UserDep
) -> HTMLResponse:
    flt = _filter(request)
    sample, verdict, _ = crud.get_sample(session=session, sample_id=sample_id)
    classes = store.class_names_for(session=session, state=state)
    view = store.sample_view(session=session, sample=sample, verdict=verdict, classes=classes)
    return _page(request, "review.html", user, flt=flt, sample=view, query=flt.query_string())


@router.get("/review")
def review_first(request: Request, session: SessionDep, state: StateDep, user: UserDep) -> Response:
    """The first sample of the filter (the queue's "start reviewing")."""
    flt = _filter(request).without_page()
    page = store.queue_page(
        session=session, flt=flt, classes=store.class_names_for(session=session, state=state)
    )
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
def sample_json(
    sample_id: str, session: SessionDep, state: StateDep, _user: UserDep
) -> dict[str, Any]:
    sample, verdict, _ = crud.get_sample(session=session, sample_id=sample_id)
    classes = store.class_names_for(session=session, state=state)
    return store.sample_view(session=session, sample=sample, verdict=verdict, classes=classes)


@router.get("/api/samples/{sample_id}/neighbour")
def sample_neighbour(
    request: Request,
    sample_id: str,
    session: SessionDep,
    state: StateDep,
    _user: UserDep,
    direction: Annotated[str, Query(pattern="^(next|prev)$")] = "next",
) -> dict[str, Any]:
    flt = _filter(request)
    classes = store.class_names_for(session=session, state=state)
    sample, _, _ = crud.get_sample(session=session, sample_id=sample_id)
    found = store.neighbour(
        session=session, flt=flt, classes=classes, sample=sample, forward=direction == "next"
    )
    after = None
    if found is not None:
        after = store.sample_view(
            session=session, sample=found[0], verdict=found[1], classes=classes
        )
    return {"sample": after}


class ReviewIn(BaseModel):
    action: str = Field(pattern="^(label|discard)$")
    label: int | None = Field(default=None, ge=0, le=999)
    token: str = Field(max_length=64)
    query: str = Field(default="", max_length=4096)


@router.post("/api/samples/{sample_id}/review")
def review(
    sample_id: str,
    body: Annotated[ReviewIn, Body()],
    session: SessionDep,
    state: StateDep,
    user: CsrfDep,
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
    classes = store.class_names_for(session=session, state=state)
    sample, _, _ = crud.get_sample(session=session, sample_id=sample_id)
    found = store.neighbour(session=session, flt=flt, classes=classes, sample=sample, forward=True)
    after = None
    if found is not None:
        after = store.sample_view(
            session=session, sample=found[0], verdict=found[1], classes=classes
        )
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
def undo(
    body: Annotated[UndoIn, Body()], session: SessionDep, state: StateDep, user: CsrfDep
) -> dict[str, Any]:
    store.undo_review(
        session=session,
        sample_id=body.sample_id,
        previous=body.previous,
        label_id=body.label_id,
        token=body.token,
        user=user.username,
    )
    sample, verdict, _ = crud.get_sample(session=session, sample_id=body.sample_id)
    classes = store.class_names_for(session=session, state=state)
    return {
        "sample": store.sample_view(
            session=session, sample=sample, verdict=verdict, classes=classes
        )
    }


# --- export ------------------------------------------------------------------

EXPORT_FORMATS = [
    ("csv", "CSV"),
    ("json", "JSON"),
    ("imagefolder", "ImageFolder zip"),
    ("coco", "COCO JSON"),
    ("yolo", "YOLO zip"),
    ("labelstudio", "Label Studio JSON"),
]


@router.get("/export")
def export(
    request: Request,
    session: SessionDep,
    state: StateDep,
    blobs: BlobsDep,
    _user: UserDep,
    format: Annotated[str, Query(max_length=16)] = "csv",
) -> Response:
    """The samples under the queue's filter (its status included), as ``format``."""
    exports.media_type(format)  # an unknown format is refused before any work
    rows = store.export_rows(
        session=session,
        flt=_filter(request),
        classes=store.class_names_for(session=session, state=state),
    )
    return exports.download(format, rows, blobs=blobs, base_url=str(request.base_url))


# --- agents, dashboard, models --------------------------------------------------


def _ago(seconds: float) -> str:
    """A duration as the agents page shows it: "14 s", "30 min", "5 h", "3 d"."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size:.0f} {unit}"
    return f"{seconds:.0f} s"


@router.get("/agents")
def agents_page(request: Request, session: SessionDep, user: UserDep) -> HTMLResponse:
    agents, _ = crud.list_agents(session=session, limit=1000)
    now = datetime.now(UTC)
    rows = []
    for agent in agents:
        age = (now - agent.last_seen_at).total_seconds() if agent.last_seen_at else None
        online = agent.state == "online" and age is not None and age < OFFLINE_AFTER_S
        # A last will or an idle agent's status carries no figures: each key may be absent.
        telemetry = agent.telemetry or {}
        figures = {key: telemetry.get(key) for key in TELEMETRY_KEYS}
        ago = _ago(age) if age is not None else ""
        rows.append({"a": agent, "t": figures, "online": online, "age": age, "ago": ago})
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
    versions = [
        {"m": record, "installs": registry.install_summary(session=session, record=record)}
        for record in registry.list_versions(session=session)
    ]
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
    try:
        if action == "promote":
            rollout.promote_rollout(
                session=session,
                announcer=state.get_announcer(),
                topics=state.settings.topics,
                rollout_id=rollout_id,
                key=state.signing_key,
                reason=f"{action}d by {user.username} in the review UI",
                ttl=state.settings.announcement_ttl,
            )
        else:
            rollout.abort_rollout(
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


# --- distillation jobs and schedules: cloud_service/ui/jobs.py ---------------------


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


_ERROR_TITLES = {
    400: "Bad request",
    403: "Not allowed",
    404: "Not found",
    405: "Not allowed here",
    409: "Changed meanwhile",
    422: "Not valid",
}
ErrorHandler = Callable[[Request, Any], Response | Awaitable[Response]]


def _back_link(request: Request) -> str:
    """Where the error page's "back" goes without script: a form's own page, else the queue.

    (The page's script goes back in the history instead; no Referer reaches us.)
    """
    back = getattr(request.state, "ui_back", None)
    return back if isinstance(back, str) else "/ui/queue"


def _page_errors(previous: ErrorHandler) -> Callable[[Request, Any], Awaitable[Response]]:
    """A UI page's error as the error page with the reason; fetch and REST keep their JSON."""

    async def handler(request: Request, exc: Exception) -> Response:
        answer = previous(request, exc)
        response = await answer if inspect.isawaitable(answer) else answer
        page = request.url.path.startswith("/ui/") and not _wants_json(request)
        if not page or response.status_code < 400:
            return response
        try:
            detail = json.loads(bytes(response.body)).get("detail")
        except (ValueError, AttributeError):
            detail = None
        code = response.status_code
        message = detail if isinstance(detail, str) else "The request could not be completed."
        return _page(
            request,
            "error.html",
            getattr(request.state, "ui_user", None),
            status_code=code,
            title=_ERROR_TITLES.get(code, "Something went wrong"),
            message=message,
            back=_back_link(request),
        )

    return handler


def mount_ui(app: FastAPI) -> None:
    """Add the review UI's routes, static files and error pages to ``app``.

    Call it after the app's own error handlers are set: a UI page's error wraps them.
    """
    app.include_router(router)
    app.include_router(ui_jobs.router)
    app.mount("/ui/static", StaticFiles(directory=str(HERE / "static")), name="ui-static")
    app.add_exception_handler(LoginRequired, _login_required)
    app.add_exception_handler(NotAllowed, _not_allowed)
    for kind in (EdgeLoopError, RequestValidationError, StarletteHTTPException):
        previous = app.exception_handlers.get(kind)
        if previous is not None:
            app.add_exception_handler(kind, _page_errors(previous))
