"""When distillation jobs are queued: cron expressions, intervals, and data triggers.

    create_schedule(session=s, name="nightly", kind="cron", expression="0 3 * * *")
    create_schedule(session=s, name="hourly", kind="interval", expression="3600")
    create_schedule(session=s, name="enough-data", kind="trigger", expression="new_samples",
                    trigger={"min_samples": 500})
    create_schedule(session=s, name="drift", kind="trigger", expression="drift",
                    trigger={"window_s": 900, "max_forward_rate": 0.3, "max_disagreement": 0.2})
    tick(session=s)   # queue what is due; the API runs this every few seconds

Cron is the classic five fields (minute hour day-of-month month day-of-week, UTC;
``*``, ``a-b``, ``*/n``, ``a-b/n`` and lists; day-of-week 0-7 with 0 and 7 Sunday; when
both day fields are restricted, either matching fires, as in cron).

Triggers:

- ``new_samples``: at least ``min_samples`` verified samples of the fleet since the
  serving model was registered (and since this schedule last fired).
- ``drift``: over the last ``window_s``, the fleet's forward rate (mean of the
  agents' reported ``forward_rate``) rises above ``max_forward_rate``, or the teacher
  disagrees with the edge on more than ``max_disagreement`` of the verified samples
  (with at least ``min_samples`` of them, so three samples cannot fire it).

A trigger never fires while a job it queued is still queued or running, nor within
``cooldown_s`` of its last firing. Exactly once with several API replicas: a due
schedule is claimed by a conditional ``UPDATE`` on its ``next_run_at`` / ``last_run_at``
(the row count says who won), on PostgreSQL under ``FOR UPDATE SKIP LOCKED``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import case, func, select, update
from sqlalchemy.orm import Session

from cloud_service.db.models import Agent, FleetModel, ModelVersion, Sample, Verdict
from cloud_service.errors import ConflictError, NotFoundError
from cloud_service.jobs import queue as jobs
from cloud_service.jobs.tables import SCHEDULE_KINDS, DistillJob, Schedule
from shared.errors import ContractError
from shared.lifecycle import Workers

__all__ = [
    "CronExpr",
    "SchedulerLoop",
    "TriggerCheck",
    "create_schedule",
    "delete_schedule",
    "evaluate_trigger",
    "get_schedule",
    "list_schedules",
    "parse_cron",
    "run_now",
    "set_enabled",
    "tick",
]

log = logging.getLogger(__name__)

TRIGGERS = ("new_samples", "drift")
_FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day-of-month", 1, 31), ("month", 1, 12))
_DOW = ("day-of-week", 0, 7)
_MIN_INTERVAL_S = 10.0


@dataclass(frozen=True)
class CronExpr:
    text: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    dom_any: bool
    dow_any: bool

    def _day_ok(self, t: datetime) -> bool:
        dom = t.day in self.days
        dow = (t.isoweekday() % 7) in self.weekdays
        if self.dom_any or self.dow_any:
            return dom and dow
        return dom or dow

    def next_after(self, after: datetime) -> datetime:
        """The first matching minute strictly after ``after`` (UTC)."""
        t = after.astimezone(UTC).replace(second=0, microsecond=0) + timedelta(minutes=1)
        limit = t + timedelta(days=366 * 5)  # Feb 29 on a Monday is rare, not never
        while t < limit:
            if t.month not in self.months:
                t = (t.replace(day=1, hour=0, minute=0) + timedelta(days=32)).replace(day=1)
                continue
            if not self._day_ok(t):
                t = t.replace(hour=0, minute=0) + timedelta(days=1)
                continue
            if t.hour not in self.hours:
                t = t.replace(minute=0) + timedelta(hours=1)
                continue
            if t.minute not in self.minutes:
                t += timedelta(minutes=1)
                continue
            return t
        raise ContractError(f"cron expression {self.text!r} never fires")


def _parse_field(text: str, name: str, lo: int, hi: int) -> frozenset[int]:
    values: set[int] = set()
    for part in text.split(","):
        base, _, step_text = part.partition("/")
        try:
            step = int(step_text) if step_text else 1
            if base == "*":
                start, end = lo, hi
            elif "-" in base:
                a, b = base.split("-", 1)
                start, end = int(a), int(b)
            else:
                start = int(base)
                end = hi if step_text else start
        except ValueError:
            raise ContractError(
                f"bad {name} field {text!r}: use *, N, A-B, */S, A-B/S or a comma list"
            ) from None
        if step < 1 or not (lo <= start <= hi and lo <= end <= hi) or start > end:
            raise ContractError(f"bad {name} field {text!r}: values must be in {lo}-{hi}")
        values.update(range(start, end + 1, step))
    return frozenset(values)


def parse_cron(text: str) -> CronExpr:
    """Parse a five-field cron expression; ContractError says which field is wrong."""
    parts = text.split()
    if len(parts) != 5:
        raise ContractError(
            f"cron expression {text!r} has {len(parts)} fields; expected 5:"
            " minute hour day-of-month month day-of-week (e.g. '0 3 * * *')"
        )
    minutes, hours, days, months = (
        _parse_field(p, name, lo, hi) for p, (name, lo, hi) in zip(parts[:4], _FIELDS, strict=True)
    )
    weekdays = frozenset(d % 7 for d in _parse_field(parts[4], *_DOW))
    expr = CronExpr(
        text=" ".join(parts),
        minutes=minutes,
        hours=hours,
        days=days,
        months=months,
        weekdays=weekdays,
        dom_any=parts[2] == "*",
        dow_any=parts[4] == "*",
    )
    expr.next_after(datetime(2000, 1, 1, tzinfo=UTC))  # refuses e.g. "0 0 31 2 *"
    return expr


def _interval(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise ContractError(f"interval {text!r} must be a number of seconds") from None
    if not seconds >= _MIN_INTERVAL_S:
        raise ContractError(f"interval must be at least {_MIN_INTERVAL_S:g} s, got {text}")
    return seconds


_TRIGGER_KEYS = {
    "new_samples": {"min_samples", "fleet", "cooldown_s"},
    "drift": {
        "window_s",
        "max_forward_rate",
        "max_disagreement",
        "min_samples",
        "fleet",
        "cooldown_s",
    },
}


def _check_trigger(kind: str, trigger: Mapping[str, Any]) -> dict[str, Any]:
    if kind not in TRIGGERS:
        raise ContractError(f"unknown trigger {kind!r}; triggers: {', '.join(TRIGGERS)}")
    extra = set(trigger) - _TRIGGER_KEYS[kind]
    if extra:
        raise ContractError(
            f"unknown {kind} trigger setting {sorted(extra)[0]!r};"
            f" accepted: {', '.join(sorted(_TRIGGER_KEYS[kind]))}"
        )
    out = dict(trigger)
    for key in ("min_samples", "window_s", "cooldown_s"):
        if key in out and (not isinstance(out[key], (int, float)) or out[key] < 0):
            raise ContractError(f"trigger setting {key!r} must be a number >= 0")
    for key in ("max_forward_rate", "max_disagreement"):
        if key in out and (not isinstance(out[key], (int, float)) or not 0 <= out[key] <= 1):
            raise ContractError(f"trigger setting {key!r} must be a rate in [0, 1]")
    if kind == "new_samples":
        out.setdefault("min_samples", 500)
    if kind == "drift":
        if "max_forward_rate" not in out and "max_disagreement" not in out:
            raise ContractError("a drift trigger needs max_forward_rate or max_disagreement")
        out.setdefault("window_s", 900)
        out.setdefault("min_samples", 30)
    return out


def _next_run(kind: str, expression: str, after: datetime) -> datetime | None:
    if kind == "cron":
        return parse_cron(expression).next_after(after)
    if kind == "interval":
        return after + timedelta(seconds=_interval(expression))
    return None


def create_schedule(
    *,
    session: Session,
    name: str,
    kind: str,
    expression: str,
    trigger: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
    enabled: bool = True,
    now: datetime | None = None,
) -> Schedule:
    """Add a schedule; every part is checked, with a message naming what is wrong."""
    now = now or datetime.now(UTC)
    if kind not in SCHEDULE_KINDS:
        raise ContractError(f"unknown schedule kind {kind!r}; kinds: {', '.join(SCHEDULE_KINDS)}")
    if not name or len(name) > 64:
        raise ContractError("a schedule needs a name of 1-64 characters")
    if session.scalars(select(Schedule.id).where(Schedule.name == name)).first() is not None:
        raise ConflictError(f"a schedule named {name!r} exists already")
    checked_trigger: dict[str, Any] = {}
    if kind == "trigger":
        checked_trigger = _check_trigger(expression, trigger or {})
    elif trigger:
        raise ContractError("trigger settings belong to schedules of kind 'trigger'")
    schedule = Schedule(
        name=name,
        kind=kind,
        expression=expression.strip(),
        trigger=checked_trigger,
        params=jobs.validate_params(params or {}),
        enabled=enabled,
        next_run_at=_next_run(kind, expression, now),
        created_at=now,
    )
    session.add(schedule)
    session.flush()
    return schedule


def get_schedule(*, session: Session, schedule_id: int) -> Schedule:
    schedule = session.get(Schedule, schedule_id)
    if schedule is None:
        raise NotFoundError(f"no schedule {schedule_id}")
    return schedule


def list_schedules(*, session: Session) -> list[Schedule]:
    return list(session.scalars(select(Schedule).order_by(Schedule.id)).all())


def set_enabled(
    *, session: Session, schedule_id: int, enabled: bool, now: datetime | None = None
) -> Schedule:
    schedule = get_schedule(session=session, schedule_id=schedule_id)
    schedule.enabled = enabled
    if enabled and schedule.kind != "trigger":
        schedule.next_run_at = _next_run(
            schedule.kind, schedule.expression, now or datetime.now(UTC)
        )
    session.flush()
    return schedule


def delete_schedule(*, session: Session, schedule_id: int) -> None:
    session.delete(get_schedule(session=session, schedule_id=schedule_id))
    session.flush()


def run_now(*, session: Session, schedule_id: int, now: datetime | None = None) -> DistillJob:
    """Queue the schedule's job at once (whether or not it is enabled or due)."""
    now = now or datetime.now(UTC)
    schedule = get_schedule(session=session, schedule_id=schedule_id)
    job = jobs.enqueue(
        session=session,
        params=schedule.params,
        reason=f"schedule {schedule.name}: run now",
        schedule_id=schedule.id,
        now=now,
    )
    schedule.last_run_at, schedule.last_job_id = now, job.id
    session.flush()
    return job


# ---------------------------------------------------------------------------------
# Triggers


@dataclass(frozen=True)
class TriggerCheck:
    fire: bool
    reason: str
    stats: dict[str, Any]


def _fleet(schedule: Schedule) -> str:
    return str(schedule.trigger.get("fleet") or schedule.params.get("fleet") or "default")


def _busy(session: Session, schedule: Schedule) -> bool:
    return (
        session.scalars(
            select(DistillJob.id).where(
                DistillJob.schedule_id == schedule.id,
                DistillJob.state.in_(("queued", "running")),
            )
        ).first()
        is not None
    )


def evaluate_trigger(*, session: Session, schedule: Schedule, now: datetime) -> TriggerCheck:
    """Whether a trigger schedule's condition holds now, and the figures it looked at."""
    t, fleet = schedule.trigger, _fleet(schedule)
    if _busy(session, schedule):
        return TriggerCheck(False, "a job of this schedule is queued or running", {})
    cooldown = float(t.get("cooldown_s", 0))
    if schedule.last_run_at is not None and now - schedule.last_run_at < timedelta(
        seconds=cooldown
    ):
        return TriggerCheck(False, "cooling down", {})
    trainable = Sample.status.in_(("verified", "reviewed", "flagged"))
    if schedule.expression == "new_samples":
        since = schedule.last_run_at
        current = session.get(FleetModel, fleet)
        if current is not None:
            created = session.scalars(
                select(ModelVersion.created_at).where(
                    ModelVersion.name == current.model_name,
                    ModelVersion.version == current.version,
                )
            ).first()
            if created is not None and (since is None or created > since):
                since = created
        stmt = select(func.count()).select_from(Sample).where(Sample.fleet == fleet, trainable)
        if since is not None:
            stmt = stmt.where(Sample.verified_at > since)
        count = int(session.scalar(stmt) or 0)
        need = int(t["min_samples"])
        stats = {"new_verified": count, "min_samples": need, "since": str(since)}
        if count >= need:
            return TriggerCheck(True, f"{count} new verified samples (>= {need})", stats)
        return TriggerCheck(False, f"{count} new verified samples (< {need})", stats)

    # drift
    start = now - timedelta(seconds=float(t["window_s"]))
    total, disagree = session.execute(
        select(func.count(), func.sum(case((Verdict.agrees_with_edge.is_(False), 1), else_=0)))
        .select_from(Verdict)
        .join(Sample, Sample.sample_id == Verdict.sample_id)
        .where(Sample.fleet == fleet, Verdict.verified_at >= start)
    ).one()
    total, disagree = int(total or 0), int(disagree or 0)
    rates = [
        float(a.telemetry["forward_rate"])
        for a in session.scalars(
            select(Agent).where(Agent.fleet == fleet, Agent.last_seen_at >= start)
        )
        if isinstance(a.telemetry, dict) and a.telemetry.get("forward_rate") is not None
    ]
    forward = sum(rates) / len(rates) if rates else None
    disagreement = disagree / total if total else None
    stats = {
        "window_s": t["window_s"],
        "verified_in_window": total,
        "disagreement": disagreement,
        "forward_rate": forward,
        "agents_reporting": len(rates),
    }
    if total < int(t["min_samples"]):
        return TriggerCheck(False, f"only {total} verified samples in the window", stats)
    reasons = []
    if "max_forward_rate" in t and forward is not None and forward > t["max_forward_rate"]:
        reasons.append(f"forward rate {forward:.3f} > {t['max_forward_rate']}")
    if (
        "max_disagreement" in t
        and disagreement is not None
        and disagreement > t["max_disagreement"]
    ):
        reasons.append(f"teacher disagreement {disagreement:.3f} > {t['max_disagreement']}")
    if reasons:
        return TriggerCheck(True, "; ".join(reasons), stats)
    return TriggerCheck(False, "within bounds", stats)


def _claim_firing(
    session: Session, schedule: Schedule, now: datetime, next_run: datetime | None
) -> bool:
    """Move the schedule on, conditional on nobody else having done so: True if we won."""
    cond = [Schedule.id == schedule.id]
    if schedule.kind == "trigger":
        cond.append(
            Schedule.last_run_at.is_(None)
            if schedule.last_run_at is None
            else Schedule.last_run_at == schedule.last_run_at
        )
    else:
        cond.append(Schedule.next_run_at == schedule.next_run_at)
    result = session.execute(
        update(Schedule)
        .where(*cond)
        .values(last_run_at=now, next_run_at=next_run)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1  # type: ignore[attr-defined]


def tick(*, session: Session, now: datetime | None = None) -> list[int]:
    """Queue a job for every enabled schedule that is due; returns the new jobs' ids."""
    now = now or datetime.now(UTC)
    stmt = select(Schedule).where(Schedule.enabled.is_(True)).order_by(Schedule.id)
    if session.get_bind().dialect.name == "postgresql":
        stmt = stmt.with_for_update(skip_locked=True)
    queued: list[int] = []
    for schedule in session.scalars(stmt).all():
        if schedule.kind == "trigger":
            check = evaluate_trigger(session=session, schedule=schedule, now=now)
            if not check.fire:
                continue
            reason, next_run = f"trigger {schedule.name}: {check.reason}", None
        else:
            if schedule.next_run_at is None or schedule.next_run_at > now:
                continue
            reason = f"{schedule.kind} {schedule.name} ({schedule.expression})"
            # Missed runs (the scheduler was down) collapse into one.
            next_run = _next_run(schedule.kind, schedule.expression, now)
        if not _claim_firing(session, schedule, now, next_run):
            continue
        job = jobs.enqueue(
            session=session,
            params=schedule.params,
            reason=reason,
            schedule_id=schedule.id,
            now=now,
        )
        session.execute(
            update(Schedule)
            .where(Schedule.id == schedule.id)
            .values(last_job_id=job.id)
            .execution_options(synchronize_session=False)
        )
        queued.append(job.id)
    return queued


class SchedulerLoop:
    """``tick`` every ``interval_s`` on the ``scheduler-tick`` thread (the API process runs one)."""

    def __init__(self, sessions: Callable[[], Any], interval_s: float) -> None:
        self.sessions = sessions
        self.interval_s = interval_s
        self.workers = Workers("scheduler")
        self.fired: list[int] = []

    def start(self) -> SchedulerLoop:
        self.workers.spawn("tick", self._tick, every=self.interval_s, wait_first=True)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.workers.stop(timeout)

    def health(self) -> dict[str, object]:
        return {"alive": self.workers.alive, "fired": len(self.fired)}

    def _tick(self) -> None:
        try:
            with self.sessions.begin() as session:  # type: ignore[attr-defined]
                self.fired.extend(tick(session=session))
        except Exception as exc:  # a database hiccup: try again next tick
            log.warning("scheduler tick failed: %s", exc)
