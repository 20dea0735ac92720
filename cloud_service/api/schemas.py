"""Request and response bodies of the REST API (what OpenAPI shows)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, TypeVar

from fastapi import Path
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from shared.errors import EdgeLoopError
from shared.topics import validate_id


def _id(kind: str) -> Any:
    def check(value: str) -> str:
        try:
            return validate_id(value, kind)
        except EdgeLoopError as exc:
            raise ValueError(exc.message) from None

    return AfterValidator(check)


T = TypeVar("T")

FleetId = Annotated[str, _id("fleet")]
AgentId = Annotated[str, _id("agent")]

MAX_ROW_ID = 2**31 - 1
"""The largest id of a jobs, schedules or rollouts row (INTEGER: 32 bits on PostgreSQL)."""
RowIdPath = Annotated[int, Path(ge=0, le=MAX_ROW_ID, description="a row id")]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenCreate(Body):
    fleet: FleetId
    agent_id: AgentId | None = None
    ttl_s: int = Field(default=86400, ge=60, le=30 * 86400)


class TokenOut(BaseModel):
    token: str
    expires_at: datetime
    fleet: str
    agent_id: str | None


class EnrollIn(Body):
    token: str = Field(min_length=8, max_length=256)
    agent_id: AgentId | None = None


class EnrollOut(BaseModel):
    agent_id: str
    fleet: str
    mqtt_url: str
    mqtt_username: str | None
    mqtt_password: str | None
    topic_prefix: str
    fleet_public_key: str
    key_id: str
    api_token: str
    # PEM of the CA that signed the broker's certificate, for mqtts:// (None: system CAs).
    mqtt_ca_pem: str | None = None


class AgentOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    agent_id: str
    fleet: str
    state: str
    last_seen_at: datetime | None
    model_version: str | None
    telemetry: dict[str, Any]
    model_status: dict[str, Any] | None
    enrolled_at: datetime | None


class VerdictOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    sample_id: str
    teacher_model: str
    teacher_version: str
    scores: list[float]
    label: int
    confidence: float
    agrees_with_edge: bool
    review: bool
    review_reasons: list[str]
    verified_at: datetime
    latency_s: float | None


class LabelIn(Body):
    label: int = Field(ge=0, le=100_000)
    labeled_by: str = Field(min_length=1, max_length=128)
    note: str | None = Field(default=None, max_length=4000)


class LabelOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    sample_id: str
    label: int
    labeled_by: str
    note: str | None
    created_at: datetime


class SampleOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    sample_id: str
    fleet: str
    agent_id: str
    captured_at: datetime
    received_at: datetime
    model_name: str
    model_version: str
    edge_scores: list[float]
    edge_predicted: int
    edge_confidence: float
    route_reason: str
    priority: int
    image_format: str
    image_width: int
    image_height: int
    image_bytes: int
    meta: dict[str, str]
    status: str
    verified_at: datetime | None


class SampleDetail(SampleOut):
    verdict: VerdictOut | None
    labels: list[LabelOut]


class DeadLetterOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    received_at: datetime
    topic: str
    reason: str
    message: str
    fleet: str | None
    agent_id: str | None
    payload_size: int


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int
    limit: int
    offset: int
