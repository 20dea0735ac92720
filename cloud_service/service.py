"""Process lifecycles: ``cloud-service api``, ``verifier`` and ``all``.

Each runs uvicorn in the foreground; uvicorn turns SIGTERM/SIGINT into a graceful
stop, after which the verifier (if any) stops taking messages, finishes the
batches in hand, flushes receipts and disconnects. Work not finished is safe: a
message is acked only once stored, and stored samples without a verdict are
picked up again at the next start.
"""

from __future__ import annotations

import logging
import signal

import uvicorn
from fastapi import FastAPI

from cloud_service.api.app import create_app
from cloud_service.settings import CloudSettings
from cloud_service.worker import VerifierWorker

__all__ = ["run_all", "run_api", "run_verifier"]

log = logging.getLogger(__name__)


def _serve(app: FastAPI, host: str, port: int, log_level: str) -> None:
    # uvicorn stops gracefully on SIGTERM and then re-raises the signal to the
    # handler that was there before it; a no-op one here lets us return and run
    # the verifier's own orderly stop instead of dying on the default handler.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level.lower(), access_log=False
    )
    uvicorn.Server(config).run()


def run_api(settings: CloudSettings, *, host: str, port: int) -> None:
    """The REST API and the KServe V2 endpoints."""
    _serve(create_app(settings), host, port, settings.log_level)


def run_verifier(settings: CloudSettings, *, host: str, port: int) -> None:
    """Ingest and verification, with /healthz, /readyz and /metrics on ``port``."""
    worker = VerifierWorker(settings)
    worker.start()
    try:
        _serve(
            create_app(settings, worker=worker, health_only=True), host, port, settings.log_level
        )
    finally:
        worker.stop()


def run_all(settings: CloudSettings, *, host: str, port: int) -> None:
    """API and verifier in one process, for one host."""
    worker = VerifierWorker(settings)
    worker.start()
    try:
        _serve(create_app(settings, worker=worker), host, port, settings.log_level)
    finally:
        worker.stop()
