"""The review UI's agents, dashboard and models pages, and rollout actions (admin)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from cloud_service import registry, rollout
from cloud_service.db import crud
from cloud_service.errors import ConflictError, NotFoundError
from cloud_service.ui import charts, store
from cloud_service.ui.deps import AdminUserDep, CsrfDep, UserDep
from cloud_service.ui.routes.pages import render_page
from cloud_service.web.deps import SessionDep, StateDep

__all__ = ["router"]

router = APIRouter(prefix="/ui", include_in_schema=False)

OFFLINE_AFTER_S = 120.0  # a heartbeat older than this shows as stale
TELEMETRY_KEYS = (
    "provider", "frames_per_s", "latency_p50_ms", "latency_p99_ms", "forward_rate",
    "spool_depth", "dropped_frames", "agreement_rate",
)  # fmt: skip


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
    return render_page(request, "agents.html", user, rows=rows)


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
    return render_page(
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
    return render_page(request, "models.html", user, versions=versions, rollouts=rollouts)


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
