"""The local HTTP API: ``POST /v1/frames`` and the health, status and metrics routes.

Routes stay thin: check the request, hand the bytes to the agent, shape the answer.
Frame uploads are the hot path (``edge_agent.sources.uploads``): one with a declared
length is answered by the server's protocol itself, a chunked JPEG or PNG body by
``AgentApi`` without FastAPI's stack, a multipart one by the FastAPI route; all
share one rate limit (over it, a 429 with ``Retry-After``). In front of every route,
``shared.http_limits`` holds each body to its limit before it is read and refuses
control characters in the path and query; the server (``shared.http_server``)
closes connections whose request head is slow.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from edge_agent.imaging import ACCEPTED
from edge_agent.localauth import bearer_refusal
from edge_agent.sources.uploads import (
    ACCEPTED_TYPES,
    HEADER_SLACK,
    RAW_TYPES,
    FrameRoute,
    Frames,
    file_from_form,
    media_type,
    post_frame,
    refuse,
)
from shared.errors import EdgeLoopError, TransportError
from shared.http_limits import BodyRule, HttpLimitsMiddleware
from shared.http_server import RawRoute, ServerLimits, server_config
from shared.lifecycle import Workers

if TYPE_CHECKING:
    from edge_agent.agent import Agent

__all__ = ["AgentApi", "ApiServer", "create_app"]


class AgentApi(FastAPI):
    """The agent's FastAPI app; ``POST /v1/frames`` with a JPEG/PNG body skips its stack."""

    frames: Frames | None = None
    # The body limits and request hygiene every route gets first (shared/http_limits.py).
    guard: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guard = self.guard
        if guard is not None:
            await guard(scope, receive, send)
        else:
            await self.dispatch(scope, receive, send)

    async def dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app behind the guard: the raw-body fast path, else FastAPI."""
        frames = self.frames
        if (
            frames is not None
            and scope["type"] == "http"
            and scope["path"] == "/v1/frames"
            and scope["method"] == "POST"
        ):
            content_type = b""
            declared: bytes | None = None
            for name, value in scope["headers"]:
                if name == b"content-type":
                    content_type = media_type(value)
                elif name == b"content-length":
                    declared = value
            if content_type in RAW_TYPES:
                await post_frame(frames, declared, receive, send)
                return
        await super().__call__(scope, receive, send)


_FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data", "text/plain")


def _cross_site(request: Request) -> str | None:
    """Why a mutating request may come from another site's page, else None.

    A browser sends ``Origin`` on every cross-origin POST, and a form (or a fetch that
    needs no preflight) can only send the form content types: either refuses the request.
    """
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin is not None and origin != own:
        return f"cross-site request from {origin!r} refused: call this API from {own} or a client"
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type in _FORM_TYPES:
        return f"a {content_type} body is refused here: send no body or application/json"
    return None


def create_app(agent: Agent) -> AgentApi:
    """The agent's HTTP API as a FastAPI app (served by uvicorn in ``edge-agent run``)."""
    app = AgentApi(title="EdgeLoop edge agent", version="1")
    frames = Frames(agent)
    app.frames = frames
    app.guard = HttpLimitsMiddleware(
        app.dispatch,
        default_max_bytes=agent.settings.http_max_body_bytes,
        default_accepts="no body, or a small JSON body",
        rules=[
            BodyRule(
                r"/v1/frames",
                frames.max_bytes + HEADER_SLACK,
                ACCEPTED + ", or multipart/form-data with one file part",
                methods=frozenset({"POST"}),
            )
        ],
        on_refusal=frames.count_refusal,
    )

    def refused(status: int, message: str, reason: str) -> JSONResponse:
        frames.count_refusal(reason)
        return refuse(status, message, reason)

    @app.post("/v1/frames")
    async def post_frame(request: Request) -> Response:
        # The FastAPI route sees multipart uploads and what the fast path does not accept.
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type not in ACCEPTED_TYPES:
            shown = content_type or "no Content-Type"
            return refused(
                415, f"unsupported content type {shown!r}: send {ACCEPTED}", "content_type"
            )
        too_large = frames.over_declared_size(request.headers.get("content-length"))
        if too_large is not None:
            return refused(413, too_large, "too_large")
        limited = frames.rate_refusal()
        if limited is not None:
            refusal, retry_after = limited
            return JSONResponse(refusal, status_code=429, headers={"Retry-After": str(retry_after)})
        if content_type == "multipart/form-data":
            body = await file_from_form(request, frames.max_bytes)
            if isinstance(body, JSONResponse):
                frames.count_refusal("multipart")
                return body
        else:
            body = await request.body()
        try:
            data = await frames.answer(body, asyncio.get_running_loop())
        except Exception as exc:
            status, refusal = frames.failure(exc)
            return JSONResponse(refusal, status_code=status)
        return Response(data, media_type="application/json")

    @app.get("/v1/samples/{sample_id}")
    async def get_sample(sample_id: str) -> Response:
        entry = await run_in_threadpool(agent.sample, sample_id)
        if entry is None:
            return JSONResponse(
                {
                    "detail": f"no sample {sample_id!r} on this agent (only the last"
                    f" {agent.settings.results_kept} answers and"
                    f" {agent.settings.verdicts_kept} verdicts are kept)"
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
    async def rollback_model(request: Request) -> Response:
        cross_site = _cross_site(request)
        if cross_site is not None:
            return refuse(403, cross_site, "cross_site")
        unauthorized = await run_in_threadpool(
            bearer_refusal, request.headers.get("authorization"), agent.settings
        )
        if unauthorized is not None:
            response = refuse(401, unauthorized, "unauthorized")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
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


class ApiServer:
    """uvicorn serving the agent's app in a named thread: ``with ApiServer(app, port=0) as s``.

    The agent's app has its frame uploads answered by the server's protocol
    (``FrameRoute``); ``raw_route`` names another such route for any other app.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: ServerLimits | None = None,
        raw_route: RawRoute | None = None,
    ) -> None:
        import uvicorn

        from shared.broker import free_port

        self.host = host
        self.port = port or free_port(host)
        if limits is None and isinstance(app, AgentApi) and app.frames is not None:
            limits = app.frames.agent.settings.http_server_limits
        if raw_route is None and isinstance(app, AgentApi) and app.frames is not None:
            raw_route = FrameRoute(app.frames)
        config = server_config(
            app,
            host=host,
            port=self.port,
            limits=limits or ServerLimits(),
            raw_route=raw_route,
            log_level="warning",
            access_log=False,
            lifespan="off",
            # A local API: no proxy in front (server_config leaves forwarding headers
            # alone), and no Server/Date headers to format per answer.
            server_header=False,
            date_header=False,
        )
        self.server = uvicorn.Server(config)
        self._workers = Workers("http")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> ApiServer:
        thread = self._workers.spawn("api", self.server.run)
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise TransportError(f"HTTP API did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        self._workers.stop(timeout)
        app = self.server.config.app
        if isinstance(app, AgentApi) and app.frames is not None:
            app.frames.close()

    def health(self) -> dict[str, object]:
        """The server thread's state."""
        return dict(self._workers.health())

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
