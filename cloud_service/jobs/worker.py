"""The distill worker: claim a job, keep its lease alive, run it, record how it ended.

    worker = DistillWorker(sessions, owner="worker-1", runner=run_job)
    worker.run(stop=threading.Event())        # until stopped; or worker.run_once()

One job at a time per worker; run more workers (processes) to run more jobs. While a
job runs, a heartbeat thread renews the lease every ``heartbeat_s`` and carries the
job's latest progress to the database; it also brings back a cancel request. The
job sees both through ``JobContext.check()`` (``cloud_service.jobs.context``), which
the pipeline calls between steps (every training step), and which raises:

- ``JobCancelled`` when a cancel was asked for: the job ends ``cancelled``;
- ``LeaseLost`` when the lease is gone: the worker drops the job without writing;
- ``JobTimeout`` past the job's wall-time limit: the job ends ``failed``;
- ``WorkerStopping`` on SIGTERM: the job is put back in the queue for another worker.

A worker that dies mid-job stops renewing; the next ``reap_expired`` (every worker
runs it before it claims) requeues the job, up to its ``max_attempts``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from cloud_service.announce import MqttAnnouncer
from cloud_service.blobs import open_blob_store
from cloud_service.db.session import make_engine, make_session_factory, upgrade_database
from cloud_service.jobs import queue as jobs
from cloud_service.jobs.context import JobContext, JobOutcome, JobTimeout, Runner, WorkerStopping
from cloud_service.jobs.health import HealthServer
from cloud_service.jobs.queue import JobCancelled, LeaseLost
from cloud_service.jobs.runner import PipelineServices, make_runner
from cloud_service.jobs.tables import DistillJob
from cloud_service.settings import CloudSettings
from cloud_service.web.state import load_signing_key
from distill.cache import reference_model_path
from shared.errors import EdgeLoopError
from shared.lifecycle import Workers

__all__ = [
    "DistillWorker",
    "JobContext",
    "JobOutcome",
    "JobTimeout",
    "WorkerStopping",
    "default_owner",
    "serve_worker",
]

log = logging.getLogger(__name__)


def _reason(exc: BaseException) -> str:
    """One line a person can act on: our errors' message, else the exception's type and text."""
    if isinstance(exc, EdgeLoopError):
        text = exc.message
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return " ".join(text.split())[:500]


def default_owner() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class DistillWorker:
    """Claims and runs jobs until stopped."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        runner: Runner,
        owner: str | None = None,
        lease_s: float = 30.0,
        heartbeat_s: float | None = None,
        poll_s: float = 1.0,
        default_wall_time_s: float | None = 3600.0,
        beat_s: float = 10.0,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be > 0")
        self.sessions = sessions
        self.runner = runner
        self.owner = owner or default_owner()
        self.lease_s = lease_s
        # Three heartbeats per lease: one lost beat (a slow commit) does not lose the job.
        self.heartbeat_s = heartbeat_s or lease_s / 3.0
        self.poll_s = poll_s
        self.default_wall_time_s = default_wall_time_s
        # The worker's own registration (distill_workers): renewed every beat_s, it counts
        # as gone three missed beats later, so a queue with nobody to take it shows.
        self.beat_s = beat_s
        self.clock = clock
        self._last_beat: datetime | None = None
        self.stopping = threading.Event()
        self.current: JobContext | None = None
        self.finished: list[tuple[int, str]] = []  # (job id, final state) for this worker
        # For probes: when the claim loop or a job's heartbeat last went round (alive, even
        # when the database did not answer: an outage must not restart every replica).
        self.last_contact = time.monotonic()
        self.database_ok = True

    def health(self) -> tuple[bool, bool, str]:
        """(alive, ready, why): alive while the loop or the running job's heartbeat goes
        round; ready while the last database round trip succeeded."""
        running = self.current is not None
        # A claim loop polls every poll_s; a running job renews its lease every heartbeat_s.
        limit = 3 * (self.heartbeat_s if running else self.poll_s) + 30.0
        quiet = time.monotonic() - self.last_contact
        alive = quiet <= limit
        why = f"{'running a job' if running else 'idle'}; loop last went round {quiet:.0f} s ago"
        return alive, alive and self.database_ok, why

    def stop(self) -> None:
        self.stopping.set()

    def beat(self, *, force: bool = False) -> None:
        """Register this worker, or renew its registration once ``beat_s`` has passed."""
        now = self.clock()
        last = self._last_beat
        if not force and last is not None and (now - last).total_seconds() < self.beat_s:
            return
        current = self.current
        with self.sessions.begin() as session:
            jobs.beat_worker(
                session=session,
                owner=self.owner,
                host=socket.gethostname(),
                pid=os.getpid(),
                ttl_s=3 * self.beat_s,
                job_id=None if current is None else current.job_id,
                now=now,
            )
        self._last_beat = now

    def unregister(self) -> None:
        """Remove this worker's registration (a clean stop); a failure only logs."""
        try:
            with self.sessions.begin() as session:
                jobs.remove_worker(session=session, owner=self.owner)
        except SQLAlchemyError as exc:
            log.warning("could not unregister distill worker %s: %s", self.owner, exc)

    def run(self, *, max_jobs: int | None = None, idle_exit_s: float | None = None) -> int:
        """Claim and run jobs until ``stop()`` (or ``max_jobs`` run, or idle that long)."""
        try:
            return self._loop(max_jobs=max_jobs, idle_exit_s=idle_exit_s)
        finally:
            self.unregister()

    def _loop(self, *, max_jobs: int | None, idle_exit_s: float | None) -> int:
        ran, idle_since = 0, time.monotonic()
        while not self.stopping.is_set():
            if max_jobs is not None and ran >= max_jobs:
                break
            try:
                self.beat()
                job_id = self.run_once()
            except SQLAlchemyError as exc:  # the database is away: not ready, try again
                self.database_ok = False
                self.last_contact = time.monotonic()  # the loop itself is alive
                log.warning("cannot claim a job: %s", exc)
                self.stopping.wait(self.poll_s)
                continue
            self.database_ok = True
            self.last_contact = time.monotonic()
            if job_id is not None:
                ran += 1
                idle_since = time.monotonic()
                continue
            if idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                break
            self.stopping.wait(self.poll_s)
        return ran

    def run_once(self) -> int | None:
        """Requeue expired leases, claim one job and run it; the job's id, or None."""
        with self.sessions.begin() as session:
            jobs.reap_expired(session=session)
        with self.sessions.begin() as session:
            job = jobs.claim(session=session, owner=self.owner, lease_s=self.lease_s)
            if job is None:
                return None
            job_id, params, attempt = job.id, dict(job.params), job.attempts
        wall = params.get("wall_time_s", self.default_wall_time_s)
        ctx = JobContext(
            job_id=job_id,
            params=params,
            attempt=attempt,
            owner=self.owner,
            sessions=self.sessions,
            wall_time_s=float(wall) if wall is not None else None,
            stopping=self.stopping,
        )
        self.current = ctx
        beat = Workers(f"job-{job_id}")  # the lease renewal: thread job-{id}-lease
        beat.spawn("lease", lambda: self._heartbeat(ctx, beat.stopping))
        try:
            state = self._run(ctx)
        finally:
            beat.stop(timeout=10)
            self.current = None
        self.finished.append((job_id, state))
        return job_id

    def _run(self, ctx: JobContext) -> str:
        try:
            outcome = self.runner(ctx)
        except LeaseLost:
            log.warning("job %d: lease lost; dropped without writing", ctx.job_id)
            return "lost"
        except JobCancelled:
            return self._end(ctx, "cancelled", error="cancelled on request")
        except WorkerStopping:
            return self._requeue(ctx, "worker stopped (SIGTERM); requeued for another worker")
        except JobTimeout as exc:
            return self._end(ctx, "failed", error=str(exc))
        except Exception as exc:  # the job's own failure: its reason in the job, the trace here
            detail = _reason(exc)
            if isinstance(exc, EdgeLoopError):  # a known condition: its message says it all
                log.warning("job %d failed: %s", ctx.job_id, detail)
            else:  # a bug: the traceback belongs in this log (the job's log has the reason)
                log.exception("job %d failed: %s", ctx.job_id, detail)
            return self._end(ctx, "failed", error=detail)
        return self._end(
            ctx,
            "succeeded",
            metrics=outcome.metrics,
            result_version=outcome.result_version,
            snapshot_id=outcome.snapshot_id,
        )

    def _end(
        self,
        ctx: JobContext,
        state: str,
        *,
        error: str | None = None,
        metrics: dict[str, Any] | None = None,
        result_version: str | None = None,
        snapshot_id: int | None = None,
    ) -> str:
        try:
            with self.sessions.begin() as session:
                jobs.finish(
                    session=session,
                    job_id=ctx.job_id,
                    owner=self.owner,
                    state=state,
                    error=error,
                    metrics=metrics,
                    result_version=result_version,
                    snapshot_id=snapshot_id,
                )
        except LeaseLost:
            log.warning("job %d: lease lost before it could be marked %s", ctx.job_id, state)
            return "lost"
        return state

    def _requeue(self, ctx: JobContext, message: str) -> str:
        with self.sessions.begin() as session:
            result = session.execute(
                update(DistillJob)
                .where(DistillJob.id == ctx.job_id, DistillJob.lease_owner == self.owner)
                .values(
                    state="queued",
                    lease_owner=None,
                    lease_expires_at=None,
                    phase="requeued",
                    # A graceful stop is not the job's fault: give the attempt back.
                    attempts=DistillJob.attempts - 1,
                )
                .execution_options(synchronize_session=False)
            )
            if result.rowcount == 1:  # type: ignore[attr-defined]
                jobs.append_log(session=session, job_id=ctx.job_id, message=message)
        return "queued"

    def _heartbeat(self, ctx: JobContext, stop: threading.Event) -> None:
        while not stop.wait(self.heartbeat_s):
            phase, percent, eta = ctx.snapshot()
            try:
                with self.sessions.begin() as session:
                    cancel = jobs.renew(
                        session=session,
                        job_id=ctx.job_id,
                        owner=self.owner,
                        lease_s=self.lease_s,
                        phase=phase,
                        percent=percent,
                        eta_s=eta,
                        now=datetime.now(UTC),
                    )
            except LeaseLost:
                ctx.lease_lost.set()
                return
            except Exception as exc:  # a database hiccup: try again next beat
                log.warning("job %d: heartbeat failed: %s", ctx.job_id, exc)
                self.last_contact = time.monotonic()
                continue
            self.last_contact = time.monotonic()
            try:
                self.beat()
            except SQLAlchemyError as exc:
                log.warning("distill worker %s: registration beat failed: %s", self.owner, exc)
            if cancel:
                ctx.cancelled.set()


def _installed_or_reference(installed: Path, alias: str) -> Path | None:
    """A model installed for serving (``edgeloop models install``), else the cached
    reference one, else None."""
    if installed.is_file():
        return installed
    try:
        return reference_model_path(alias)
    except EdgeLoopError:
        return None


def serve_worker(
    settings: CloudSettings,
    *,
    lease_s: float = 30.0,
    poll_s: float = 2.0,
    max_jobs: int | None = None,
    health_host: str = "0.0.0.0",
    health_port: int | None = None,
    on_start: Callable[[DistillWorker], None] | None = None,
) -> DistillWorker:
    """Run a distill worker over ``settings`` in this thread until it is stopped (SIGTERM
    and SIGINT stop it when this is the main thread); returns the stopped worker."""
    url = settings.resolved_database_url
    upgrade_database(url)
    engine = make_engine(url)
    sessions = make_session_factory(engine)
    work_dir = settings.data_dir / "distill"
    work_dir.mkdir(parents=True, exist_ok=True)
    models_dir = settings.data_dir / "models"
    services = PipelineServices(
        sessions=sessions,
        blobs=open_blob_store(settings),
        work_dir=work_dir,
        signing_key=load_signing_key(settings),
        announcer=MqttAnnouncer(settings.mqtt, client_id=f"{settings.announcer_client_id}-distill"),
        topics=settings.topics,
        base_checkpoint=_installed_or_reference(models_dir / "student.pt", "student.pt"),
        serving_model=_installed_or_reference(models_dir / "student.onnx", "student-int8"),
        teacher_model=_installed_or_reference(settings.resolved_teacher_model, "teacher"),
    )
    worker = DistillWorker(sessions, runner=make_runner(services), lease_s=lease_s, poll_s=poll_s)
    if threading.current_thread() is threading.main_thread():

        def on_signal(signum: int, frame: Any) -> None:
            log.info("signal %d: distill worker stops after handing back its job", signum)
            worker.stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    probes: AbstractContextManager[Any] = (
        HealthServer(worker.health, health_host, health_port)
        if health_port is not None
        else nullcontext()
    )
    try:
        with probes:
            if on_start is not None:
                on_start(worker)
            worker.run(max_jobs=max_jobs)
    finally:
        if services.announcer is not None:
            services.announcer.close()
        engine.dispose()
    return worker
