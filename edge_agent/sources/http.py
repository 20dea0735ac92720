"""The local HTTP API: ``POST /v1/frames`` and the health, status and metrics routes.

Routes stay thin: check the request, hand the bytes to the agent, shape the answer.
Decoding runs in the thread pool and inference on the agent's inference thread, so
the event loop only moves bytes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from edge_agent.imaging import ACCEPTED, ACCEPTED_CONTENT_TYPES, ImageRejected
from edge_agent.sources import RateLimiter
from shared.errors import EdgeLoopError, TransportError

if TYPE_CHECKING:
    from edge_agent.agent import Agent

__all__ = ["ApiServer", "create_app"]

SOURCE = "http"
_ACCEPTED_TYPES = (*ACCEPTED_CONTENT_TYPES, "multipart/form-data")


def _refuse(status: int, message: str, reason: str) -> JSONResponse:
    return JSONResponse(
        {
            "detail": message,
            "reason": reason,
            "accepted": ACCEPTED + ", or multipart/form-data with one file part",
        },
        status_code=status,
    )


def create_app(agent: Agent) -> FastAPI:
    """The agent's HTTP API as a FastAPI app (served by uvicorn in ``edge-agent run``)."""
    app = FastAPI(title="EdgeLoop edge agent", version="1")
    limiter = RateLimiter(agent.settings.http_max_fps) if agent.settings.http_max_fps else None
    max_bytes = agent.settings.max_image_bytes

    def refused(status: int, message: str, reason: str) -> JSONResponse:
        agent.telemetry.bad_input.labels(SOURCE, reason).inc()
        return _refuse(status, message, reason)

    @app.post("/v1/frames")
    async def post_frame(request: Request) -> Response:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type not in _ACCEPTED_TYPES:
            shown = content_type or "no Content-Type"
            return refused(
                415, f"unsupported content type {shown!r}: send {ACCEPTED}", "content_type"
            )
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes + 65536:
            return refused(
                413,
                f"request of {declared} bytes is over the limit of {max_bytes} image bytes",
                "too_large",
            )
        if limiter is not None and not limiter.try_take():
            return refused(429, "frame rate over this source's limit; retry later", "rate_limited")
        if content_type == "multipart/form-data":
            body = await _file_from_form(request, max_bytes)
            if isinstance(body, JSONResponse):
                agent.telemetry.bad_input.labels(SOURCE, "multipart").inc()
                return body
        else:
            body = await request.body()
        try:
            image = await run_in_threadpool(agent.decode, body)
        except ImageRejected as exc:
            return refused(exc.status, exc.message, exc.reason)
        try:
            future = agent.submit(image.rgb, source=SOURCE, encoded=image.encoded, info=image.info)
            result = await asyncio.wait_for(
                asyncio.wrap_future(future), agent.settings.infer_timeout_s
            )
        except TimeoutError:
            return _refuse(503, "inference timed out; the agent is overloaded", "timeout")
        except EdgeLoopError as exc:
            return _refuse(503, f"inference failed: {exc}", exc.reason)
        return JSONResponse(result.as_dict())

    @app.get("/v1/samples/{sample_id}")
    async def get_sample(sample_id: str) -> Response:
        entry = agent.sample(sample_id)
        if entry is None:
            return JSONResponse(
                {
                    "detail": f"no sample {sample_id!r} on this agent (only the last"
                    f" {agent.settings.results_kept} are kept)"
                },
                status_code=404,
            )
        return JSONResponse({"sample_id": sample_id, **entry})

    @app.get("/v1/status")
    async def get_status() -> dict[str, Any]:
        return await run_in_threadpool(agent.status)

    @app.get("/v1/model")
    async def get_model() -> dict[str, Any]:
        return agent.updater.status()

    @app.post("/v1/model/rollback")
    async def rollback_model() -> Response:
        try:
            result = await run_in_threadpool(agent.updater.rollback)
        except EdgeLoopError as exc:
            return JSONResponse({"detail": exc.message, "reason": exc.reason}, status_code=409)
        return JSONResponse(result)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        if not agent.ready:
            return JSONResponse({"status": "starting", "detail": "model not loaded yet"}, 503)
        return JSONResponse({"status": "ready", "connected": agent.publisher.connected})

    @app.get("/metrics")
    async def metrics() -> Response:
        await run_in_threadpool(agent.status)  # refresh the gauges
        return PlainTextResponse(
            generate_latest(agent.telemetry.registry), media_type=CONTENT_TYPE_LATEST
        )

    return app


async def _file_from_form(request: Request, max_bytes: int) -> bytes | JSONResponse:
    try:
        form = await request.form(max_files=1, max_fields=8, max_part_size=max_bytes + 1)
    except Exception as exc:  # starlette raises several kinds for a malformed body
        return _refuse(400, f"malformed multipart body: {exc}", "multipart")
    try:
        files = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
        if len(files) != 1:
            return _refuse(
                400, f"multipart body has {len(files)} file parts, expected one", "multipart"
            )
        data = await files[0].read(max_bytes + 1)
        return data
    finally:
        await form.close()


class ApiServer:
    """uvicorn serving the agent's app in a named thread: ``with ApiServer(app, port=0) as s``."""

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        from shared.broker import free_port

        self.host = host
        self.port = port or free_port(host)
        config = uvicorn.Config(
            app,
            host=host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> ApiServer:
        self._thread = threading.Thread(target=self.server.run, name="http-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise TransportError(f"HTTP API did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
