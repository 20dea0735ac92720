"""The API's dependencies as Annotated aliases (``SessionDep``, ``AdminDep``, ...)."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from cloud_service.announce import Announcer
from cloud_service.blobs import BlobStore
from cloud_service.db import crud
from cloud_service.errors import AuthError
from cloud_service.metrics import CloudMetrics
from cloud_service.settings import CloudSettings
from cloud_service.web.state import ApiState

__all__ = [
    "AdminDep",
    "AgentOrAdminDep",
    "AnnouncerDep",
    "BlobsDep",
    "MetricsDep",
    "SessionDep",
    "SettingsDep",
    "StateDep",
    "bearer_principal",
]

_bearer = HTTPBearer(auto_error=False, description="the admin token (settings: admin_token)")


def get_state(request: Request) -> ApiState:
    state: ApiState = request.app.state.edgeloop
    return state


StateDep = Annotated[ApiState, Depends(get_state)]


def get_settings(state: StateDep) -> CloudSettings:
    return state.settings


def get_session(state: StateDep) -> Iterator[Session]:
    """One session per request, committed when the route returns without error.

    Used with ``scope="function"``: the commit happens before the response is sent,
    so a 2xx means the write is durable (a crash or a failed commit after the answer
    would otherwise lose an acknowledged write).
    """
    with state.sessions.begin() as session:
        yield session


def get_blobs(state: StateDep) -> BlobStore:
    return state.blobs


def get_metrics(state: StateDep) -> CloudMetrics:
    return state.metrics


def require_admin(
    settings: Annotated[CloudSettings, Depends(get_settings)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    if credentials is None:
        raise AuthError("this endpoint needs the admin token: send 'Authorization: Bearer <token>'")
    expected = settings.admin_token.get_secret_value().encode()
    if not hmac.compare_digest(credentials.credentials.encode(), expected):
        raise AuthError("the bearer token is not the admin token")


def bearer_principal(state: ApiState, token: str) -> str | None:
    """The principal a bearer token authenticates: "admin", "agent:<fleet>/<id>", else None."""
    expected = state.settings.admin_token.get_secret_value().encode()
    if hmac.compare_digest(token.encode(), expected):
        return "admin"
    with state.sessions() as session:
        agent = crud.agent_for_api_token(session=session, token=token)
        return None if agent is None else f"agent:{agent.fleet}/{agent.agent_id}"


def require_agent_or_admin(
    state: StateDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """An enrolled agent's API token or the admin token; returns the agent id or "admin"."""
    if credentials is None:
        raise AuthError(
            "send 'Authorization: Bearer <token>': the agent's API token or the admin's"
        )
    token = credentials.credentials
    expected = state.settings.admin_token.get_secret_value().encode()
    if hmac.compare_digest(token.encode(), expected):
        return "admin"
    with state.sessions() as session:
        agent = crud.agent_for_api_token(session=session, token=token)
    if agent is None:
        raise AuthError("the bearer token is neither an enrolled agent's API token nor the admin's")
    return agent.agent_id


def get_announcer(state: StateDep) -> Announcer:
    return state.get_announcer()


SettingsDep = Annotated[CloudSettings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
BlobsDep = Annotated[BlobStore, Depends(get_blobs)]
MetricsDep = Annotated[CloudMetrics, Depends(get_metrics)]
AdminDep = Annotated[None, Depends(require_admin)]
AgentOrAdminDep = Annotated[str, Depends(require_agent_or_admin)]
AnnouncerDep = Annotated[Announcer, Depends(get_announcer)]
