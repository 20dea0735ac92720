"""Process lifecycles: ``cloud-service api``, ``verifier`` and ``all``.

Each runs uvicorn in the foreground; uvicorn turns SIGTERM/SIGINT into a graceful
stop, after which the verifier (if any) stops taking messages, finishes the
batches in hand, flushes receipts and disconnects. Work not finished is safe: a
message is acked only once stored, and stored samples without a verdict are
picked up again at the next start.

``cloud-service verifier --workers N`` runs N verifier processes under one
supervisor (``run_verifiers``). One process's Python threads share one
interpreter lock, which its MQTT, storage and verdict work fill before the cores
are busy (``docs/performance.md``, cloud: cores busy with one verifier process
and with two); N processes on
the broker's shared subscription split the samples between them, each with its
own lock. The supervisor starts a worker again when it dies and stops them all on
SIGTERM/SIGINT.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.context import SpawnProcess
from typing import Any

import uvicorn
from fastapi import FastAPI

from cloud_service.api.app import create_app
from cloud_service.db.session import upgrade_database
from cloud_service.settings import CloudSettings
from cloud_service.verifier_ingest import auto_decode_threads
from cloud_service.worker import VerifierWorker
from shared.console import configure_logging
from shared.errors import ConfigError
from shared.http_server import server_config
from shared.lifecycle import Workers
from shared.mqtt import negotiate_protocol

__all__ = [
    "DistillSupervisor",
    "run_all",
    "run_api",
    "run_verifier",
    "run_verifiers",
    "worker_settings",
]

log = logging.getLogger(__name__)


def _serve(app: FastAPI, host: str, port: int, log_level: str) -> None:
    # uvicorn stops gracefully on SIGTERM and then re-raises the signal to the
    # handler that was there before it; a no-op one here lets us return and run
    # the verifier's own orderly stop instead of dying on the default handler.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    settings: CloudSettings = app.state.edgeloop.settings
    config = server_config(
        app,
        host=host,
        port=port,
        limits=settings.http_server_limits,
        log_level=log_level.lower(),
        access_log=False,
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
    """API and verifier in one process, for one host, and a distill worker process beside
    them unless ``distill_worker`` is off."""
    if settings.verifier_workers > 1:
        log.warning(
            "cloud-service all runs one verifier; verifier_workers=%d applies to"
            " `cloud-service verifier` only",
            settings.verifier_workers,
        )
    # The schema first, so the distill worker process finds it current instead of racing.
    upgrade_database(settings.resolved_database_url)
    distill = DistillSupervisor(settings) if settings.distill_worker else None
    if distill is not None:
        distill.start()
    worker = VerifierWorker(settings)
    worker.start()
    try:
        _serve(create_app(settings, worker=worker), host, port, settings.log_level)
    finally:
        worker.stop()
        if distill is not None:
            distill.stop()


def _distill_process(settings: CloudSettings) -> None:
    from cloud_service.jobs.worker import serve_worker

    configure_logging(settings.log_level)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # the parent migrated already
    serve_worker(settings)


class DistillSupervisor:
    """The distill worker of ``cloud-service all``: a process of its own (training takes
    cores and the interpreter lock, which the verifier's batches need), started again
    when it dies, stopped (its job requeued) with SIGTERM."""

    def __init__(self, settings: CloudSettings) -> None:
        self.settings = settings
        self._context = multiprocessing.get_context("spawn")
        self.workers = Workers("distill")
        self._stop = self.workers.stopping
        self._process: SpawnProcess | None = None

    def start(self) -> None:
        self.workers.spawn("supervisor", self._watch)

    def health(self) -> dict[str, object]:
        process = self._process
        return {
            "alive": self.workers.alive,
            "worker_pid": process.pid if process is not None and process.is_alive() else None,
        }

    def _launch(self) -> SpawnProcess:
        process = self._context.Process(
            target=_distill_process, args=(self.settings,), name="distill-worker"
        )
        process.start()
        log.info("distill worker started (pid %s)", process.pid)
        return process

    def _watch(self) -> None:
        backoff_s = 1.0
        while not self._stop.is_set():
            started = time.monotonic()
            self._process = self._launch()
            while self._process.is_alive() and not self._stop.wait(0.5):
                pass
            if self._stop.is_set():
                return
            ran = time.monotonic() - started
            backoff_s = 1.0 if ran >= _HEALTHY_RUN_S else min(backoff_s * 2, _MAX_BACKOFF_S)
            log.warning(
                "distill worker exited with code %s after %.0f s; starting it again in %.0f s",
                self._process.exitcode,
                ran,
                backoff_s,
            )
            self._stop.wait(backoff_s)

    def stop(self) -> None:
        self.workers.stop(timeout=5)
        if self._process is not None:
            _stop_all([self._process])


def worker_settings(settings: CloudSettings, index: int, workers: int) -> CloudSettings:
    """The settings of verifier ``index`` of ``workers`` on one host.

    Worker 0 keeps the configured MQTT client id (so going from one verifier to
    several keeps its broker session); worker i adds ``-w{i}``. When ONNX Runtime
    picks its own thread count (``ort_intra_op_threads = 0``), the cores are split
    between the workers instead of each taking them all; so are the decode threads
    (``verifier_decode_threads = 0``).
    """
    if workers == 1:
        return settings
    update: dict[str, Any] = {
        "verifier_workers": 1,
        "verifier_client_id": (
            settings.verifier_client_id if index == 0 else f"{settings.verifier_client_id}-w{index}"
        ),
    }
    cores = max(1, (os.cpu_count() or 1) // workers)
    if settings.ort_intra_op_threads == 0:
        update["ort_intra_op_threads"] = cores
    if settings.verifier_decode_threads == 0:
        update["verifier_decode_threads"] = auto_decode_threads(cores)
    return settings.model_copy(update=update)


def _verifier_process(settings: CloudSettings, host: str, port: int) -> None:
    configure_logging(settings.log_level)
    run_verifier(settings, host=host, port=port)


@dataclass
class _Slot:
    """One worker's place under the supervisor: its process, and the wait before its
    next start (1 s, doubling while it keeps dying within ``_HEALTHY_RUN_S``)."""

    index: int
    process: SpawnProcess | None = None
    started_at: float = 0.0
    restart_at: float = 0.0
    backoff_s: float = 1.0


# A worker that ran this long before dying is started again after the shortest wait.
_HEALTHY_RUN_S = 60.0
_MAX_BACKOFF_S = 30.0
_STOP_TIMEOUT_S = 30.0


def run_verifiers(settings: CloudSettings, *, host: str, port: int, workers: int) -> None:
    """``workers`` verifier processes; worker i serves /healthz, /readyz and /metrics
    on ``port + i``. Returns once every worker has stopped (SIGTERM/SIGINT)."""
    if workers == 1:
        run_verifier(settings, host=host, port=port)
        return
    url = settings.resolved_database_url
    if url.startswith("sqlite"):
        raise ConfigError(
            f"{workers} verifier workers need PostgreSQL (database_url): SQLite takes one"
            " writer at a time, so run one worker on it"
        )
    protocol = negotiate_protocol(settings.mqtt)
    if protocol != "5":
        raise ConfigError(
            f"{workers} verifier workers need a broker that speaks MQTT v5 (shared"
            f" subscriptions split the samples between them); the broker at"
            f" {settings.mqtt.host}:{settings.mqtt.port} speaks {protocol}: run one worker"
        )
    # Once here, so the workers find the schema current instead of racing to upgrade it.
    upgrade_database(url)
    stop = threading.Event()
    previous = {
        signum: signal.signal(signum, lambda *_: stop.set())
        for signum in (signal.SIGTERM, signal.SIGINT)
    }
    context = multiprocessing.get_context("spawn")
    slots = [_Slot(i) for i in range(workers)]

    def start(slot: _Slot) -> None:
        process = context.Process(
            target=_verifier_process,
            args=(worker_settings(settings, slot.index, workers), host, port + slot.index),
            name=f"verifier-{slot.index}",
        )
        process.start()
        slot.process, slot.started_at = process, time.monotonic()
        log.info(
            "verifier worker %d started (pid %s, health on port %d)",
            slot.index,
            process.pid,
            port + slot.index,
        )

    try:
        for slot in slots:
            start(slot)
        while not stop.wait(0.5):
            now = time.monotonic()
            for slot in slots:
                process = slot.process
                if process is not None and process.is_alive():
                    continue
                if process is not None:  # it died: wait, then start it again
                    ran = now - slot.started_at
                    if ran >= _HEALTHY_RUN_S:
                        slot.backoff_s = 1.0
                    delay, slot.backoff_s = slot.backoff_s, min(slot.backoff_s * 2, _MAX_BACKOFF_S)
                    slot.restart_at, slot.process = now + delay, None
                    log.warning(
                        "verifier worker %d exited with code %s after %.0f s; starting it"
                        " again in %.0f s",
                        slot.index,
                        process.exitcode,
                        ran,
                        delay,
                    )
                elif now >= slot.restart_at:
                    start(slot)
    finally:
        _stop_all([slot.process for slot in slots if slot.process is not None])
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _stop_all(processes: list[SpawnProcess]) -> None:
    """SIGTERM each worker (each stops in order, as one verifier does), then wait."""
    for process in processes:
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            log.error("verifier worker %s did not stop in time; killing it", process.name)
            process.kill()
            process.join(5)
