"""The FastAPI application factory and its error mapping."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from cloud_service.announce import Announcer
from cloud_service.api.routes import enrollment, fleet, health, models, v2
from cloud_service.api.routes import exports as exports_routes
from cloud_service.api.routes import jobs as jobs_routes
from cloud_service.blobs import BlobStore, open_blob_store
from cloud_service.db.session import make_engine, make_session_factory, upgrade_database
from cloud_service.errors import AuthError, ConflictError, ForbiddenError, NotFoundError
from cloud_service.metrics import CloudMetrics
from cloud_service.settings import CloudSettings
from cloud_service.web.state import ApiState, load_signing_key
from shared.errors import ContractError, EdgeLoopError, ModelError, StoreError
from shared.http_limits import BodyRule, HttpLimitsMiddleware, TrustedProxyMiddleware

if TYPE_CHECKING:
    from cloud_service.worker import VerifierWorker

__all__ = ["ApiState", "create_app"]

log = logging.getLogger(__name__)


def _status_for(exc: EdgeLoopError) -> int:
    if isinstance(exc, NotFoundError):
        return 404
    if isinstance(exc, AuthError):
        return 401
    if isinstance(exc, ForbiddenError):
        return 403
    if isinstance(exc, ConflictError):
        return 409
    if isinstance(exc, StoreError) and exc.reason == "not_found":
        return 404
    if isinstance(exc, ContractError):
        return 422
    if isinstance(exc, (StoreError, ModelError)):
        return 503
    return 500


async def _edgeloop_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, EdgeLoopError)
    code = _status_for(exc)
    if code >= 500:
        log.error("%s %s failed: %s", request.method, request.url.path, exc)
    headers = {"WWW-Authenticate": "Bearer"} if code == 401 else None
    return JSONResponse(
        {"detail": exc.message, "reason": exc.reason}, status_code=code, headers=headers
    )


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = []
    for error in exc.errors()[:10]:
        where = ".".join(str(p) for p in error.get("loc", ()))
        problems.append({"loc": where, "msg": error.get("msg", "invalid")})
    summary = "; ".join(f"{p['loc']}: {p['msg']}" for p in problems)
    return JSONResponse(
        {"detail": f"request is not valid: {summary}", "errors": problems, "reason": "invalid"},
        status_code=422,
    )


def create_app(
    settings: CloudSettings,
    *,
    worker: VerifierWorker | None = None,
    metrics: CloudMetrics | None = None,
    blobs: BlobStore | None = None,
    announcer: Announcer | None = None,
    migrate: bool = True,
    health_only: bool = False,
) -> FastAPI:
    """The API over ``settings``; pass the in-process ``worker`` in ``cloud-service all``.

    ``health_only`` serves just /healthz, /readyz and /metrics (the verifier process).
    """
    url = settings.resolved_database_url
    if migrate:
        upgrade_database(url)
    engine = make_engine(url)
    state = ApiState(
        settings=settings,
        engine=engine,
        sessions=make_session_factory(engine),
        blobs=blobs or (worker.blobs if worker else None) or open_blob_store(settings),
        metrics=metrics or (worker.metrics if worker else None) or CloudMetrics(),
        signing_key=load_signing_key(settings, signs=not health_only),
        worker=worker,
        announcer=announcer,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = None
        if not health_only and settings.rollout_tick_s > 0:
            from cloud_service.rollout import RolloutLoop

            loop = RolloutLoop(
                state, settings.rollout_tick_s, ttl=settings.announcement_ttl
            ).start()
        scheduler = None
        if not health_only and settings.rollout_tick_s > 0:
            from cloud_service.jobs.schedules import SchedulerLoop

            scheduler = SchedulerLoop(state.sessions, jobs_routes.SCHEDULER_TICK_S).start()
        yield
        if scheduler is not None:
            scheduler.stop()
        if loop is not None:
            loop.stop()
        if state.announcer is not None:
            state.announcer.close()
        engine.dispose()

    app = FastAPI(
        title="EdgeLoop cloud service",
        version="1",
        description="Enrollment, samples, verdicts, labels, stats; the teacher over KServe V2.",
        lifespan=lifespan,
    )
    app.state.edgeloop = state
    if not health_only:
        jobs_routes.watch_queue(state)
    app.add_exception_handler(EdgeLoopError, _edgeloop_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    routers = [health.router] if health_only else [health.router, enrollment.router]
    if not health_only:
        routers += [fleet.router, models.router, v2.router]
        routers += [jobs_routes.router, exports_routes.router]
    for router in routers:
        app.include_router(router)
    if not health_only:
        from cloud_service.ui.routes import mount_ui

        mount_ui(app)

    from cloud_service.security import RateLimitMiddleware, SecurityHeadersMiddleware
    from cloud_service.web.deps import bearer_principal

    def authenticate(token: str) -> str | None:
        try:
            return bearer_principal(state, token)
        except (EdgeLoopError, SQLAlchemyError) as exc:
            # The store is away: charge the peer address; the route answers 503 itself.
            log.warning("rate limiter could not authenticate a bearer token: %s", exc)
            return None

    _add_http_limits(app, state)
    burst = settings.rate_limit_burst
    app.add_middleware(
        RateLimitMiddleware,
        limits={
            "enroll": (settings.rate_limit_enroll_per_min, burst),
            "login": (settings.rate_limit_login_per_min, burst),
            "upload": (settings.rate_limit_upload_per_min, burst),
        },
        refused=state.metrics.rate_limited,
        authenticate=authenticate,
    )
    app.add_middleware(
        SecurityHeadersMiddleware, secure_cookies=settings.resolved_cookie_secure is True
    )

    @app.middleware("http")
    async def count_requests(request: Request, call_next):  # type: ignore[no-untyped-def]
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        state.metrics.http_requests.labels(request.method, path, str(response.status_code)).inc()
        return response

    # Outermost: every layer inside sees the client address a trusted proxy forwarded.
    app.add_middleware(TrustedProxyMiddleware, trusted=settings.trusted_proxies)
    return app


_V2_INFER = r"/v2/models/[^/]+(/versions/[^/]+)?/infer"


def _refusal_body(
    scope: MutableMapping[str, Any], status: int, message: str, reason: str, extra: dict[str, Any]
) -> dict[str, Any]:
    # Every /v2 answer carries its error as "error", which V2 clients read.
    key = "error" if scope.get("path", "").startswith("/v2") else "detail"
    return {key: message, "reason": reason, **extra}


def _add_http_limits(app: FastAPI, state: ApiState) -> None:
    """Body limits per route and credentials before bodies (shared/http_limits.py)."""
    from cloud_service.api.routes.v2 import MAX_BODY_BYTES
    from cloud_service.security import CredentialGate
    from cloud_service.ui.auth import SessionSigner
    from cloud_service.web.deps import bearer_principal

    settings = state.settings
    signer = SessionSigner(settings.session_secret.get_secret_value())
    metrics_token = settings.metrics_token.get_secret_value() if settings.metrics_token else None
    gate = CredentialGate(
        admin_token=settings.admin_token.get_secret_value(),
        principal=lambda token: bearer_principal(state, token),
        session_valid=lambda cookie: signer.load(cookie) is not None,
        v2_auth=settings.resolved_v2_auth,
        docs_public=settings.resolved_docs_public,
        metrics_auth=settings.resolved_metrics_auth,
        metrics_token=metrics_token,
    )
    app.add_middleware(
        HttpLimitsMiddleware,
        default_max_bytes=settings.http_max_body_bytes,
        default_accepts="a JSON body or a form",
        rules=[
            BodyRule(
                r"/v1/models",
                settings.http_max_model_bytes,
                "multipart/form-data with a 'file' part (the ONNX model), or JSON {\"path\": ...}",
                methods=frozenset({"POST"}),
            ),
            BodyRule(
                _V2_INFER,
                settings.http_max_infer_bytes or MAX_BODY_BYTES,
                "a KServe V2 infer request: JSON, or a JSON header and binary tensors",
                methods=frozenset({"POST"}),
            ),
        ],
        gate=gate,
        body_gate=gate.before_body,
        render=_refusal_body,
    )
