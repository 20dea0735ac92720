"""What a running job sees: its parameters, progress, log, and the checks that stop it.

``JobContext.check()`` raises when the job must stop (the runner calls it between
steps, every training step):

- ``JobCancelled`` when a cancel was asked for: the job ends ``cancelled``;
- ``LeaseLost`` when the lease is gone: the worker drops the job without writing;
- ``JobTimeout`` past the job's wall-time limit: the job ends ``failed``;
- ``WorkerStopping`` on SIGTERM: the job is put back in the queue for another worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from cloud_service.jobs import queue as jobs
from cloud_service.jobs.queue import JobCancelled, LeaseLost
from shared.errors import EdgeLoopError

__all__ = ["JobContext", "JobOutcome", "JobTimeout", "Runner", "WorkerStopping"]

log = logging.getLogger(__name__)


class JobTimeout(EdgeLoopError):
    """The job ran past its wall-time limit."""

    reason = "timeout"


class WorkerStopping(EdgeLoopError):
    """The worker was asked to stop (SIGTERM); the job goes back to the queue."""

    reason = "stopping"


@dataclass
class JobOutcome:
    """What a finished job hands back to the worker."""

    metrics: dict[str, Any] = field(default_factory=dict)
    result_version: str | None = None
    snapshot_id: int | None = None


class JobContext:
    """What a running job may do: read its params, report progress, log, and check in."""

    def __init__(
        self,
        *,
        job_id: int,
        params: dict[str, Any],
        attempt: int,
        owner: str,
        sessions: sessionmaker[Session],
        wall_time_s: float | None,
        stopping: threading.Event,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job_id = job_id
        self.params = params
        self.attempt = attempt
        self.owner = owner
        self.sessions = sessions
        self.wall_time_s = wall_time_s
        self._clock = clock
        self.started = clock()
        self.cancelled = threading.Event()
        self.lease_lost = threading.Event()
        self._stopping = stopping
        self._lock = threading.Lock()
        self.phase = "claimed"
        self.percent = 0.0
        self.eta_s: float | None = None

    def progress(self, phase: str, percent: float, eta_s: float | None = None) -> None:
        """Record progress; it reaches the database with the next heartbeat."""
        with self._lock:
            self.phase, self.percent = phase, max(0.0, min(100.0, percent))
            if eta_s is None and self.percent > 1.0:
                elapsed = self._clock() - self.started
                eta_s = elapsed * (100.0 - self.percent) / self.percent
            self.eta_s = eta_s
        self.check()

    def snapshot(self) -> tuple[str, float, float | None]:
        with self._lock:
            return self.phase, self.percent, self.eta_s

    def log(self, message: str, level: str = "info") -> None:
        log.info("job %d: %s", self.job_id, message)
        with self.sessions.begin() as session:
            jobs.append_log(session=session, job_id=self.job_id, message=message, level=level)

    def check(self) -> None:
        """Raise if the job must stop now (cancelled, lease lost, past its wall time, stopping)."""
        if self.lease_lost.is_set():
            raise LeaseLost(f"job {self.job_id}: lease lost")
        if self.cancelled.is_set():
            raise JobCancelled(f"job {self.job_id} was cancelled")
        if self._stopping.is_set():
            raise WorkerStopping(f"worker {self.owner} is stopping")
        if self.wall_time_s is not None and self._clock() - self.started > self.wall_time_s:
            raise JobTimeout(
                f"job {self.job_id} ran past its wall-time limit of {self.wall_time_s:g} s"
            )


Runner = Callable[[JobContext], JobOutcome]
