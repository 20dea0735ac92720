"""The closed loop's cloud side, on a running ``Stack`` with the API in this process.

``LoopCloud`` registers and promotes the serving student, creates the drift trigger
(teacher disagreement over ``DISAGREEMENT_BOUND`` on at least 50 samples in the last
hour queues a distillation job), waits for the verifier to catch up, counts newly
verified samples, ticks the trigger, and runs the job a firing queued on a distill
worker in this process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import case, func, select

from cloud_service import registry
from cloud_service.db.models import Sample, Verdict
from cloud_service.jobs import queue as jobs
from cloud_service.jobs import schedules
from cloud_service.jobs.runner import PipelineServices, make_runner
from cloud_service.jobs.snapshot import TRAINABLE_STATUSES
from cloud_service.jobs.worker import DistillWorker
from distill.scenario import ScenarioConfig
from simulations.stack import InProcessApi, Stack

__all__ = ["DISAGREEMENT_BOUND", "FLEET", "MODEL", "LoopCloud"]

FLEET = "demo"
MODEL = "edgeloop-student"
DISAGREEMENT_BOUND = 0.2  # the drift trigger: teacher disagreement over the window


class LoopCloud:
    """The registry, the drift trigger, the verified samples and the distill worker."""

    def __init__(self, stack: Stack) -> None:
        if not isinstance(stack.api, InProcessApi):
            raise TypeError("the closed loop drives an API in this process")
        self.stack = stack
        self.state = stack.state
        self.sessions = self.state.sessions
        self.announcer = stack.api.announcer
        self.worker: DistillWorker | None = None

    def seed(self, student: Any, params: dict[str, Any]) -> str:
        """Register and promote ``student`` (INT8) for the fleet; create the drift trigger
        whose jobs take ``params``. Returns the serving version."""
        key = self.state.signing_key
        with self.sessions.begin() as s:
            ref = registry.register_model(
                session=s,
                blobs=self.state.blobs,
                key=key,
                artifact=student,
                name=MODEL,
                format="int8",
            )
            registry.promote(
                session=s,
                announcer=self.announcer,
                topics=self.stack.topics,
                fleet=FLEET,
                name=MODEL,
                version=ref.version,
                key=key,
            )
            schedules.create_schedule(
                session=s,
                name="drift",
                kind="trigger",
                expression="drift",
                trigger={
                    "fleet": FLEET,
                    "window_s": 3600,
                    "max_disagreement": DISAGREEMENT_BOUND,
                    "min_samples": 50,
                },
                params=params,
            )
            return str(ref.version)

    def wait_verified(self, timeout: float = 120.0) -> int:
        """Wait until no stored sample is pending; the number of samples stored."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.sessions() as s:
                pending = s.scalar(
                    select(func.count()).select_from(Sample).where(Sample.status == "pending")
                )
            if not pending:
                break
            time.sleep(0.2)
        with self.sessions() as s:
            return int(s.scalar(select(func.count()).select_from(Sample)) or 0)

    def new_verified(self, since: datetime) -> tuple[int, int]:
        """(trainable samples verified since, of which the teacher disagreed with the edge)."""
        with self.sessions() as s:
            total, disagree = s.execute(
                select(
                    func.count(),
                    func.sum(case((Verdict.agrees_with_edge.is_(False), 1), else_=0)),
                )
                .select_from(Verdict)
                .join(Sample, Sample.sample_id == Verdict.sample_id)
                .where(
                    Sample.fleet == FLEET,
                    Sample.status.in_(TRAINABLE_STATUSES),
                    Verdict.verified_at > since,
                )
            ).one()
        return int(total or 0), int(disagree or 0)

    def tick(self) -> Any:
        """Tick the schedules once; the jobs a firing queued (empty when none fired)."""
        with self.sessions.begin() as s:
            return schedules.tick(session=s)

    def trigger(self, fired: Any = None) -> tuple[Any, Any]:
        """(the drift trigger's check now, the jobs it queued): ticked unless ``fired``
        already holds jobs an earlier tick queued."""
        with self.sessions.begin() as s:
            schedule = schedules.list_schedules(session=s)[0]
            check = schedules.evaluate_trigger(session=s, schedule=schedule, now=datetime.now(UTC))
            jobs_queued = fired if fired else schedules.tick(session=s)
        return check, jobs_queued

    def start_worker(
        self,
        models: Any,
        scenario: ScenarioConfig,
        progress: Callable[[int, str, float], None],
        work_dir: Path,
    ) -> None:
        """The distill worker that runs the jobs the trigger queues (one per ``run_next_job``)."""
        services = PipelineServices(
            sessions=self.sessions,
            blobs=self.state.blobs,
            work_dir=work_dir,
            signing_key=self.state.signing_key,
            announcer=self.announcer,
            topics=self.stack.topics,
            base_checkpoint=models.student_pt,
            teacher_model=models.teacher_onnx,
            scenario=scenario,
            console_progress=progress,
        )
        self.worker = DistillWorker(self.sessions, runner=make_runner(services), lease_s=30)

    def run_next_job(self) -> int | None:
        """Claim and run the next queued job; its id, or None when none was queued."""
        assert self.worker is not None, "start_worker first"
        return self.worker.run_once()

    def job_entry(self, job_id: int | None) -> dict[str, Any] | None:
        """What the job did: its state, the model it made, the gate's verdict, its metrics."""
        with self.sessions() as s:
            job = jobs.get_job(session=s, job_id=job_id) if job_id else None
            if job is None:
                return None
            return {
                "id": job.id,
                "state": job.state,
                "error": job.error,
                "version": job.result_version,
                "gate": job.metrics.get("gate"),
                "evaluation": job.metrics.get("evaluation"),
                "dataset": job.metrics.get("dataset"),
                "train": job.metrics.get("train"),
                "calibration": job.metrics.get("calibration"),
                "warm_start": job.metrics.get("warm_start"),
                "parent_version": job.metrics.get("parent_version"),
                "timings": job.metrics.get("timings"),
            }
