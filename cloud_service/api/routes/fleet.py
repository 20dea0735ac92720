"""Agents, samples, verdicts, labels, dead letters and stats (admin only for now)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Response, status

from cloud_service.api.schemas import (
    AgentId,
    AgentOut,
    DeadLetterOut,
    FleetId,
    LabelIn,
    LabelOut,
    Page,
    SampleDetail,
    SampleOut,
    VerdictOut,
)
from cloud_service.db import crud
from cloud_service.errors import NotFoundError
from cloud_service.web.deps import AdminDep, BlobsDep, SessionDep

router = APIRouter(prefix="/v1", tags=["fleet"])

Limit = Annotated[int, Query(ge=1, le=500, description="page size (1-500)")]
Offset = Annotated[int, Query(ge=0, le=10_000_000)]
SampleIdPath = Annotated[
    str,
    Path(
        pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
        description="a sample id (lower-case UUID)",
    ),
]
AgentIdPath = Annotated[str, Path(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")]
Status = Literal["pending", "verified", "flagged", "reviewed", "discarded"]
RouteReason = Literal["low_confidence", "margin", "entropy", "class_threshold", "audit", "manual"]


@router.get("/agents")
def list_agents(
    session: SessionDep,
    _admin: AdminDep,
    fleet: Annotated[FleetId | None, Query()] = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> Page[AgentOut]:
    items, total = crud.list_agents(session=session, fleet=fleet, limit=limit, offset=offset)
    return Page[AgentOut](
        items=[AgentOut.model_validate(a) for a in items], total=total, limit=limit, offset=offset
    )


@router.get("/agents/{agent_id}")
def get_agent(agent_id: AgentIdPath, session: SessionDep, _admin: AdminDep) -> AgentOut:
    items, _ = crud.list_agents(session=session, limit=1, offset=0, agent_id=agent_id)
    if not items:
        raise NotFoundError(f"agent {agent_id} is not known")
    return AgentOut.model_validate(items[0])


@router.get("/samples")
def list_samples(
    session: SessionDep,
    _admin: AdminDep,
    fleet: Annotated[FleetId | None, Query()] = None,
    agent_id: Annotated[AgentId | None, Query()] = None,
    status_: Annotated[Status | None, Query(alias="status")] = None,
    route_reason: Annotated[RouteReason | None, Query()] = None,
    since: Annotated[datetime | None, Query(description="captured at or after (ISO 8601)")] = None,
    until: Annotated[datetime | None, Query(description="captured before (ISO 8601)")] = None,
    limit: Limit = 50,
    offset: Offset = 0,
) -> Page[SampleOut]:
    items, total = crud.list_samples(
        session=session,
        fleet=fleet,
        agent_id=agent_id,
        status=status_,
        route_reason=route_reason,
        since=_aware(since),
        until=_aware(until),
        limit=limit,
        offset=offset,
    )
    return Page[SampleOut](
        items=[SampleOut.model_validate(s) for s in items], total=total, limit=limit, offset=offset
    )


def _aware(value: datetime | None) -> datetime | None:
    from datetime import UTC

    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)  # a time without a zone is taken as UTC
    return value


@router.get("/samples/{sample_id}")
def get_sample(sample_id: SampleIdPath, session: SessionDep, _admin: AdminDep) -> SampleDetail:
    sample, verdict, labels = crud.get_sample(session=session, sample_id=sample_id)
    return SampleDetail(
        **SampleOut.model_validate(sample).model_dump(),
        verdict=VerdictOut.model_validate(verdict) if verdict else None,
        labels=[LabelOut.model_validate(label) for label in labels],
    )


@router.get(
    "/samples/{sample_id}/image",
    response_class=Response,
    responses={200: {"content": {"image/jpeg": {}, "image/png": {}}}},
)
def get_sample_image(
    sample_id: SampleIdPath, session: SessionDep, blobs: BlobsDep, _admin: AdminDep
) -> Response:
    sample, _, _ = crud.get_sample(session=session, sample_id=sample_id)
    data = blobs.get(sample.image_key)
    return Response(data, media_type=f"image/{sample.image_format}")


@router.post("/samples/{sample_id}/labels", status_code=status.HTTP_201_CREATED)
def add_label(
    sample_id: SampleIdPath, body: LabelIn, session: SessionDep, _admin: AdminDep
) -> LabelOut:
    label = crud.add_label(
        session=session,
        sample_id=sample_id,
        label=body.label,
        labeled_by=body.labeled_by,
        note=body.note,
    )
    session.flush()
    return LabelOut.model_validate(label)


@router.get("/verdicts")
def list_verdicts(
    session: SessionDep,
    _admin: AdminDep,
    agent_id: Annotated[AgentId | None, Query()] = None,
    review: bool | None = None,
    agrees: bool | None = None,
    limit: Limit = 50,
    offset: Offset = 0,
) -> Page[VerdictOut]:
    items, total = crud.list_verdicts(
        session=session, agent_id=agent_id, review=review, agrees=agrees, limit=limit, offset=offset
    )
    return Page[VerdictOut](
        items=[VerdictOut.model_validate(v) for v in items], total=total, limit=limit, offset=offset
    )


@router.get("/dead-letters")
def list_dead_letters(
    session: SessionDep,
    _admin: AdminDep,
    reason: Annotated[str | None, Query(max_length=64)] = None,
    limit: Limit = 50,
    offset: Offset = 0,
) -> Page[DeadLetterOut]:
    items, total = crud.list_dead_letters(
        session=session, reason=reason, limit=limit, offset=offset
    )
    return Page[DeadLetterOut](
        items=[DeadLetterOut.model_validate(d) for d in items],
        total=total,
        limit=limit,
        offset=offset,
    )


@router.get("/stats")
def get_stats(session: SessionDep, _admin: AdminDep) -> dict[str, object]:
    """Samples by status, agreement and review rates, dead letters by reason, agents."""
    return crud.stats(session=session)
