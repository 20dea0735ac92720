"""The review UI's dependencies as Annotated aliases (``UserDep``, ``AdminUserDep``, ``CsrfDep``).

A page request without a valid session is redirected to the login page; a fetch
(``/ui/api/...``) gets 401 JSON, and the page's script sends the reviewer there.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from cloud_service.db import crud
from cloud_service.db.models import User
from cloud_service.ui.auth import SESSION_COOKIE, SessionSigner
from cloud_service.web.deps import StateDep

__all__ = [
    "AdminUserDep",
    "CsrfDep",
    "LoginRequired",
    "NotAllowed",
    "SignerDep",
    "UiUser",
    "UserDep",
]


class LoginRequired(Exception):
    """No valid session: the login page (pages) or 401 (fetch)."""


class NotAllowed(Exception):
    """Signed in, but the role is not enough (403), or the CSRF token is wrong."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class UiUser:
    """The signed-in user, as the pages need it."""

    id: int
    username: str
    role: str
    csrf_token: str

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


def get_signer(request: Request, state: StateDep) -> SessionSigner:
    signer: SessionSigner | None = getattr(request.app.state, "ui_signer", None)
    if signer is None:
        signer = SessionSigner(state.settings.session_secret.get_secret_value())
        request.app.state.ui_signer = signer
    return signer


SignerDep = Annotated[SessionSigner, Depends(get_signer)]


def current_user(request: Request, state: StateDep, signer: SignerDep) -> UiUser:
    data = signer.load(request.cookies.get(SESSION_COOKIE))
    if data is None:
        raise LoginRequired
    with state.sessions() as session:
        user: User | None = crud.get_user(session=session, user_id=data.user_id)
        if user is None or user.disabled or user.session_generation != data.generation:
            raise LoginRequired
        found = UiUser(
            id=user.id,
            username=user.username,
            role=user.role,
            csrf_token=signer.csrf_token(data.nonce),
        )
    request.state.ui_user = found  # for the 403 page's navigation
    return found


UserDep = Annotated[UiUser, Depends(current_user)]


def admin_user(user: UserDep) -> UiUser:
    if not user.is_admin:
        raise NotAllowed(f"{user.username} is a {user.role}; this needs an admin")
    return user


AdminUserDep = Annotated[UiUser, Depends(admin_user)]


async def check_csrf(request: Request, user: UserDep) -> UiUser:
    """Refuse a state-changing request without this session's CSRF token."""
    token = request.headers.get("x-csrf-token")
    if token is None:
        content_type = request.headers.get("content-type", "")
        if content_type.startswith(("application/x-www-form-urlencoded", "multipart/form-data")):
            form = await request.form()
            value = form.get("csrf_token")
            token = value if isinstance(value, str) else None
    if not token or not hmac.compare_digest(token, user.csrf_token):
        raise NotAllowed("the form's CSRF token is missing or not this session's; reload the page")
    return user


CsrfDep = Annotated[UiUser, Depends(check_csrf)]
