"""The review UI's users: create, set a password, look up, authenticate."""

from __future__ import annotations

import re
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from cloud_service.db.models import USER_ROLES, User
from cloud_service.errors import ConflictError, NotFoundError
from cloud_service.passwords import MIN_PASSWORD_LENGTH, hash_password, verify_password
from shared.errors import ContractError

__all__ = ["authenticate_user", "create_user", "get_user", "list_users", "set_password"]


_USERNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")


def _check_password(password: str) -> None:
    if len(password) < MIN_PASSWORD_LENGTH:
        raise ContractError(
            f"a password needs at least {MIN_PASSWORD_LENGTH} characters", reason="weak_password"
        )


def create_user(*, session: Session, username: str, password: str, role: str) -> User:
    """Add a review UI user; the username is unique, the role "admin" or "reviewer"."""
    if not _USERNAME.match(username):
        raise ContractError(
            f"username {username!r} is not valid: letters, digits and _.@- (at most 64)",
            reason="invalid_username",
        )
    if role not in USER_ROLES:
        raise ContractError(
            f"role {role!r} is not one of {list(USER_ROLES)}", reason="invalid_role"
        )
    _check_password(password)
    if session.scalars(select(User).where(User.username == username)).first() is not None:
        raise ConflictError(f"user {username} already exists")
    user = User(
        username=username,
        password_hash=hash_password(password),
        role=role,
        disabled=False,
        session_generation=0,
    )
    session.add(user)
    session.flush()
    return user


def set_password(*, session: Session, username: str, password: str) -> User:
    """Change a user's password; sessions signed before the change stop working."""
    user = session.scalars(select(User).where(User.username == username)).first()
    if user is None:
        raise NotFoundError(f"user {username} does not exist")
    _check_password(password)
    user.password_hash = hash_password(password)
    user.session_generation += 1
    return user


def list_users(*, session: Session) -> list[User]:
    return list(session.scalars(select(User).order_by(User.username)).all())


def get_user(*, session: Session, user_id: int) -> User | None:
    return session.get(User, user_id)


def authenticate_user(*, session: Session, username: str, password: str) -> User | None:
    """The enabled user with this username and password, else None."""
    user = session.scalars(select(User).where(User.username == username)).first()
    if user is None:
        hash_password(password)  # spend the same time, so timing does not reveal names
        return None
    if user.disabled or not verify_password(password, user.password_hash):
        return None
    user.last_login_at = datetime.now(UTC)
    return user
