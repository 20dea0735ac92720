"""Enrollment: admins make one-time tokens; agents exchange one for their identity."""

from __future__ import annotations

import logging

from fastapi import APIRouter, status

from cloud_service.api.schemas import EnrollIn, EnrollOut, TokenCreate, TokenOut
from cloud_service.db import crud
from cloud_service.web.deps import AdminDep, SessionDep, SettingsDep, StateDep

router = APIRouter(prefix="/v1", tags=["enrollment"])
log = logging.getLogger(__name__)


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
    key = state.signing_key
    # Never the cloud's own broker credentials: those may read and write every topic.
    username: str | None = None
    password: str | None = None
    if settings.broker_auth:
        # Each agent its own broker user, whose ACL confines it to its own topics.
        # Written before the response: a failure here rolls the enrollment back.
        from cloud_service.brokerconf import add_agent, agent_files

        files = agent_files(settings.resolved_broker_config_dir)
        username, password = add_agent(files, agent.fleet, agent.agent_id, settings.topics)
    else:
        log.warning(
            "enrolled %s.%s WITHOUT broker credentials: broker_auth is off, so agents reach "
            "the broker anonymously (development only; set EDGELOOP_BROKER_AUTH=true)",
            agent.fleet,
            agent.agent_id,
        )
    return EnrollOut(
        agent_id=agent.agent_id,
        fleet=agent.fleet,
        mqtt_url=settings.resolved_agent_mqtt_url,
        # None without broker_auth: the agent connects anonymously (development only).
        mqtt_username=username,
        mqtt_password=password,
        topic_prefix=settings.topic_prefix,
        fleet_public_key=key.public_key_b64,
        key_id=key.key_id,
        api_token=api_token,
        mqtt_ca_pem=settings.mqtt_ca_file.read_text() if settings.mqtt_ca_file else None,
    )
