"""Signing in and out of the review UI, and its users (admin)."""

from __future__ import annotations

import hmac
import secrets
from typing import Annotated
from urllib.parse import quote, urlsplit

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from cloud_service.db import crud
from cloud_service.ui.auth import LOGIN_CSRF_COOKIE, SESSION_COOKIE
from cloud_service.ui.deps import AdminUserDep, CsrfDep, SignerDep, UserDep
from cloud_service.ui.routes.pages import render_page
from cloud_service.web.deps import SessionDep, StateDep
from shared.errors import EdgeLoopError

__all__ = ["router"]

router = APIRouter(prefix="/ui", include_in_schema=False)


def _safe_next(target: str | None) -> str:
    """Only a path on this site (no scheme, no host) may follow a login."""
    if not target or not target.startswith("/") or target.startswith("//"):
        return "/ui/queue"
    parts = urlsplit(target)
    return target if not parts.scheme and not parts.netloc else "/ui/queue"


# --- login -------------------------------------------------------------------


@router.get("/login")
def login_page(request: Request, next: str | None = None, error: str | None = None) -> HTMLResponse:
    token = secrets.token_urlsafe(24)
    response = render_page(
        request, "login.html", None, next=_safe_next(next), error=error, login_csrf=token
    )
    response.set_cookie(
        LOGIN_CSRF_COOKIE, token, httponly=True, samesite="strict", path="/ui/login", max_age=3600
    )
    return response


@router.post("/login")
def login(
    request: Request,
    state: StateDep,
    signer: SignerDep,
    username: Annotated[str, Form(max_length=64)],
    password: Annotated[str, Form(max_length=256)],
    csrf_token: Annotated[str, Form(max_length=128)] = "",
    next: Annotated[str, Form(max_length=2048)] = "/ui/queue",
) -> Response:
    cookie = request.cookies.get(LOGIN_CSRF_COOKIE, "")
    if not cookie or not hmac.compare_digest(cookie, csrf_token):
        return render_page(
            request,
            "login.html",
            None,
            status_code=403,
            next=_safe_next(next),
            error="The login form expired; try again.",
            login_csrf=cookie or "",
        )
    with state.sessions.begin() as session:
        user = crud.authenticate_user(session=session, username=username, password=password)
        ident = (user.id, user.session_generation) if user else None
    if ident is None:
        token = secrets.token_urlsafe(24)
        response = render_page(
            request,
            "login.html",
            None,
            status_code=401,
            next=_safe_next(next),
            error="Unknown user or wrong password.",
            login_csrf=token,
        )
        response.set_cookie(
            LOGIN_CSRF_COOKIE,
            token,
            httponly=True,
            samesite="strict",
            path="/ui/login",
            max_age=3600,
        )
        return response
    redirect = RedirectResponse(_safe_next(next), status_code=303)
    redirect.set_cookie(
        SESSION_COOKIE,
        signer.sign(user_id=ident[0], generation=ident[1]),
        max_age=int(signer.ttl_s),
        httponly=True,
        samesite="lax",
        secure=request.url.scheme == "https",
        path="/",
    )
    redirect.delete_cookie(LOGIN_CSRF_COOKIE, path="/ui/login")
    return redirect


@router.post("/logout")
def logout(user: CsrfDep, state: StateDep) -> Response:
    """End the session server-side: bumping the user's session generation makes every cookie
    signed before now (this one, one copied from it, the user's other browsers) invalid."""
    with state.sessions.begin() as session:
        record = crud.get_user(session=session, user_id=user.id)
        if record is not None:
            record.session_generation += 1
    redirect = RedirectResponse("/ui/login", status_code=303)
    redirect.delete_cookie(SESSION_COOKIE, path="/")
    return redirect


@router.get("")
@router.get("/")
def home(_user: UserDep) -> Response:
    return RedirectResponse("/ui/queue", status_code=303)


# --- users (admin) ---------------------------------------------------------------


@router.get("/users")
def users_page(request: Request, session: SessionDep, user: AdminUserDep) -> HTMLResponse:
    return render_page(request, "users.html", user, users=crud.list_users(session=session))


@router.post("/users")
def add_user(
    session: SessionDep,
    _admin: AdminUserDep,
    _csrf: CsrfDep,
    username: Annotated[str, Form(max_length=64)],
    password: Annotated[str, Form(max_length=256)],
    role: Annotated[str, Form(max_length=16)] = "reviewer",
) -> Response:
    try:
        crud.create_user(session=session, username=username, password=password, role=role)
        notice = f"user {username} added"
    except EdgeLoopError as exc:
        notice = exc.message
    return RedirectResponse(f"/ui/users?notice={quote(notice)}", status_code=303)
