"""One run of a distillation job: its parameters, scratch folder, random stream and report.

Shared by the job's task paths (``cloud_service.jobs.runner`` for classifiers,
``cloud_service.jobs.detection`` for detectors).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from cloud_service.jobs.context import JobContext
from cloud_service.jobs.params import JobParams
from cloud_service.jobs.services import PipelineServices, blob_to_file
from cloud_service.jobs.snapshot import FleetState, ServingStudent
from distill.distillation import Recipe, checkpoint_beside

__all__ = ["JobReport", "JobRun", "warm_start_candidates"]


class JobReport:
    """The job's log and progress (to the worker, and the console when one watches),
    and how long each step took."""

    def __init__(self, ctx: JobContext, console: Callable[[int, str, float], None] | None):
        self._ctx, self._console = ctx, console
        self._started = self._mark = time.perf_counter()
        self.timings: dict[str, float] = {}

    def log(self, message: str, level: str = "info") -> None:
        self._ctx.log(message, level=level)

    def progress(self, phase: str, percent: float) -> None:
        self._ctx.progress(phase, percent)
        if self._console is not None:
            self._console(self._ctx.job_id, phase, percent)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = round(now - self._mark, 2)
        self._mark = now

    def times(self) -> dict[str, Any]:
        return {"timings": self.timings, "wall_s": round(time.perf_counter() - self._started, 2)}


@dataclass(frozen=True)
class JobRun:
    """One run of a job: its context, parameters, scratch folder and random stream."""

    ctx: JobContext
    services: PipelineServices
    params: JobParams
    recipe: Recipe
    work: Path
    rng: np.random.Generator
    report: JobReport

    @classmethod
    def start(cls, ctx: JobContext, services: PipelineServices) -> JobRun:
        p = JobParams.from_dict(ctx.params)
        return cls(
            ctx=ctx,
            services=services,
            params=p,
            recipe=Recipe(**{f.name: getattr(p, f.name) for f in fields(Recipe)}),
            work=Path(tempfile.mkdtemp(prefix=f"job-{ctx.job_id}-", dir=services.work_dir)),
            rng=np.random.default_rng([p.seed, ctx.job_id]),
            report=JobReport(ctx, services.console_progress),
        )


def warm_start_candidates(
    job: JobRun, fleet: FleetState, student: ServingStudent
) -> list[tuple[str, Path]]:
    """Where a warm start may come from, in order of preference, each with its name."""
    services, p = job.services, job.params
    found: list[tuple[str, Path]] = []
    parent = fleet.parent_checkpoint
    if parent and services.blobs.exists(str(parent)):
        path = blob_to_file(services.blobs, str(parent), job.work / "parent.pt")
        found.append((f"the serving student (job {fleet.parent_job_id})", path))
    if p.base_checkpoint:
        found.append((f"base_checkpoint {p.base_checkpoint}", Path(p.base_checkpoint)))
    if fleet.serving is None:
        beside = checkpoint_beside(student.path)
        found.append((f"{beside} (beside the serving student)", beside))
    if services.base_checkpoint is not None:
        found.append((f"{services.base_checkpoint}", services.base_checkpoint))
    return found
