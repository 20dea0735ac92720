"""SQLAlchemy 2 models of the cloud store; the Alembic migrations create exactly these.

The same models run on SQLite and PostgreSQL: JSON columns, timezone-aware
timestamps stored as UTC (SQLite keeps no zone, so ``UtcDateTime`` adds it back),
and string primary keys for the ids the edge makes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "SAMPLE_STATUSES",
    "Agent",
    "AgentOverride",
    "Base",
    "DeadLetter",
    "EnrollmentToken",
    "FleetModel",
    "Label",
    "ModelStatusEvent",
    "ModelVersion",
    "Rollout",
    "RolloutEvent",
    "Sample",
    "SampleStatus",
    "User",
    "UtcDateTime",
    "Verdict",
]

SampleStatus = Literal["pending", "verified", "flagged", "reviewed", "discarded"]
SAMPLE_STATUSES: tuple[str, ...] = ("pending", "verified", "flagged", "reviewed", "discarded")


class UtcDateTime(TypeDecorator[datetime]):
    """A timestamp stored as UTC and always read back timezone-aware."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(UTC)
        # SQLite stores text; keep it naive there so comparisons sort as text.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UtcDateTime, dict[str, Any]: JSON, list[Any]: JSON}


class Agent(Base):
    """An edge agent: enrolled through the API or first seen on its status topic."""

    __tablename__ = "agents"

    agent_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    fleet: Mapped[str] = mapped_column(String(64), index=True)
    state: Mapped[str] = mapped_column(String(16), default="unknown")
    last_seen_at: Mapped[datetime | None] = mapped_column(nullable=True)
    model_version: Mapped[str | None] = mapped_column(String(128), nullable=True)
    telemetry: Mapped[dict[str, Any]] = mapped_column(default=dict)
    model_status: Mapped[dict[str, Any] | None] = mapped_column(nullable=True)
    api_token_hash: Mapped[str | None] = mapped_column(String(64), nullable=True, unique=True)
    enrolled_at: Mapped[datetime | None] = mapped_column(nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class EnrollmentToken(Base):
    """A one-time enrollment token; only its sha256 is kept."""

    __tablename__ = "enrollment_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    fleet: Mapped[str] = mapped_column(String(64))
    agent_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    expires_at: Mapped[datetime] = mapped_column()
    used_at: Mapped[datetime | None] = mapped_column(nullable=True)
    used_by: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Sample(Base):
    """One forwarded sample: what the edge said about it, and where its image is."""

    __tablename__ = "samples"
    __table_args__ = (
        Index("ix_samples_agent_captured", "agent_id", "captured_at"),
        Index("ix_samples_status_received", "status", "received_at"),
        # The review queue (migration 0003_review_users): status first, newest first.
        Index("ix_samples_status_captured", "status", "captured_at", "sample_id"),
    )

    # The cloud's id: the agent's own unless another agent's sample already held it
    # (then derived from fleet, agent and the agent's id; migration 0006).
    sample_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    # The id the agent gave it (receipts and verdicts go back with it); NULL on rows
    # stored before 0006 backfilled it means the same as sample_id.
    edge_sample_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    fleet: Mapped[str] = mapped_column(String(64), index=True)
    agent_id: Mapped[str] = mapped_column(String(64))
    captured_at: Mapped[datetime] = mapped_column()
    received_at: Mapped[datetime] = mapped_column(default=utcnow)
    model_name: Mapped[str] = mapped_column(String(128))
    model_version: Mapped[str] = mapped_column(String(128))
    edge_scores: Mapped[list[Any]] = mapped_column()
    edge_predicted: Mapped[int] = mapped_column(Integer)
    edge_confidence: Mapped[float] = mapped_column(Float)
    # A detector's answer (shared.tasks.detection), NULL for a classifier's (0008).
    edge_boxes: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    route_reason: Mapped[str] = mapped_column(String(32))
    priority: Mapped[int] = mapped_column(Integer, default=5)
    image_key: Mapped[str] = mapped_column(String(512))
    image_format: Mapped[str] = mapped_column(String(8))
    image_width: Mapped[int] = mapped_column(Integer)
    image_height: Mapped[int] = mapped_column(Integer)
    image_bytes: Mapped[int] = mapped_column(Integer)
    meta: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    verified_at: Mapped[datetime | None] = mapped_column(nullable=True)


class Verdict(Base):
    """The teacher's answer for a sample: exactly one per sample (unique sample_id)."""

    __tablename__ = "verdicts"

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    sample_id: Mapped[str] = mapped_column(
        String(36), ForeignKey("samples.sample_id", ondelete="CASCADE"), unique=True
    )
    teacher_model: Mapped[str] = mapped_column(String(128))
    teacher_version: Mapped[str] = mapped_column(String(128))
    scores: Mapped[list[Any]] = mapped_column()
    label: Mapped[int] = mapped_column(Integer)
    confidence: Mapped[float] = mapped_column(Float)
    boxes: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)  # a detector's (0008)
    agrees_with_edge: Mapped[bool] = mapped_column(Boolean)
    review: Mapped[bool] = mapped_column(Boolean, default=False)
    review_reasons: Mapped[list[Any]] = mapped_column(default=list)
    verified_at: Mapped[datetime] = mapped_column()
    latency_s: Mapped[float | None] = mapped_column(Float, nullable=True)


class Label(Base):
    """A human's label for a sample (the latest one wins for training)."""

    __tablename__ = "labels"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sample_id: Mapped[str] = mapped_column(
        String(36), ForeignKey("samples.sample_id", ondelete="CASCADE"), index=True
    )
    label: Mapped[int] = mapped_column(Integer)
    # A detection label: the frame's boxes as a human confirmed or drew them (0008);
    # ``label`` is then the class of the first box, or 0 for an empty frame.
    boxes: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    labeled_by: Mapped[str] = mapped_column(String(128))
    note: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class DeadLetter(Base):
    """A message refused at ingest, kept with its reason for inspection."""

    __tablename__ = "dead_letters"

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    received_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    topic: Mapped[str] = mapped_column(String(1024))
    reason: Mapped[str] = mapped_column(String(64), index=True)
    message: Mapped[str] = mapped_column(Text)
    fleet: Mapped[str | None] = mapped_column(String(64), nullable=True)
    agent_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    sample_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    payload_size: Mapped[int] = mapped_column(Integer)


# --- model registry and rollouts (migration 0002_model_registry) -------------------


class ModelVersion(Base):
    """One registered model version: immutable artifact, signed manifest, metrics, lineage."""

    __tablename__ = "model_versions"
    __table_args__ = (Index("ux_model_versions_name_version", "name", "version", unique=True),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(64))
    format: Mapped[str] = mapped_column(String(8))
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    artifact_key: Mapped[str] = mapped_column(String(512))
    manifest: Mapped[dict[str, Any]] = mapped_column()
    # The signed announcement exactly as published: re-encoding may not verify.
    announcement: Mapped[bytes] = mapped_column(LargeBinary)
    key_id: Mapped[str] = mapped_column(String(64))
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    parent_version: Mapped[str | None] = mapped_column(String(64), nullable=True)
    source: Mapped[str | None] = mapped_column(String(256), nullable=True)
    # registered -> (serving) -> retired; "deleted" once retention removed the artifact.
    state: Mapped[str] = mapped_column(String(16), default="registered")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class FleetModel(Base):
    """What a fleet serves: the version on its retained announcement, and the ones before."""

    __tablename__ = "fleet_models"

    fleet: Mapped[str] = mapped_column(String(64), primary_key=True)
    model_name: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(64))
    history: Mapped[list[Any]] = mapped_column(default=list)  # earlier versions, oldest first
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class AgentOverride(Base):
    """A per-agent retained announcement: a canary cohort member or a pin."""

    __tablename__ = "agent_overrides"

    agent_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    fleet: Mapped[str] = mapped_column(String(64), index=True)
    model_name: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))  # "canary" or "pin"
    rollout_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class AnnouncementSequence(Base):
    """The last model-announcement sequence a fleet used (they only grow; see registry)."""

    __tablename__ = "announcement_sequences"

    fleet: Mapped[str] = mapped_column(String(64), primary_key=True)
    last_sequence: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class Rollout(Base):
    """A canary rollout of one version to a cohort, watched over a window."""

    __tablename__ = "rollouts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    fleet: Mapped[str] = mapped_column(String(64), index=True)
    model_name: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(64))
    baseline_version: Mapped[str | None] = mapped_column(String(64), nullable=True)
    cohort: Mapped[list[Any]] = mapped_column(default=list)
    percent: Mapped[float | None] = mapped_column(Float, nullable=True)
    criteria: Mapped[dict[str, Any]] = mapped_column(default=dict)
    state: Mapped[str] = mapped_column(String(16), default="running")  # running/promoted/aborted
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    evaluation: Mapped[dict[str, Any]] = mapped_column(default=dict)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    window_ends_at: Mapped[datetime] = mapped_column()
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)


class RolloutEvent(Base):
    """One step of a rollout's history (created, evaluated, promoted, aborted)."""

    __tablename__ = "rollout_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    rollout_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("rollouts.id", ondelete="CASCADE"), index=True
    )
    at: Mapped[datetime] = mapped_column(default=utcnow)
    kind: Mapped[str] = mapped_column(String(32))
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)


class ModelStatusEvent(Base):
    """Every model-status step an agent reported (the agents row keeps only the latest)."""

    __tablename__ = "model_status_events"
    __table_args__ = (Index("ix_model_status_events_agent_at", "agent_id", "at"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    fleet: Mapped[str] = mapped_column(String(64))
    agent_id: Mapped[str] = mapped_column(String(64))
    model_name: Mapped[str] = mapped_column(String(128))
    model_version: Mapped[str] = mapped_column(String(128))
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    at: Mapped[datetime] = mapped_column()


# --- review UI users (migration 0003_review_users) ----------------------------------

USER_ROLES: tuple[str, ...] = ("admin", "reviewer")


class User(Base):
    """A person who signs in to the review UI; ``role`` is "admin" or "reviewer"."""

    __tablename__ = "users"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    username: Mapped[str] = mapped_column(String(64), unique=True)
    password_hash: Mapped[str] = mapped_column(String(256))
    role: Mapped[str] = mapped_column(String(16), default="reviewer")
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    # Bumped on every password change: sessions signed before it stop working.
    session_generation: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_login_at: Mapped[datetime | None] = mapped_column(nullable=True)
