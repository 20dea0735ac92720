"""How the review UI's pages render: its templates, the page renderer, the queue filter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from cloud_service.ui import store
from cloud_service.ui.deps import UiUser

__all__ = ["UI_DIR", "queue_filter", "render_page", "templates"]

UI_DIR = Path(__file__).resolve().parent.parent
templates = Jinja2Templates(directory=str(UI_DIR / "templates"))


def render_page(
    request: Request, name: str, user: UiUser | None, status_code: int = 200, **context: Any
) -> HTMLResponse:
    context.update(
        user=user, nav=name.removesuffix(".html"), notice=request.query_params.get("notice")
    )
    return templates.TemplateResponse(request, name, context, status_code=status_code)


def queue_filter(request: Request) -> store.QueueFilter:
    return store.QueueFilter.from_query(request.query_params)
