"""The model registry: immutable signed versions, what each fleet serves, pins, retention.

    version = register_model(session=s, blobs=b, key=k, artifact=Path("student.onnx"))
    promote(session=s, announcer=a, topics=t, fleet="default", name=..., version=...)

A version is registered once and never changes: its artifact sits in the blob store
under a content-addressed key (``models/{name}/{sha256}.onnx``), and its manifest is
signed with the fleet key at registration (the stored announcement proves the key
accepted it; re-encoding a decoded announcement may not verify).

Serving state: ``fleet_models`` says which version a fleet's retained announcement
names (and the versions before it, for rollback); ``agent_overrides`` holds the
per-agent retained announcements of canary cohorts and pins. Every change here is
also published (retained, QoS 1) through the ``Announcer``; an override withdrawn is
a zero-length retained message, and the agent falls back to the fleet announcement.

What is published is signed afresh for each announcement: the version's manifest
plus its freshness (``sequence``, ``expires_at``, and the fleet and agent it is for),
so an old announcement replayed on the topic is refused by agents (they keep the
highest sequence they accepted). The sequence is ``max(last + 1, now in ms)`` from a
per-fleet row updated atomically (``announcement_sequences``): strictly increasing
across API restarts and replicas (the row update serializes them, and ``last + 1``
wins over a replica whose clock is behind), and still above what agents hold when
the database is restored from a backup or recreated (the wall clock carries it on).

Retention keeps the newest ``keep`` versions of a model plus every version a fleet
serves, an agent is pinned to, or a running rollout uses; the others lose their
artifact (state "deleted"; the row and its lineage stay).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError
from sqlalchemy import BigInteger, case, delete, insert, literal, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from cloud_service.announce import Announcer
from cloud_service.blobs import BlobStore
from cloud_service.db.models import (
    Agent,
    AgentOverride,
    AnnouncementSequence,
    FleetModel,
    ModelStatusEvent,
    ModelVersion,
    Rollout,
)
from cloud_service.errors import ConflictError, NotFoundError
from shared.errors import ContractError, ManifestError
from shared.manifest import (
    FleetSigningKey,
    GoldenCase,
    InputSpec,
    ModelManifest,
    ModelSource,
    agent_refusal,
    sign_manifest,
)
from shared.messages import encode_message
from shared.topics import Topics, validate_id

__all__ = [
    "DEFAULT_ANNOUNCEMENT_TTL",
    "AgentInstall",
    "AgentRefusal",
    "InstallSummary",
    "agent_refusals",
    "apply_retention",
    "artifact_path",
    "build_manifest",
    "get_version",
    "inspect_onnx",
    "install_summary",
    "list_versions",
    "min_runtime_for_opset",
    "next_sequence",
    "pin",
    "promote",
    "refresh_announcements",
    "register_model",
    "rollback",
    "serving",
    "signed_announcement",
    "unpin",
]

log = logging.getLogger(__name__)

# Lowest onnxruntime release that runs each ai.onnx opset (onnxruntime's compatibility
# table); anything newer than the table needs the runtime this cloud runs.
_OPSET_RUNTIME = {
    13: "1.7",
    14: "1.10",
    15: "1.11",
    16: "1.12",
    17: "1.13",
    18: "1.14",
    19: "1.16",
    20: "1.17",
    21: "1.18",
    22: "1.20",
    23: "1.22",
}
# Golden inputs travel base64 inside the retained announcement: keep them under ~48 KB.
_GOLDEN_BUDGET_BYTES = 36_000
_MAX_GOLDEN = 3
# What agents accept by default (AgentSettings.max_announcement_bytes): one golden frame
# of a large input (a 512x512 model) would be over it, and every agent would refuse.
_AGENT_ANNOUNCEMENT_LIMIT = 1 << 20
# How long agents may act on a retained announcement. Long, because a fleet that is
# simply idle keeps its announcement retained: ``refresh_announcements`` signs it
# again once half of this has passed, and an agent that already serves the version
# named is not disturbed by an expired copy.
DEFAULT_ANNOUNCEMENT_TTL = timedelta(days=30)


def min_runtime_for_opset(opset: int) -> str:
    """The lowest onnxruntime version that runs ``opset``."""
    if opset <= 13:
        return _OPSET_RUNTIME[13]
    if opset in _OPSET_RUNTIME:
        return _OPSET_RUNTIME[opset]
    import onnxruntime

    return ".".join(onnxruntime.__version__.split(".")[:2])


_WRAP_HINT = "; wrap a model of another contract with `edgeloop models import`"


def _refused(message: str, reason: str) -> ManifestError:
    return ManifestError(message, reason=reason)


def _labels_from(meta: dict[str, str]) -> list[str] | None:
    if "edgeloop.labels" not in meta:
        return None
    try:
        parsed = json.loads(meta["edgeloop.labels"])
    except ValueError as exc:
        raise _refused(f"the model's edgeloop.labels is not JSON: {exc}", "labels") from None
    if not isinstance(parsed, list) or not all(isinstance(x, str | int) for x in parsed):
        raise _refused("the model's edgeloop.labels must be a JSON list of class names", "labels")
    return [str(x) for x in parsed]


def inspect_onnx(data: bytes) -> dict[str, Any]:
    """Name, version, input spec, output, labels, opset and source read from an ONNX student.

    Refuses (ManifestError, with the agent's reason slug) a model no agent would load:
    the student contract is one input ``frames`` uint8 [batch, H, W, 3] with a fixed H and
    W, and an output ``scores`` [batch, classes].
    """
    import onnx

    try:
        model = onnx.load_model_from_string(data)
    except Exception as exc:  # protobuf raises its own DecodeError
        raise _refused(f"the artifact is not an ONNX model: {exc}", "not_onnx") from exc
    graph = model.graph
    initializers = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    outputs = {o.name: o for o in graph.output}
    names = [i.name for i in inputs]
    if len(inputs) != 1 or names[0] != "frames" or "scores" not in outputs:
        raise _refused(
            f"the model's tensors are {names} -> {sorted(outputs)}; the student contract is"
            " 'frames' -> 'scores'" + _WRAP_HINT,
            "incompatible_input",
        )
    tensor = inputs[0].type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name if tensor.elem_type else "?"
    shape: list[int | str] = []
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value"):
            shape.append(int(dim.dim_value))
        else:
            shape.append(dim.dim_param or "batch")
    fixed_hw = len(shape) == 4 and isinstance(shape[1], int) and isinstance(shape[2], int)
    if dtype != "uint8" or not fixed_hw or shape[3] != 3:
        raise _refused(
            f"input 'frames' is {dtype} {shape}; agents feed uint8 NHWC [batch, H, W, 3] with"
            " a fixed H and W" + _WRAP_HINT,
            "incompatible_input",
        )
    out_dims = outputs["scores"].type.tensor_type.shape.dim
    meta = {p.key: p.value for p in model.metadata_props}
    labels = _labels_from(meta)
    if labels is None:
        if len(out_dims) == 2 and out_dims[1].HasField("dim_value"):
            labels = [str(i) for i in range(out_dims[1].dim_value)]
        else:
            raise _refused(
                "the model names no labels (edgeloop.labels) and has no fixed classes", "labels"
            )
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset < 1:
        raise _refused("the model imports no ai.onnx opset", "incompatible_opset")
    source = None
    if "edgeloop.source" in meta:
        try:
            source = ModelSource.model_validate_json(meta["edgeloop.source"])
        except ValueError as exc:  # pydantic: an older or foreign description
            log.warning("ignoring the model's edgeloop.source: %s", exc)
    return {
        "name": meta.get("edgeloop.name"),
        "version": meta.get("edgeloop.version"),
        "input": InputSpec(name="frames", shape=shape, dtype="uint8", layout="NHWC"),
        "output_name": "scores",
        "labels": labels,
        "opset": int(opset),
        "source": source,
    }


def _golden(
    data: bytes, spec: InputSpec, output_name: str, atol: float, labels: Sequence[str]
) -> list[GoldenCase]:
    """Deterministic frames and the scores this model gives them (ONNX Runtime, CPU).

    This is also the check that this cloud's runtime loads and runs the model: a
    model it cannot run is refused here, before any agent is told about it.
    """
    import onnxruntime as ort

    dims = [d if isinstance(d, int) else 1 for d in spec.shape]
    frame_bytes = int(np.prod(dims[1:]))
    count = max(1, min(_MAX_GOLDEN, _GOLDEN_BUDGET_BYTES // max(1, frame_bytes)))
    rng = np.random.default_rng(20261201)
    frames = rng.integers(0, 256, size=(count, *dims[1:]), dtype=np.uint8)
    try:
        session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        scores = session.run([output_name], {spec.name: frames.astype(spec.dtype)})[0]
    except Exception as exc:  # ORT's untyped errors, wrapped once
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _refused(
            f"onnxruntime {ort.__version__} cannot load or run the model: {first}", "load_failed"
        ) from exc
    scores = np.asarray(scores, dtype=np.float32)
    if scores.ndim != 2 or scores.shape[0] != count:
        raise _refused(
            f"'scores' has shape {list(scores.shape)} for {count} frames; it must be"
            " [batch, classes]",
            "incompatible_output",
        )
    if scores.shape[1] != len(labels):
        raise _refused(
            f"the model names {len(labels)} labels but 'scores' has {scores.shape[1]} classes",
            "labels",
        )
    import base64

    return [
        GoldenCase(
            input=base64.b64encode(frames.tobytes()).decode("ascii"),
            shape=[count, *dims[1:]],
            expected=[[float(x) for x in row] for row in scores],
            atol=atol,
        )
    ]


def _stamp_identity(data: bytes, name: str | None, version: str | None) -> bytes:
    """The artifact with ``edgeloop.name`` / ``edgeloop.version`` set to the registry's.

    The agent tags every sample with the version its model file names, and the
    verifier its verdicts: a version registered under another name than the file's
    metadata is rewritten so that the file, the manifest and the samples agree.
    """
    import onnx

    wanted = {k: v for k, v in (("edgeloop.name", name), ("edgeloop.version", version)) if v}
    if not wanted:
        return data
    model = onnx.load_model_from_string(data)
    meta = {p.key: p.value for p in model.metadata_props}
    if all(meta.get(k) == v for k, v in wanted.items()):
        return data
    kept = [p for p in model.metadata_props if p.key not in wanted]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in wanted.items():
        model.metadata_props.add(key=key, value=value)
    return bytes(model.SerializeToString())


@dataclass(frozen=True)
class AgentRefusal:
    """An agent that would refuse a version, and why (its model-status reason slug)."""

    agent_id: str
    fleet: str
    reason: str
    message: str


def agent_refusals(
    *,
    session: Session,
    manifest: ModelManifest,
    fleet: str | None = None,
    agents: Sequence[str] | None = None,
) -> list[AgentRefusal]:
    """The agents that would refuse ``manifest``, judged from what their heartbeats report.

    Whom: ``agents`` when given, else the agents of ``fleet``, else the agents serving a
    model of the same name. An agent that reports no input size, runtime or opset (one
    older than these heartbeat fields) is left out; it reports its answer on install.
    """
    stmt = select(Agent).order_by(Agent.agent_id)
    if agents is not None:
        stmt = stmt.where(Agent.agent_id.in_(list(agents)))
    elif fleet is not None:
        stmt = stmt.where(Agent.fleet == fleet)
    refusals: list[AgentRefusal] = []
    for agent in session.scalars(stmt):
        telemetry = agent.telemetry or {}
        if agents is None and fleet is None and telemetry.get("model_name") != manifest.name:
            continue
        hw = telemetry.get("input_hw")
        runtime, max_opset = telemetry.get("runtime_version"), telemetry.get("max_opset")
        if not (isinstance(hw, list) and len(hw) == 2 and runtime and max_opset):
            continue
        refusal = agent_refusal(
            manifest,
            input_hw=(int(hw[0]), int(hw[1])),
            max_opset=int(max_opset),
            runtime_version=str(runtime),
        )
        if refusal is not None:
            refusals.append(AgentRefusal(agent.agent_id, agent.fleet, *refusal))
    return refusals


def _refusal_message(manifest: ModelManifest, refusals: Sequence[AgentRefusal]) -> str:
    shown = "; ".join(f"agent {r.agent_id} (fleet {r.fleet}): {r.message}" for r in refusals[:3])
    more = f" and {len(refusals) - 3} more" if len(refusals) > 3 else ""
    return (
        f"{len(refusals)} agent(s) would refuse {manifest.name} {manifest.version}"
        f" ({refusals[0].reason}): {shown}{more}"
    )


def _check_agents(
    session: Session,
    record: ModelVersion,
    *,
    fleet: str | None = None,
    agents: Sequence[str] | None = None,
) -> None:
    """ConflictError (409) if agents about to be told of ``record`` would refuse it."""
    try:
        manifest = ModelManifest.model_validate(record.manifest)
    except ValidationError as exc:
        raise ConflictError(
            f"{record.name} {record.version} has no valid manifest to announce"
            f" ({exc.error_count()} problem(s)); register the model again",
            reason="invalid_manifest",
        ) from exc
    refusals = agent_refusals(session=session, manifest=manifest, fleet=fleet, agents=agents)
    if refusals:
        raise ConflictError(_refusal_message(manifest, refusals), reason=refusals[0].reason)


def artifact_key(name: str, sha256: str) -> str:
    return f"models/{name}/{sha256}.onnx"


def artifact_path(blobs: BlobStore, key: str) -> Path | None:
    """The artifact's file when the store is a local folder (served with Range from disk)."""
    root = getattr(blobs, "root", None)
    return Path(root) / key if root is not None else None


def build_manifest(
    data: bytes,
    *,
    name: str | None = None,
    version: str | None = None,
    format: str = "fp32",
    metrics: dict[str, float] | None = None,
    parent_version: str | None = None,
    atol: float = 1e-3,
    url: str | None = None,
    now: datetime | None = None,
) -> ModelManifest:
    """The manifest of an ONNX student: hash, size, input spec, labels, opset, golden cases."""
    import hashlib

    info = inspect_onnx(data)
    name = validate_id(name or info["name"] or "", "model")
    version = version or info["version"]
    if not version:
        raise ContractError("no version given and the model has no edgeloop.version metadata")
    try:
        return ModelManifest(
            name=name,
            version=version,
            format=format,
            sha256=hashlib.sha256(data).hexdigest(),
            size_bytes=len(data),
            url=url or f"/v1/models/{name}/{version}/artifact",
            input=info["input"],
            output_name=info["output_name"],
            labels=info["labels"],
            opset=info["opset"],
            min_runtime_version=min_runtime_for_opset(info["opset"]),
            golden=_golden(data, info["input"], info["output_name"], atol, info["labels"]),
            created_at=now or datetime.now(UTC),
            parent_version=parent_version,
            metrics=metrics or {},
            source=info["source"],
        )
    except ValueError as exc:  # pydantic: a manifest field out of its range
        raise ManifestError(f"cannot describe model {name} {version}: {exc}") from exc


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
    data = _stamp_identity(data, name, version)
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
        raise ManifestError(_refusal_message(manifest, refusals), reason=refusals[0].reason)
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


def _servable(record: ModelVersion) -> None:
    if record.state == "deleted":
        raise ConflictError(
            f"model {record.name} {record.version} was removed by retention; register it again"
        )


def serving(*, session: Session, fleet: str) -> FleetModel | None:
    return session.get(FleetModel, fleet)


def next_sequence(*, session: Session, fleet: str, now: datetime | None = None) -> int:
    """The fleet's next announcement sequence: ``max(last + 1, now in ms)`` (see module doc)."""
    now_ms = int((now or datetime.now(UTC)).timestamp() * 1000)
    last = AnnouncementSequence.last_sequence
    bump = (
        update(AnnouncementSequence)
        .where(AnnouncementSequence.fleet == fleet)
        .values(last_sequence=_greatest(last + 1, now_ms), updated_at=datetime.now(UTC))
        .returning(last)
        .execution_options(synchronize_session=False)
    )
    for _attempt in range(2):
        value = session.execute(bump).scalar_one_or_none()
        if value is not None:
            return int(value)
        try:
            with session.begin_nested():  # another replica may insert the row first
                session.execute(
                    insert(AnnouncementSequence).values(
                        fleet=fleet, last_sequence=now_ms, updated_at=datetime.now(UTC)
                    )
                )
            return now_ms
        except IntegrityError:
            continue
    raise ConflictError(f"cannot allocate an announcement sequence for fleet {fleet}")


def _greatest(column: Any, value: int) -> Any:
    """SQL ``max(column, value)`` that SQLite and PostgreSQL both run."""
    bound = literal(value, type_=BigInteger())
    return case((column > bound, column), else_=bound)


def signed_announcement(
    *,
    session: Session,
    key: FleetSigningKey,
    record: ModelVersion,
    fleet: str,
    agent: str | None = None,
    ttl: timedelta = DEFAULT_ANNOUNCEMENT_TTL,
    now: datetime | None = None,
) -> bytes:
    """The announcement bytes of ``record`` for a fleet (or one agent), freshly sequenced."""
    now = now or datetime.now(UTC)
    try:
        manifest = ModelManifest.model_validate(
            {
                **record.manifest,
                "sequence": next_sequence(session=session, fleet=fleet, now=now),
                "expires_at": (now + ttl).isoformat(),
                "fleet": fleet,
                "agent": agent,
            }
        )
    except ValidationError as exc:
        raise ConflictError(
            f"{record.name} {record.version} has no valid manifest to announce"
            f" ({exc.error_count()} problem(s)); register the model again",
            reason="invalid_manifest",
        ) from exc
    return encode_message(sign_manifest(manifest, key))


def refresh_announcements(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    key: FleetSigningKey,
    ttl: timedelta = DEFAULT_ANNOUNCEMENT_TTL,
    now: datetime | None = None,
) -> list[str]:
    """Sign again the retained announcements older than half ``ttl``; return their topics."""
    now = now or datetime.now(UTC)
    stale = now - ttl / 2
    refreshed: list[str] = []
    for current in session.scalars(select(FleetModel).where(FleetModel.updated_at < stale)):
        record = get_version(session=session, name=current.model_name, version=current.version)
        if record.state == "deleted":
            continue
        raw = signed_announcement(
            session=session, key=key, record=record, fleet=current.fleet, ttl=ttl, now=now
        )
        current.updated_at = now
        session.flush()
        topic = topics.fleet_models(current.fleet)
        announcer.announce(topic, raw)
        refreshed.append(topic)
    for override in session.scalars(select(AgentOverride).where(AgentOverride.created_at < stale)):
        record = get_version(session=session, name=override.model_name, version=override.version)
        if record.state == "deleted":
            continue
        raw = signed_announcement(
            session=session,
            key=key,
            record=record,
            fleet=override.fleet,
            agent=override.agent_id,
            ttl=ttl,
            now=now,
        )
        override.created_at = now
        session.flush()
        topic = topics.agent_models(override.fleet, override.agent_id)
        announcer.announce(topic, raw)
        refreshed.append(topic)
    return refreshed


def clear_overrides(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    fleet: str,
    agents: Sequence[str] | None = None,
    kind: str | None = None,
) -> list[str]:
    """Withdraw per-agent announcements (all of the fleet's, or these agents'); return ids."""
    stmt = select(AgentOverride).where(AgentOverride.fleet == fleet)
    if agents is not None:
        stmt = stmt.where(AgentOverride.agent_id.in_(list(agents)))
    if kind is not None:
        stmt = stmt.where(AgentOverride.kind == kind)
    cleared = [o.agent_id for o in session.scalars(stmt).all()]
    if cleared:
        session.execute(delete(AgentOverride).where(AgentOverride.agent_id.in_(cleared)))
    for agent in cleared:
        announcer.announce(topics.agent_models(fleet, agent), b"")
    return cleared


def set_overrides(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    fleet: str,
    record: ModelVersion,
    agents: Sequence[str],
    kind: str,
    key: FleetSigningKey,
    rollout_id: int | None = None,
    ttl: timedelta = DEFAULT_ANNOUNCEMENT_TTL,
) -> None:
    """Point these agents at ``record`` with a per-agent retained announcement."""
    _servable(record)
    _check_agents(session, record, agents=agents)
    for agent in agents:
        validate_id(agent, "agent")
        override = session.get(AgentOverride, agent)
        if override is None:
            override = AgentOverride(agent_id=agent, fleet=fleet, model_name=record.name)
            session.add(override)
        override.fleet = fleet
        override.model_name = record.name
        override.version = record.version
        override.kind = kind
        override.rollout_id = rollout_id
        override.created_at = datetime.now(UTC)
        session.flush()
        raw = signed_announcement(
            session=session, key=key, record=record, fleet=fleet, agent=agent, ttl=ttl
        )
        announcer.announce(topics.agent_models(fleet, agent), raw)


def promote(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    fleet: str,
    name: str,
    version: str,
    key: FleetSigningKey,
    clear_canaries: bool = True,
    ttl: timedelta = DEFAULT_ANNOUNCEMENT_TTL,
) -> FleetModel:
    """Make ``version`` the fleet's retained announcement; canary overrides are withdrawn."""
    validate_id(fleet, "fleet")
    record = get_version(session=session, name=name, version=version)
    _servable(record)
    _check_agents(session, record, fleet=fleet)
    current = session.get(FleetModel, fleet)
    if current is None:
        current = FleetModel(fleet=fleet, model_name=name, version=version, history=[])
        session.add(current)
    elif current.version != version or current.model_name != name:
        current.history = [*current.history, current.version][-20:]
        current.model_name, current.version = name, version
    current.updated_at = datetime.now(UTC)
    record.state = "serving"
    session.flush()
    raw = signed_announcement(session=session, key=key, record=record, fleet=fleet, ttl=ttl)
    announcer.announce(topics.fleet_models(fleet), raw)
    if clear_canaries:
        clear_overrides(
            session=session, announcer=announcer, topics=topics, fleet=fleet, kind="canary"
        )
    return current


def rollback(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    fleet: str,
    name: str,
    key: FleetSigningKey,
    ttl: timedelta = DEFAULT_ANNOUNCEMENT_TTL,
) -> FleetModel:
    """Announce the version the fleet served before the current one (a newer announcement)."""
    current = session.get(FleetModel, fleet)
    if current is None or current.model_name != name or not current.history:
        raise ConflictError(f"fleet {fleet} has no earlier version of {name} to roll back to")
    previous = current.history[-1]
    record = get_version(session=session, name=name, version=previous)
    _servable(record)
    current.history = current.history[:-1]
    current.version = previous
    current.updated_at = datetime.now(UTC)
    session.flush()
    raw = signed_announcement(session=session, key=key, record=record, fleet=fleet, ttl=ttl)
    announcer.announce(topics.fleet_models(fleet), raw)
    return current


def pin(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    fleet: str,
    name: str,
    version: str,
    agents: Sequence[str],
    key: FleetSigningKey,
    ttl: timedelta = DEFAULT_ANNOUNCEMENT_TTL,
) -> None:
    """Hold these agents on ``version`` whatever the fleet is announced."""
    if not agents:
        raise ContractError("name at least one agent to pin")
    record = get_version(session=session, name=name, version=version)
    set_overrides(
        session=session,
        announcer=announcer,
        topics=topics,
        fleet=fleet,
        record=record,
        agents=agents,
        kind="pin",
        key=key,
        ttl=ttl,
    )


def unpin(
    *, session: Session, announcer: Announcer, topics: Topics, fleet: str, agents: Sequence[str]
) -> list[str]:
    return clear_overrides(
        session=session, announcer=announcer, topics=topics, fleet=fleet, agents=agents, kind="pin"
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


@dataclass(frozen=True)
class AgentInstall:
    """Where one agent stands with one version, from its model-status reports."""

    agent_id: str
    fleet: str
    state: str  # installed | refused | installing | replaced | pending
    reason: str | None
    at: datetime | None


@dataclass(frozen=True)
class InstallSummary:
    """Per-agent install state of a version, and the state to show for it."""

    installs: list[AgentInstall]
    state: str  # the registry's state, but "refused" / "partly refused" while agents refuse it

    def count(self, state: str) -> int:
        return sum(1 for item in self.installs if item.state == state)


_STEP_STATE = {
    "active": "installed",
    "rolled-back": "installed",  # reported for the version rolled back to
    "rejected": "refused",
    "downloaded": "installing",
    "verified": "installing",
}


def install_summary(*, session: Session, record: ModelVersion) -> InstallSummary:
    """Which agents installed ``record``, refused it (with the reason) or have yet to answer.

    The agents meant to run it are those of the fleets announcing it (less those held on
    another version by an override) and those an override points at it; any other agent
    that reported on it is listed too.
    """
    name, version = record.name, record.version
    fleets = set(
        session.scalars(
            select(FleetModel.fleet).where(
                FleetModel.model_name == name, FleetModel.version == version
            )
        )
    )
    overrides = list(session.scalars(select(AgentOverride)))
    targeted: dict[str, str] = {}
    if fleets:
        for agent_id, fleet in session.execute(
            select(Agent.agent_id, Agent.fleet).where(Agent.fleet.in_(fleets))
        ):
            targeted[agent_id] = fleet
    for override in overrides:
        if (override.model_name, override.version) == (name, version):
            targeted[override.agent_id] = override.fleet
        else:
            targeted.pop(override.agent_id, None)
    latest: dict[str, ModelStatusEvent] = {}
    events = session.scalars(
        select(ModelStatusEvent)
        .where(ModelStatusEvent.model_name == name, ModelStatusEvent.model_version == version)
        .order_by(ModelStatusEvent.id)
    )
    for step in events:
        latest[step.agent_id] = step  # the last step each agent reported wins
    agents = {
        a.agent_id: a
        for a in session.scalars(
            select(Agent).where(Agent.agent_id.in_(set(targeted) | set(latest)))
        )
    }
    installs: list[AgentInstall] = []
    for agent_id in sorted(set(targeted) | set(latest)):
        agent = agents.get(agent_id)
        serves = agent is not None and agent.model_version == version
        event = latest.get(agent_id)
        fleet = targeted.get(agent_id) or (event.fleet if event else agent.fleet if agent else "")
        if event is None:
            state = "installed" if serves else "pending"
            installs.append(AgentInstall(agent_id, fleet, state, None, None))
            continue
        state = _STEP_STATE.get(event.state, event.state)
        if (
            state == "installed"
            and agent is not None
            and agent.model_version not in (None, version)
        ):
            state = "replaced"  # rolled back from it, or moved on to another version
        reason = event.reason if state == "refused" else None
        installs.append(AgentInstall(agent_id, fleet, state, reason, event.at))
    summary = InstallSummary(installs=installs, state=record.state)
    refused, installed = summary.count("refused"), summary.count("installed")
    if refused and not installed:
        shown = "refused"
    elif refused:
        shown = "partly refused"
    else:
        shown = record.state
    return InstallSummary(installs=installs, state=shown)
