"""The model registry and rollouts over REST; artifacts for agents, with HTTP Range.

Admin: register, list, show, promote, rollback, pin/unpin, rollouts. Agents (their
API token) and admins: ``GET /v1/models/{name}/{version}/artifact``.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path as FilePath
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Query, Request, Response, status
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from cloud_service import registry, rollout
from cloud_service.api.schemas import RowIdPath
from cloud_service.db.models import ModelStatusEvent, ModelVersion, Rollout, RolloutEvent
from cloud_service.web.deps import (
    AdminDep,
    AgentOrAdminDep,
    AnnouncerDep,
    BlobsDep,
    SessionDep,
    SettingsDep,
    StateDep,
)
from shared.errors import ContractError, StoreError
from shared.topics import validate_id

router = APIRouter(prefix="/v1", tags=["models"])

_ID = r"^[a-z0-9][a-z0-9_-]{0,63}$"
NamePath = Annotated[str, Path(pattern=_ID)]
VersionPath = Annotated[str, Path(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")]
FleetId = Annotated[str, Field(pattern=_ID)]
_RANGE_RE = re.compile(r"bytes=(\d*)-(\d*)")


class ModelVersionOut(BaseModel):
    model_config = ConfigDict(from_attributes=True, protected_namespaces=())

    name: str
    version: str
    format: str
    sha256: str
    size_bytes: int
    state: str
    metrics: dict[str, Any]
    parent_version: str | None
    source: str | None
    key_id: str
    created_at: datetime
    agents: dict[str, int] = Field(
        default_factory=dict,
        description="how many agents installed it, refused it, or have yet to (pending)",
    )


def _version_out(
    session: Any, record: ModelVersion
) -> tuple[ModelVersionOut, registry.InstallSummary]:
    """The version with its shown state ('refused' / 'partly refused' while agents refuse
    it, never 'serving') and its agents' counts."""
    summary = registry.install_summary(session=session, record=record)
    out = ModelVersionOut.model_validate(record)
    out.state = summary.state
    out.agents = {
        "installed": summary.count("installed"),
        "refused": summary.count("refused"),
        "pending": summary.count("pending") + summary.count("installing"),
    }
    return out, summary


class AgentInstallOut(BaseModel):
    agent: str
    fleet: str
    state: str = Field(description="installed, refused, installing, replaced or pending")
    reason: str | None
    at: datetime | None


class ModelDetail(ModelVersionOut):
    manifest: dict[str, Any]
    serving_fleets: list[str]
    agent_status: list[dict[str, Any]]
    installs: list[AgentInstallOut]


class RegisterFromPath(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="an ONNX file on the cloud host (the distill worker's output)")
    name: str | None = None
    version: str | None = None
    format: str = "fp32"
    metrics: dict[str, float] = Field(default_factory=dict)
    parent_version: str | None = None
    fleet: FleetId | None = Field(
        default=None, description="check against this fleet's agents (default: those serving it)"
    )


def _form_metrics(text: str | None) -> dict[str, float]:
    """The multipart ``metrics`` field: a JSON object of numbers, or nothing."""
    try:
        value = json.loads(text or "{}")
        if not isinstance(value, dict):
            raise ValueError("not an object")
        return {str(k): float(v) for k, v in value.items()}
    except (ValueError, TypeError, RecursionError) as exc:
        raise ContractError(
            f"'metrics' must be a JSON object of numbers, like {{\"top1\": 0.97}} ({exc})",
            reason="invalid",
        ) from None


class FleetIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fleet: FleetId = "default"


class PinIn(FleetIn):
    agents: list[Annotated[str, Field(pattern=_ID)]] = Field(min_length=1, max_length=1000)


class ServingOut(BaseModel):
    model_config = ConfigDict(from_attributes=True, protected_namespaces=())

    fleet: str
    model_name: str
    version: str
    history: list[str]
    updated_at: datetime


class RolloutIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fleet: FleetId = "default"
    name: str
    version: str
    percent: float | None = Field(default=None, gt=0, le=100)
    agents: list[Annotated[str, Field(pattern=_ID)]] | None = None
    criteria: rollout.RolloutCriteria = Field(default_factory=rollout.RolloutCriteria)


class RolloutEventOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    at: datetime
    kind: str
    detail: dict[str, Any]


class RolloutOut(BaseModel):
    model_config = ConfigDict(from_attributes=True, protected_namespaces=())

    id: int
    fleet: str
    model_name: str
    version: str
    baseline_version: str | None
    cohort: list[str]
    percent: float | None
    criteria: dict[str, Any]
    state: str
    reason: str | None
    evaluation: dict[str, Any]
    started_at: datetime
    window_ends_at: datetime
    finished_at: datetime | None
    events: list[RolloutEventOut] = Field(default_factory=list)


class ReasonIn(BaseModel):
    reason: str | None = Field(default=None, max_length=500)


def _detail(session: Any, record: ModelVersion) -> ModelDetail:
    from cloud_service.db.models import FleetModel

    fleets = session.scalars(
        select(FleetModel.fleet).where(
            FleetModel.model_name == record.name, FleetModel.version == record.version
        )
    ).all()
    events = session.scalars(
        select(ModelStatusEvent)
        .where(
            ModelStatusEvent.model_name == record.name,
            ModelStatusEvent.model_version == record.version,
        )
        .order_by(ModelStatusEvent.id.desc())
        .limit(200)
    ).all()
    version, summary = _version_out(session, record)
    return ModelDetail(
        **version.model_dump(),
        manifest=record.manifest,
        serving_fleets=list(fleets),
        agent_status=[
            {"agent": e.agent_id, "state": e.state, "reason": e.reason, "at": e.at.isoformat()}
            for e in events
        ],
        installs=[
            AgentInstallOut(
                agent=i.agent_id, fleet=i.fleet, state=i.state, reason=i.reason, at=i.at
            )
            for i in summary.installs
        ],
    )


@router.get("/models")
def list_models(
    session: SessionDep, _admin: AdminDep, name: Annotated[str | None, Query()] = None
) -> list[ModelVersionOut]:
    return [_version_out(session, v)[0] for v in registry.list_versions(session=session, name=name)]


@router.post("/models", status_code=status.HTTP_201_CREATED)
async def register(request: Request, state: StateDep, _admin: AdminDep) -> ModelDetail:
    """Register an ONNX student: multipart upload (``file`` + form fields) or a JSON path.

    Refused with 422 and the reason when no agent could run it, or when the agents it is
    meant for (``fleet``'s, else those serving a model of its name) would refuse it.
    """
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    fields: dict[str, Any]
    if content_type == "multipart/form-data":
        form = await request.form(max_files=1, max_fields=16, max_part_size=1 << 30)
        try:
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise ContractError(
                    "multipart registration needs a 'file' part with the ONNX model"
                )
            artifact: bytes | FilePath = await upload.read()
            fields = {k: v for k, v in form.items() if isinstance(v, str)}
        finally:
            await form.close()
        metrics = _form_metrics(fields.get("metrics"))
        source = "upload"
        fleet = fields.get("fleet") or None
        if fleet is not None:
            validate_id(fleet, "fleet")
    else:
        try:
            body = RegisterFromPath.model_validate_json(await request.body())
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "body"
            raise ContractError(
                f"registration is not valid ({where}: {first.get('msg', 'invalid')}): send"
                " multipart/form-data with a 'file' part, or JSON {\"path\": ...}",
                reason="invalid",
            ) from None
        artifact = FilePath(body.path)
        if not artifact.is_file():
            raise ContractError(f"{body.path} is not a file on the cloud host")
        fields = body.model_dump(exclude={"metrics", "path", "fleet"})
        metrics = body.metrics
        fleet = body.fleet
        source = body.path[-256:]

    def work() -> ModelDetail:
        with state.sessions.begin() as session:
            record = registry.register_model(
                session=session,
                blobs=state.blobs,
                key=state.signing_key,
                artifact=artifact,
                name=fields.get("name") or None,
                version=fields.get("version") or None,
                format=fields.get("format") or "fp32",
                metrics={str(k): float(v) for k, v in metrics.items()},
                parent_version=fields.get("parent_version") or None,
                source=source,
                atol=state.settings.golden_atol,
                fleet=fleet,
            )
            registry.apply_retention(
                session=session,
                blobs=state.blobs,
                name=record.name,
                keep=state.settings.model_retention_keep,
            )
            return _detail(session, record)

    return await run_in_threadpool(work)


@router.get("/models/{name}/{version}")
def show_model(
    name: NamePath, version: VersionPath, session: SessionDep, _admin: AdminDep
) -> ModelDetail:
    return _detail(session, registry.get_version(session=session, name=name, version=version))


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """(start, end inclusive) of a single ``bytes=`` range; None if unsatisfiable."""
    match = _RANGE_RE.fullmatch(header.strip())
    if match is None or not (match.group(1) or match.group(2)):
        raise ContractError(f"Range {header!r} is not a single 'bytes=start-[end]' range")
    first, last = match.groups()
    if not first:  # suffix: the last N bytes
        start, end = max(0, size - int(last)), size - 1
    else:
        start = int(first)
        end = min(int(last), size - 1) if last else size - 1
    if start >= size or start > end:
        return None
    return start, end


@router.get(
    "/models/{name}/{version}/artifact",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}}, 206: {}, 416: {}},
)
def get_artifact(
    name: NamePath,
    version: VersionPath,
    session: SessionDep,
    blobs: BlobsDep,
    _who: AgentOrAdminDep,
    range_: Annotated[str | None, Header(alias="Range")] = None,
) -> Response:
    """The artifact's bytes; a ``Range: bytes=N-`` request resumes a broken download."""
    record = registry.get_version(session=session, name=name, version=version)
    if record.state == "deleted":
        raise StoreError(f"the artifact of {name} {version} was removed", reason="not_found")
    path = registry.artifact_path(blobs, record.artifact_key)
    data: bytes | None = None
    if path is not None and path.is_file():
        size = path.stat().st_size
    else:
        data = blobs.get(record.artifact_key)
        size = len(data)
    headers = {"Accept-Ranges": "bytes", "ETag": f'"{record.sha256}"'}
    start, end, code = 0, size - 1, 200
    if range_:
        parsed = _parse_range(range_, size)
        if parsed is None:
            return Response(
                status_code=416, headers={**headers, "Content-Range": f"bytes */{size}"}
            )
        start, end = parsed
        code = 206
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    if data is None:
        assert path is not None
        with path.open("rb") as handle:
            handle.seek(start)
            body = handle.read(end - start + 1)
    else:
        body = data[start : end + 1]
    return Response(body, status_code=code, media_type="application/octet-stream", headers=headers)


@router.post("/models/{name}/{version}/promote")
def promote_model(
    name: NamePath,
    version: VersionPath,
    body: FleetIn,
    session: SessionDep,
    announcer: AnnouncerDep,
    settings: SettingsDep,
    state: StateDep,
    _admin: AdminDep,
) -> ServingOut:
    """Announce this version to the whole fleet (retained); canary overrides are withdrawn."""
    serving = registry.promote(
        session=session,
        announcer=announcer,
        topics=settings.topics,
        fleet=body.fleet,
        name=name,
        version=version,
        key=state.signing_key,
        ttl=settings.announcement_ttl,
    )
    return ServingOut.model_validate(serving)


@router.post("/models/{name}/rollback")
def rollback_model(
    name: NamePath,
    body: FleetIn,
    session: SessionDep,
    announcer: AnnouncerDep,
    settings: SettingsDep,
    state: StateDep,
    _admin: AdminDep,
) -> ServingOut:
    """Announce the version the fleet served before the current one."""
    serving = registry.rollback(
        session=session,
        announcer=announcer,
        topics=settings.topics,
        fleet=body.fleet,
        name=name,
        key=state.signing_key,
        ttl=settings.announcement_ttl,
    )
    return ServingOut.model_validate(serving)


@router.post("/models/{name}/{version}/pin")
def pin_model(
    name: NamePath,
    version: VersionPath,
    body: PinIn,
    session: SessionDep,
    announcer: AnnouncerDep,
    settings: SettingsDep,
    state: StateDep,
    _admin: AdminDep,
) -> dict[str, Any]:
    """Hold these agents on this version (a per-agent retained announcement)."""
    registry.pin(
        session=session,
        announcer=announcer,
        topics=settings.topics,
        fleet=body.fleet,
        name=name,
        version=version,
        agents=body.agents,
        key=state.signing_key,
        ttl=settings.announcement_ttl,
    )
    return {"pinned": body.agents, "version": version}


@router.post("/models/unpin")
def unpin_agents(
    body: PinIn,
    session: SessionDep,
    announcer: AnnouncerDep,
    settings: SettingsDep,
    _admin: AdminDep,
) -> dict[str, Any]:
    """Withdraw pins: these agents follow the fleet announcement again."""
    cleared = registry.unpin(
        session=session,
        announcer=announcer,
        topics=settings.topics,
        fleet=body.fleet,
        agents=body.agents,
    )
    return {"unpinned": cleared}


def _rollout_out(item: Rollout, events: list[RolloutEvent] | None = None) -> RolloutOut:
    out = RolloutOut.model_validate(item)
    out.events = [RolloutEventOut.model_validate(e) for e in events or []]
    return out


@router.post("/rollouts", status_code=status.HTTP_201_CREATED)
def create_rollout(
    body: RolloutIn,
    session: SessionDep,
    announcer: AnnouncerDep,
    settings: SettingsDep,
    state: StateDep,
    _admin: AdminDep,
) -> RolloutOut:
    """Start a canary: a cohort by percentage or by name, criteria for abort and promotion."""
    item = rollout.create_rollout(
        session=session,
        announcer=announcer,
        topics=settings.topics,
        fleet=body.fleet,
        name=body.name,
        version=body.version,
        percent=body.percent,
        agents=body.agents,
        criteria=body.criteria,
        key=state.signing_key,
        ttl=settings.announcement_ttl,
    )
    return _rollout_out(item)


@router.get("/rollouts")
def list_rollouts(
    session: SessionDep, _admin: AdminDep, fleet: Annotated[str | None, Query()] = None
) -> list[RolloutOut]:
    return [_rollout_out(r) for r in rollout.list_rollouts(session=session, fleet=fleet)]


@router.get("/rollouts/{rollout_id}")
def get_rollout(rollout_id: RowIdPath, session: SessionDep, _admin: AdminDep) -> RolloutOut:
    item, events = rollout.get_rollout(session=session, rollout_id=rollout_id)
    return _rollout_out(item, events)


@router.post("/rollouts/{rollout_id}/promote")
def promote_rollout(
    rollout_id: RowIdPath,
    session: SessionDep,
    announcer: AnnouncerDep,
    settings: SettingsDep,
    state: StateDep,
    _admin: AdminDep,
    body: ReasonIn | None = None,
) -> RolloutOut:
    item = rollout.promote_rollout(
        session=session,
        announcer=announcer,
        topics=settings.topics,
        rollout_id=rollout_id,
        key=state.signing_key,
        ttl=settings.announcement_ttl,
        reason=(body.reason if body and body.reason else "promoted by hand"),
    )
    return _rollout_out(item)


@router.post("/rollouts/{rollout_id}/abort")
def abort_rollout(
    rollout_id: RowIdPath,
    session: SessionDep,
    announcer: AnnouncerDep,
    settings: SettingsDep,
    _admin: AdminDep,
    body: ReasonIn | None = None,
) -> RolloutOut:
    item = rollout.abort_rollout(
        session=session,
        announcer=announcer,
        topics=settings.topics,
        rollout_id=rollout_id,
        reason=(body.reason if body and body.reason else "aborted by hand"),
    )
    return _rollout_out(item)
