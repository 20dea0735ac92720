"""Review results as datasets over REST (admin token): ``GET /v1/exports``.

The same filter as the review UI's queue (status, agent, fleet, classes by name or
index, model version, reason, capture time, edge confidence) and the same formats
(``cloud_service.exports``): csv, json, imagefolder, coco, yolo, labelstudio.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from cloud_service import exports
from cloud_service.ui import store
from cloud_service.web.deps import AdminDep, BlobsDep, SessionDep, StateDep

router = APIRouter(prefix="/v1", tags=["exports"])

Text = Annotated[str, Query(max_length=64)]


@router.get(
    "/exports",
    response_class=Response,
    responses={
        200: {"content": {"text/csv": {}, "application/json": {}, "application/zip": {}}},
        422: {"description": "an unknown format or an invalid filter, with the reason"},
    },
)
def export_samples(
    request: Request,
    session: SessionDep,
    state: StateDep,
    blobs: BlobsDep,
    _admin: AdminDep,
    format: Annotated[str, Query(max_length=16, description=", ".join(exports.FORMATS))] = "csv",
    status: Annotated[
        str, Query(max_length=16, description=", ".join(store.STATUSES))
    ] = "reviewed",
    agent: Text = "",
    fleet: Text = "",
    edge_class: Annotated[str, Query(max_length=64, description="a class name or index")] = "",
    teacher_class: Annotated[str, Query(max_length=64, description="a class name or index")] = "",
    model_version: Text = "",
    reason: Text = "",
    since: Annotated[str, Query(max_length=64, description="a date or ISO time")] = "",
    until: Annotated[str, Query(max_length=64, description="a date or ISO time")] = "",
    conf_min: Annotated[str, Query(max_length=16, description="edge confidence, 0..1")] = "",
    conf_max: Annotated[str, Query(max_length=16, description="edge confidence, 0..1")] = "",
    sort: Annotated[str, Query(max_length=16, description=", ".join(store.SORTS))] = "newest",
    limit: Annotated[int, Query(ge=1, le=100_000)] = 100_000,
) -> Response:
    """The samples under the filter as a dataset file (default: the reviewed ones, as CSV)."""
    exports.media_type(format)
    flt = store.QueueFilter.from_query(
        {
            "status": status,
            "agent": agent,
            "fleet": fleet,
            "edge_class": edge_class,
            "teacher_class": teacher_class,
            "model_version": model_version,
            "reason": reason,
            "since": since,
            "until": until,
            "conf_min": conf_min,
            "conf_max": conf_max,
            "sort": sort,
        }
    )
    classes = store.class_names_for(session=session, state=state)
    rows = store.export_rows(session=session, flt=flt, classes=classes, limit=limit)
    return exports.download(format, rows, blobs=blobs, base_url=str(request.base_url))
