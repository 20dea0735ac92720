"""Enrollment: admins make one-time tokens; agents exchange one for their identity."""

from __future__ import annotations

from fastapi import APIRouter, status

from cloud_service.api.deps import AdminDep, SessionDep, SettingsDep, StateDep
from cloud_service.api.schemas import EnrollIn, EnrollOut, TokenCreate, TokenOut
from cloud_service.db import crud

router = APIRouter(prefix="/v1", tags=["enrollment"])


@router.post("/enrollment-tokens", status_code=status.HTTP_201_CREATED)
def create_token(body: TokenCreate, session: SessionDep, _admin: AdminDep) -> TokenOut:
    """A one-time token that enrolls one agent of ``fleet`` (shown once, stored hashed)."""
    token, expires_at = crud.create_enrollment_token(
        session=session, fleet=body.fleet, agent_id=body.agent_id, ttl_s=body.ttl_s
    )
    return TokenOut(token=token, expires_at=expires_at, fleet=body.fleet, agent_id=body.agent_id)


@router.post("/enroll")
def enroll(
    body: EnrollIn, session: SessionDep, settings: SettingsDep, state: StateDep
) -> EnrollOut:
    """Spend a token: the agent's id, fleet, broker, topic prefix, fleet key and API token."""
    agent, api_token = crud.enroll_agent(session=session, token=body.token, agent_id=body.agent_id)
    target = settings.mqtt
    key = state.signing_key
    return EnrollOut(
        agent_id=agent.agent_id,
        fleet=agent.fleet,
        mqtt_url=settings.resolved_agent_mqtt_url,
        # Per-agent broker credentials come with broker ACLs (a later issue); until
        # then agents get the connection's own (None on an anonymous broker).
        mqtt_username=target.username,
        mqtt_password=target.password,
        topic_prefix=settings.topic_prefix,
        fleet_public_key=key.public_key_b64,
        key_id=key.key_id,
        api_token=api_token,
    )
