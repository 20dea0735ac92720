"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from cloud_service.web.deps import MetricsDep, StateDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/readyz")
def readyz(state: StateDep) -> JSONResponse:
    """Dependencies reachable: the database; the broker and model when the verifier runs here."""
    checks: dict[str, Any] = {}
    try:
        with state.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except SQLAlchemyError as exc:
        checks["database"] = f"unreachable: {exc.__class__.__name__}"
    if state.worker is not None:
        checks["broker"] = "ok" if state.worker.ready else "not connected"
        checks["teacher"] = state.worker.teacher.info.provider
    ready = all(v == "ok" for k, v in checks.items() if k != "teacher")
    return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)


@router.get("/metrics")
def metrics(metrics: MetricsDep) -> Response:
    """Prometheus text format."""
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
