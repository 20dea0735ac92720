"""Pages and fetch endpoints of the review UI, under /ui.

Thin routes: each checks its input, calls one function of ``cloud_service.ui.store``
(or crud, registry, rollout), and renders a template or returns JSON. Modules:
``accounts`` (login, logout, users), ``review`` (queue, review, bulk actions, export),
``fleet`` (agents, dashboard, models, rollouts); ``mount_ui`` adds them and the error pages.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from cloud_service.ui import jobs as ui_jobs
from cloud_service.ui.deps import LoginRequired, NotAllowed
from cloud_service.ui.routes import accounts, fleet, review
from cloud_service.ui.routes.pages import UI_DIR, render_page
from shared.errors import EdgeLoopError

__all__ = ["mount_ui", "router"]

router = APIRouter(include_in_schema=False)
router.include_router(accounts.router)
router.include_router(review.router)
router.include_router(fleet.router)


def _wants_json(request: Request) -> bool:
    return request.url.path.startswith("/ui/api/") or "application/json" in request.headers.get(
        "accept", ""
    )


async def _login_required(request: Request, exc: Exception) -> Response:
    if _wants_json(request):
        return JSONResponse(
            {"detail": "your session expired or you are not signed in", "reason": "login"},
            status_code=401,
        )
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    if request.method != "GET":
        target = "/ui/queue"
    return RedirectResponse(f"/ui/login?next={quote(target)}", status_code=303)


async def _not_allowed(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, NotAllowed)
    if _wants_json(request):
        return JSONResponse({"detail": exc.message, "reason": "forbidden"}, status_code=403)
    user = getattr(request.state, "ui_user", None)
    return render_page(
        request, "error.html", user, status_code=403, title="Not allowed", message=exc.message
    )


_ERROR_TITLES = {
    400: "Bad request",
    403: "Not allowed",
    404: "Not found",
    405: "Not allowed here",
    409: "Changed meanwhile",
    422: "Not valid",
}
ErrorHandler = Callable[[Request, Any], Response | Awaitable[Response]]


def _back_link(request: Request) -> str:
    """Where the error page's "back" goes without script: a form's own page, else the queue.

    (The page's script goes back in the history instead; no Referer reaches us.)
    """
    back = getattr(request.state, "ui_back", None)
    return back if isinstance(back, str) else "/ui/queue"


def _page_errors(previous: ErrorHandler) -> Callable[[Request, Any], Awaitable[Response]]:
    """A UI page's error as the error page with the reason; fetch and REST keep their JSON."""

    async def handler(request: Request, exc: Exception) -> Response:
        answer = previous(request, exc)
        response = await answer if inspect.isawaitable(answer) else answer
        page = request.url.path.startswith("/ui/") and not _wants_json(request)
        if not page or response.status_code < 400:
            return response
        try:
            detail = json.loads(bytes(response.body)).get("detail")
        except (ValueError, AttributeError):
            detail = None
        code = response.status_code
        message = detail if isinstance(detail, str) else "The request could not be completed."
        return render_page(
            request,
            "error.html",
            getattr(request.state, "ui_user", None),
            status_code=code,
            title=_ERROR_TITLES.get(code, "Something went wrong"),
            message=message,
            back=_back_link(request),
        )

    return handler


def mount_ui(app: FastAPI) -> None:
    """Add the review UI's routes, static files and error pages to ``app``.

    Call it after the app's own error handlers are set: a UI page's error wraps them.
    """
    app.include_router(router)
    app.include_router(ui_jobs.router)
    app.mount("/ui/static", StaticFiles(directory=str(UI_DIR / "static")), name="ui-static")
    app.add_exception_handler(LoginRequired, _login_required)
    app.add_exception_handler(NotAllowed, _not_allowed)
    for kind in (EdgeLoopError, RequestValidationError, StarletteHTTPException):
        previous = app.exception_handlers.get(kind)
        if previous is not None:
            app.add_exception_handler(kind, _page_errors(previous))
