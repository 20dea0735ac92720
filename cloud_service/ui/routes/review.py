"""The review UI's queue, review pages and their fetch endpoints, bulk actions, and export."""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Body, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from pydantic import BaseModel, Field
from sqlalchemy import select

from cloud_service import exports
from cloud_service.db import crud
from cloud_service.db.models import Agent
from cloud_service.ui import store
from cloud_service.ui.deps import CsrfDep, UserDep
from cloud_service.ui.routes.pages import queue_filter, render_page
from cloud_service.ui.routes.undo_tokens import make_undo_token, read_undo_token
from cloud_service.web.deps import BlobsDep, SessionDep, StateDep
from shared.errors import ContractError

__all__ = ["EXPORT_FORMATS", "router"]

router = APIRouter(prefix="/ui", include_in_schema=False)

EXPORT_FORMATS = [
    ("csv", "CSV"),
    ("json", "JSON"),
    ("imagefolder", "ImageFolder zip"),
    ("coco", "COCO JSON"),
    ("yolo", "YOLO zip"),
    ("labelstudio", "Label Studio JSON"),
]


@router.get("/queue")
def queue(request: Request, session: SessionDep, state: StateDep, user: UserDep) -> HTMLResponse:
    flt = queue_filter(request)
    classes = store.class_names_for(session=session, state=state)
    page = store.queue_page(session=session, flt=flt, classes=classes)
    rows = [{"s": s, "v": v, "names": classes.for_sample(s)} for s, v in page.rows]
    agents = list(session.scalars(select(Agent.agent_id).order_by(Agent.agent_id).limit(500)))
    return render_page(
        request,
        "queue.html",
        user,
        flt=flt,
        rows=rows,
        total=page.total,
        pages=page.pages,
        agents=agents,
        class_names=classes.known(),
        statuses=store.STATUSES,
        reasons=store.ROUTE_REASONS,
        sorts=list(store.SORTS),
        page_sizes=store.PAGE_SIZES,
        formats=EXPORT_FORMATS,
        undo=request.query_params.get("undo", "")[:8192],
    )


def _to_queue(back: str, notice: str, **extra: str) -> RedirectResponse:
    query = back.lstrip("?")
    parts = [query] if query else []
    parts.append(f"notice={quote(notice)}")
    parts += [f"{key}={quote(value)}" for key, value in extra.items() if value]
    return RedirectResponse("/ui/queue?" + "&".join(parts), status_code=303)


@router.post("/queue/bulk")
def bulk(
    request: Request,
    session: SessionDep,
    state: StateDep,
    user: CsrfDep,
    action: Annotated[str, Form(max_length=16)],
    ids: Annotated[list[str], Form()] = [],  # noqa: B006
    label: Annotated[str, Form(max_length=128)] = "",
    back: Annotated[str, Form(max_length=4096)] = "",
    confirm: Annotated[str, Form(max_length=8)] = "",
) -> Response:
    """Confirm, relabel or discard the ticked samples; a discard asks first, then can be undone.

    Confirming a detection sample takes the teacher's boxes."""
    request.state.ui_back = "/ui/queue?" + back.lstrip("?")  # for the error page
    chosen = list(dict.fromkeys(ids))
    if action == "discard" and confirm != "yes":
        if not chosen:
            raise ContractError("no samples selected: tick at least one row", reason="invalid")
        if len(chosen) > store.MAX_BULK:
            raise ContractError(f"a bulk action takes at most {store.MAX_BULK} samples")
        return render_page(request, "bulk_confirm.html", user, ids=chosen, back=back)
    result = store.bulk_review(
        session=session,
        sample_ids=chosen,
        action=action,
        label=label,
        reviewer=user.username,
        classes=store.class_names_for(session=session, state=state),
    )
    notice = f"{action}: {len(result.done)} done"
    if result.skipped:
        notice += f", {len(result.skipped)} skipped (changed meanwhile by someone else)"
    undo = ""
    if action == "discard" and result.done:
        undo = make_undo_token(state, user, result.done)
        notice += "; Undo puts them back"
    return _to_queue(back, notice, undo=undo)


@router.post("/queue/undo")
def bulk_undo(
    session: SessionDep,
    state: StateDep,
    user: CsrfDep,
    token: Annotated[str, Form(max_length=8192)],
    back: Annotated[str, Form(max_length=4096)] = "",
) -> Response:
    """Undo a bulk discard: each sample still discarded gets its previous status back."""
    result = store.undo_bulk(session=session, items=read_undo_token(state, user, token))
    notice = f"undo: {len(result.done)} samples restored"
    if result.skipped:
        notice += f", {len(result.skipped)} skipped (changed meanwhile)"
    return _to_queue(back, notice)


# --- review ------------------------------------------------------------------


@router.get("/review/{sample_id}")
def review_page(
    request: Request, sample_id: str, session: SessionDep, state: StateDep, user: UserDep
) -> HTMLResponse:
    flt = queue_filter(request)
    sample, verdict, _ = crud.get_sample(session=session, sample_id=sample_id)
    classes = store.class_names_for(session=session, state=state)
    view = store.sample_view(session=session, sample=sample, verdict=verdict, classes=classes)
    return render_page(request, "review.html", user, flt=flt, sample=view, query=flt.query_string())


@router.get("/review")
def review_first(request: Request, session: SessionDep, state: StateDep, user: UserDep) -> Response:
    """The first sample of the filter (the queue's "start reviewing")."""
    flt = queue_filter(request).without_page()
    page = store.queue_page(
        session=session, flt=flt, classes=store.class_names_for(session=session, state=state)
    )
    if not page.rows:
        return RedirectResponse(f"/ui/queue?{flt.query_string()}&notice=nothing+to+review", 303)
    first = page.rows[0][0].sample_id
    return RedirectResponse(f"/ui/review/{first}?{flt.query_string()}", status_code=303)


@router.get("/samples/{sample_id}/image")
def sample_image(sample_id: str, session: SessionDep, blobs: BlobsDep, _user: UserDep) -> Response:
    sample, _, _ = crud.get_sample(session=session, sample_id=sample_id)
    return Response(
        blobs.get(sample.image_key),
        media_type=f"image/{sample.image_format}",
        headers={"Cache-Control": "private, max-age=86400"},
    )


@router.get("/api/samples/{sample_id}")
def sample_json(
    sample_id: str, session: SessionDep, state: StateDep, _user: UserDep
) -> dict[str, Any]:
    sample, verdict, _ = crud.get_sample(session=session, sample_id=sample_id)
    classes = store.class_names_for(session=session, state=state)
    return store.sample_view(session=session, sample=sample, verdict=verdict, classes=classes)


@router.get("/api/samples/{sample_id}/neighbour")
def sample_neighbour(
    request: Request,
    sample_id: str,
    session: SessionDep,
    state: StateDep,
    _user: UserDep,
    direction: Annotated[str, Query(pattern="^(next|prev)$")] = "next",
) -> dict[str, Any]:
    flt = queue_filter(request)
    classes = store.class_names_for(session=session, state=state)
    sample, _, _ = crud.get_sample(session=session, sample_id=sample_id)
    found = store.neighbour(
        session=session, flt=flt, classes=classes, sample=sample, forward=direction == "next"
    )
    after = None
    if found is not None:
        after = store.sample_view(
            session=session, sample=found[0], verdict=found[1], classes=classes
        )
    return {"sample": after}


class ReviewIn(BaseModel):
    """A review: ``label`` for a classification sample, ``boxes`` for a detection one
    (``[[x1, y1, x2, y2, class], ...]``, fractions of the frame; the store checks them)."""

    action: str = Field(pattern="^(label|discard)$")
    label: int | None = Field(default=None, ge=0, le=999)
    boxes: list[Any] | None = None
    token: str = Field(max_length=64)
    query: str = Field(default="", max_length=4096)


@router.post("/api/samples/{sample_id}/review")
def review(
    sample_id: str,
    body: Annotated[ReviewIn, Body()],
    session: SessionDep,
    state: StateDep,
    user: CsrfDep,
) -> dict[str, Any]:
    """Review one sample and answer with the next one of the filter (one round trip)."""
    result = store.review_sample(
        session=session,
        sample_id=sample_id,
        action=body.action,
        label=body.label,
        token=body.token,
        reviewer=user.username,
        boxes=body.boxes,
    )
    flt = store.QueueFilter.from_query(_parse_qs(body.query))
    classes = store.class_names_for(session=session, state=state)
    sample, _, _ = crud.get_sample(session=session, sample_id=sample_id)
    found = store.neighbour(session=session, flt=flt, classes=classes, sample=sample, forward=True)
    after = None
    if found is not None:
        after = store.sample_view(
            session=session, sample=found[0], verdict=found[1], classes=classes
        )
    return {"done": result.action, "token": result.token, "undo": result.undo, "next": after}


def _parse_qs(query: str) -> dict[str, str]:
    from urllib.parse import parse_qsl

    return dict(parse_qsl(query.lstrip("?"), keep_blank_values=True))


class UndoIn(BaseModel):
    sample_id: str = Field(pattern=r"^[0-9a-f-]{36}$")
    previous: str = Field(max_length=16)
    label_id: int | None = None
    token: str = Field(max_length=64)


@router.post("/api/undo")
def undo(
    body: Annotated[UndoIn, Body()], session: SessionDep, state: StateDep, user: CsrfDep
) -> dict[str, Any]:
    store.undo_review(
        session=session,
        sample_id=body.sample_id,
        previous=body.previous,
        label_id=body.label_id,
        token=body.token,
        user=user.username,
    )
    sample, verdict, _ = crud.get_sample(session=session, sample_id=body.sample_id)
    classes = store.class_names_for(session=session, state=state)
    return {
        "sample": store.sample_view(
            session=session, sample=sample, verdict=verdict, classes=classes
        )
    }


@router.get("/export")
def export(
    request: Request,
    session: SessionDep,
    state: StateDep,
    blobs: BlobsDep,
    _user: UserDep,
    format: Annotated[str, Query(max_length=16)] = "csv",
) -> Response:
    """The samples under the queue's filter (its status included), as ``format``."""
    exports.media_type(format)  # an unknown format is refused before any work
    rows = store.export_rows(
        session=session,
        flt=queue_filter(request),
        classes=store.class_names_for(session=session, state=state),
    )
    return exports.download(format, rows, blobs=blobs, base_url=str(request.base_url))
