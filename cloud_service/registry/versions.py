"""Registered versions: store, describe and sign an artifact once; look up; retention.

Each version's artifact sits in the blob store under a content-addressed key
(``models/{name}/{sha256}.onnx``); retention keeps the newest ``keep`` versions of a
model plus every version a fleet serves, an agent is pinned to, or a running rollout
uses, and the others lose their artifact (state "deleted"; the row and its lineage stay).
"""

from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from cloud_service.blobs_base import BlobStore
from cloud_service.db.models import AgentOverride, FleetModel, ModelVersion, Rollout
from cloud_service.errors import ConflictError, NotFoundError
from cloud_service.registry.inspection import build_manifest, inspect_onnx, stamp_identity
from cloud_service.registry.refusals import agent_refusals, refusal_message
from shared.errors import ManifestError
from shared.manifest import FleetSigningKey
from shared.messages import encode_message, sign_manifest

__all__ = [
    "apply_retention",
    "artifact_key",
    "artifact_path",
    "get_version",
    "list_versions",
    "register_model",
    "require_servable",
]

log = logging.getLogger(__name__)

# What agents accept by default (AgentSettings.max_announcement_bytes): one golden frame
# of a large input (a 512x512 model) would be over it, and every agent would refuse.
_AGENT_ANNOUNCEMENT_LIMIT = 1 << 20


def artifact_key(name: str, sha256: str) -> str:
    return f"models/{name}/{sha256}.onnx"


def artifact_path(blobs: BlobStore, key: str) -> Path | None:
    """The artifact's file when the store is a local folder (served with Range from disk)."""
    root = getattr(blobs, "root", None)
    return Path(root) / key if root is not None else None


def register_model(
    *,
    session: Session,
    blobs: BlobStore,
    key: FleetSigningKey,
    artifact: bytes | Path,
    name: str | None = None,
    version: str | None = None,
    format: str = "fp32",
    metrics: dict[str, float] | None = None,
    parent_version: str | None = None,
    source: str | None = None,
    atol: float = 1e-3,
    now: datetime | None = None,
    fleet: str | None = None,
) -> ModelVersion:
    """Store, describe and sign a new immutable version; raises ConflictError if it exists.

    Refused with the reason (ManifestError) when no agent could run it (the student
    contract, labels, opset, this cloud's runtime), or when the agents it is meant for
    would refuse it: those of ``fleet``, else those serving a model of the same name.
    """
    data = artifact.read_bytes() if isinstance(artifact, Path) else bytes(artifact)
    inspect_onnx(data)  # refuses a file that is no student before it is rewritten
    data = stamp_identity(data, name, version)
    manifest = build_manifest(
        data,
        name=name,
        version=version,
        format=format,
        metrics=metrics,
        parent_version=parent_version,
        atol=atol,
        now=now,
    )
    name, version, sha = manifest.name, manifest.version, manifest.sha256
    existing = session.scalars(
        select(ModelVersion).where(ModelVersion.name == name, ModelVersion.version == version)
    ).first()
    if existing is not None:
        raise ConflictError(f"model {name} {version} is already registered; versions are immutable")
    refusals = agent_refusals(session=session, manifest=manifest, fleet=fleet)
    if refusals:
        raise ManifestError(refusal_message(manifest, refusals), reason=refusals[0].reason)
    announcement = sign_manifest(manifest, key)
    raw = encode_message(announcement)
    if len(raw) > _AGENT_ANNOUNCEMENT_LIMIT:
        raise ManifestError(
            f"the announcement of {name} {version} is {len(raw)} bytes (its golden frame of"
            f" input {manifest.input.shape}); agents accept at most {_AGENT_ANNOUNCEMENT_LIMIT}",
            reason="too_large",
        )
    blob_key = artifact_key(name, sha)
    blobs.put(blob_key, data)
    record = ModelVersion(
        name=name,
        version=version,
        format=format,
        sha256=sha,
        size_bytes=len(data),
        artifact_key=blob_key,
        manifest=manifest.model_dump(mode="json", by_alias=True, exclude_none=True),
        announcement=raw,
        key_id=key.key_id,
        metrics=dict(metrics or {}),
        parent_version=parent_version,
        source=source,
        state="registered",
    )
    session.add(record)
    session.flush()
    log.info("registered model %s %s (%d bytes, sha256 %s)", name, version, len(data), sha[:12])
    return record


def list_versions(*, session: Session, name: str | None = None) -> list[ModelVersion]:
    stmt = select(ModelVersion).order_by(ModelVersion.name, ModelVersion.id.desc())
    if name is not None:
        stmt = stmt.where(ModelVersion.name == name)
    return list(session.scalars(stmt).all())


def get_version(*, session: Session, name: str, version: str) -> ModelVersion:
    record = session.scalars(
        select(ModelVersion).where(ModelVersion.name == name, ModelVersion.version == version)
    ).first()
    if record is None:
        raise NotFoundError(f"model {name} {version} is not registered")
    return record


def require_servable(record: ModelVersion) -> None:
    if record.state == "deleted":
        raise ConflictError(
            f"model {record.name} {record.version} was removed by retention; register it again"
        )


def apply_retention(*, session: Session, blobs: BlobStore, name: str, keep: int) -> list[str]:
    """Delete the artifacts of old versions no one uses; return the versions removed."""
    used: set[str] = set()
    for fleet_model in session.scalars(select(FleetModel).where(FleetModel.model_name == name)):
        used.add(fleet_model.version)
        used.update(fleet_model.history[-1:])  # keep what a rollback would need
    used.update(
        session.scalars(select(AgentOverride.version).where(AgentOverride.model_name == name))
    )
    for rollout in session.scalars(
        select(Rollout).where(Rollout.model_name == name, Rollout.state == "running")
    ):
        used.add(rollout.version)
        if rollout.baseline_version:
            used.add(rollout.baseline_version)
    live = [v for v in list_versions(session=session, name=name) if v.state != "deleted"]
    removed: list[str] = []
    for index, record in enumerate(live):  # newest first
        if index < keep or record.version in used:
            continue
        shared_blob = any(
            other.artifact_key == record.artifact_key for other in live if other is not record
        ) and any(
            o.artifact_key == record.artifact_key and (i < keep or o.version in used)
            for i, o in enumerate(live)
            if o is not record
        )
        if not shared_blob:
            blobs.delete(record.artifact_key)
        record.state = "deleted"
        removed.append(record.version)
    if removed:
        log.info("retention removed %s %s", name, removed)
    return removed
