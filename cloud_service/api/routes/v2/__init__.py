"""The teacher over the Open Inference Protocol (KServe V2), for existing V2 clients.

Only the teacher is served, under ``settings.teacher_name`` and its one version; the
input is the model contract's ``frames`` (UINT8 [N, H, W, 3]), the output ``scores``
(FP32 [N, C]). Besides the core protocol the routes speak Triton's HTTP extensions that
its clients use by default: binary tensor data (``Inference-Header-Content-Length``: a
JSON header, then raw tensor bytes, in requests and responses), classification (an
output's ``parameters.classification`` = k answers the top k as "score:index:label"),
model configuration (``/config``), and gzip/deflate bodies. An infer body is read by
its bytes, whatever its Content-Type says. Every error on a ``/v2`` path answers
``{"error": "..."}``: 400 for a request the model cannot take, 404 for an unknown
model, version or path, 405, 413 over the size limit, 415 for an unknown body
encoding, 503 while the teacher cannot run.

Modules: ``protocol`` (the request, its error), ``reading`` (the body, its limits, the
tensors), ``metadata`` (the served model), ``answering`` (outputs, compression); the
routes are here.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.routing import Match

from cloud_service.api.routes.v2.answering import accepted_coding, answer_infer, compressed
from cloud_service.api.routes.v2.metadata import (
    config_document,
    metadata_document,
    served_teacher,
    server_version,
)
from cloud_service.api.routes.v2.protocol import (
    EXTENSIONS,
    HEADER_LENGTH,
    INFER_OPENAPI,
    V2Error,
    error_summary,
)
from cloud_service.api.routes.v2.reading import MAX_BODY_BYTES, MAX_ELEMENTS, read_body
from cloud_service.web.deps import StateDep

__all__ = ["MAX_BODY_BYTES", "MAX_ELEMENTS", "V2Error", "router"]


def _error(exc: V2Error) -> JSONResponse:
    headers = {"Allow": exc.allow} if exc.allow else None
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)


class _V2Route(APIRoute):
    """A route whose errors, FastAPI's own included, answer ``{"error": ...}``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handler(request: Request) -> Response:
            try:
                return await handle(request)
            except V2Error as exc:
                return _error(exc)
            except RequestValidationError as exc:
                return _error(V2Error(f"request is not valid: {error_summary(exc.errors())}"))
            except HTTPException as exc:
                return _error(V2Error(str(exc.detail), exc.status_code))

        return handler


router = APIRouter(prefix="/v2", tags=["inference (KServe V2)"], route_class=_V2Route)


async def _infer_route(
    request: Request, state: StateDep, name: str, version: str | None
) -> Response:
    # The whole body is read first: a client still sending when the answer comes would
    # see a broken connection instead of the error.
    body = await read_body(request)
    teacher = served_teacher(state, name, version)
    # Inflating and parsing a large tensor and running the model take a while: off the loop.
    answer = await run_in_threadpool(
        lambda: answer_infer(
            teacher,
            name,
            body,
            encoding=request.headers.get("content-encoding", ""),
            header_length=request.headers.get(HEADER_LENGTH),
        )
    )
    headers: dict[str, str] = {}
    if answer.binary:
        content, media_type = answer.header + answer.binary, "application/octet-stream"
        headers[HEADER_LENGTH] = str(len(answer.header))
    else:
        content, media_type = answer.header, "application/json"
    coding = accepted_coding(request.headers.get("accept-encoding", ""))
    if coding is not None:
        content = await run_in_threadpool(compressed, content, coding)
        headers["Content-Encoding"] = coding
    return Response(content, media_type=media_type, headers=headers)


# --- the routes -------------------------------------------------------------------


@router.get("")
def server_metadata() -> dict[str, Any]:
    return {"name": "edgeloop", "version": server_version(), "extensions": list(EXTENSIONS)}


@router.get("/health/live")
def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready")
def ready(state: StateDep) -> JSONResponse:
    is_ready = state.teacher() is not None
    return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)


@router.get("/models/{name}")
def model_metadata(name: str, state: StateDep) -> dict[str, Any]:
    return metadata_document(name, served_teacher(state, name, None).info)


@router.get("/models/{name}/versions/{version}")
def version_metadata(name: str, version: str, state: StateDep) -> dict[str, Any]:
    return metadata_document(name, served_teacher(state, name, version).info)


@router.get("/models/{name}/ready")
def model_ready(name: str, state: StateDep) -> dict[str, Any]:
    served_teacher(state, name, None)
    return {"name": name, "ready": True}


@router.get("/models/{name}/versions/{version}/ready")
def version_ready(name: str, version: str, state: StateDep) -> dict[str, Any]:
    served_teacher(state, name, version)
    return {"name": name, "version": version, "ready": True}


@router.get("/models/{name}/config")
def model_config(name: str, state: StateDep) -> dict[str, Any]:
    return config_document(name, served_teacher(state, name, None).info)


@router.get("/models/{name}/versions/{version}/config")
def version_config(name: str, version: str, state: StateDep) -> dict[str, Any]:
    return config_document(name, served_teacher(state, name, version).info)


@router.post("/models/{name}/infer", openapi_extra=INFER_OPENAPI)
async def infer(name: str, request: Request, state: StateDep) -> Response:
    return await _infer_route(request, state, name, None)


@router.post("/models/{name}/versions/{version}/infer", openapi_extra=INFER_OPENAPI)
async def version_infer(name: str, version: str, request: Request, state: StateDep) -> Response:
    return await _infer_route(request, state, name, version)


_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


@router.api_route("", methods=[m for m in _METHODS if m != "GET"], include_in_schema=False)
@router.api_route("/{rest:path}", methods=_METHODS, include_in_schema=False)
def unmatched(request: Request) -> Response:
    """Any other /v2 path or method: 404 or 405 as ``{"error": ...}``."""
    allowed = sorted(
        {
            method
            for route in router.routes
            if isinstance(route, APIRoute)
            and route.endpoint is not unmatched
            and route.matches(request.scope)[0] is Match.PARTIAL
            for method in route.methods or ()
        }
    )
    if allowed:
        raise V2Error(
            f"{request.method} is not allowed on {request.url.path}; use {', '.join(allowed)}",
            405,
            allow=", ".join(allowed),
        )
    raise V2Error(f"no V2 endpoint at {request.url.path}", 404)
