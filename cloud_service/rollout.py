"""Canary rollouts: a cohort first, watched over a window, then promoted or rolled back.

    rollout = create_rollout(session=s, announcer=a, topics=t, key=k, fleet="default",
                             name="student", version="v7", percent=10,
                             criteria=RolloutCriteria(window_s=900, min_agreement=0.85))
    tick(session=s, announcer=a, topics=t, key=k)   # periodically: evaluate, promote or abort

States: ``running`` -> ``promoted`` | ``aborted``. The cohort is chosen by name, or
by percentage with a deterministic hash of the agent id (the same agents each time
for the same fleet and version). Each cohort member gets a per-agent retained
announcement; promotion moves the version to the fleet announcement and withdraws
the overrides; an abort withdraws them, so the cohort falls back to the fleet
announcement, which still names the baseline (a rollout needs one).

Evaluation (in the manner of AWS IoT Greengrass's abort criteria), from what the
cohort reports: the model-status refusals of this version (error rate, checked at
any time), and, once ``min_samples`` cohort agents run the version and have sent a
heartbeat since the start, their mean agreement with the teacher and their mean p99
latency against the baseline's (the rest of the fleet's at the start). Any breach
aborts at once; at the window's end a clean rollout is promoted (``auto_promote``)
and one without enough samples is aborted. Every step is a rollout event.

The evaluation runs in the API process (``rollout_loop``, every
``rollout_tick_s``); any replica may run it: a rollout is decided in one
transaction and a decided one is not evaluated again. The same loop signs again
the retained announcements older than half their lifetime
(``registry.refresh_announcements``), so an idle fleet's announcement never expires.
"""

from __future__ import annotations

import hashlib
import logging
import statistics
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from cloud_service import registry
from cloud_service.announce import Announcer
from cloud_service.db.models import (
    Agent,
    AgentOverride,
    FleetModel,
    ModelStatusEvent,
    Rollout,
    RolloutEvent,
)
from cloud_service.errors import ConflictError, NotFoundError
from shared.errors import ContractError, EdgeLoopError
from shared.lifecycle import Workers
from shared.manifest import FleetSigningKey
from shared.topics import Topics, validate_id

if TYPE_CHECKING:
    from cloud_service.web.state import ApiState

__all__ = [
    "RolloutCriteria",
    "RolloutLoop",
    "abort_rollout",
    "choose_cohort",
    "create_rollout",
    "evaluate",
    "get_rollout",
    "list_rollouts",
    "promote_rollout",
    "tick",
]

log = logging.getLogger(__name__)

Decision = Literal["continue", "promote", "abort"]


class RolloutCriteria(BaseModel):
    """When to abort and when to promote, set per rollout."""

    model_config = ConfigDict(extra="forbid")

    window_s: float = Field(default=900.0, ge=0, le=30 * 86400)
    min_agreement: float | None = Field(default=None, ge=0, le=1)
    max_error_rate: float = Field(default=0.0, ge=0, le=1, description="refused / cohort size")
    max_latency_ratio: float | None = Field(default=2.0, gt=0)
    min_samples: int = Field(default=1, ge=1, description="cohort agents reporting the version")
    auto_promote: bool = True


def _bucket(fleet: str, version: str, agent: str) -> float:
    digest = hashlib.sha256(f"{fleet}/{version}/{agent}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * 100.0


def choose_cohort(agents: Sequence[str], *, fleet: str, version: str, percent: float) -> list[str]:
    """The agents whose hash bucket falls under ``percent`` (at least one if any agent)."""
    ranked = sorted(agents, key=lambda a: _bucket(fleet, version, a))
    chosen = [a for a in ranked if _bucket(fleet, version, a) < percent]
    if not chosen and ranked and percent > 0:
        chosen = ranked[:1]
    return sorted(chosen)


def _event(session: Session, rollout: Rollout, kind: str, now: datetime, **detail: Any) -> None:
    session.add(RolloutEvent(rollout_id=rollout.id, at=now, kind=kind, detail=detail))


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def create_rollout(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    fleet: str,
    name: str,
    version: str,
    key: FleetSigningKey,
    percent: float | None = None,
    agents: Sequence[str] | None = None,
    criteria: RolloutCriteria | None = None,
    now: datetime | None = None,
    ttl: timedelta = registry.DEFAULT_ANNOUNCEMENT_TTL,
) -> Rollout:
    """Start a canary of ``version`` on a cohort (named agents, or a percentage of the fleet)."""
    now = now or datetime.now(UTC)
    criteria = criteria or RolloutCriteria()
    validate_id(fleet, "fleet")
    record = registry.get_version(session=session, name=name, version=version)
    running = session.scalars(
        select(Rollout).where(Rollout.fleet == fleet, Rollout.state == "running")
    ).first()
    if running is not None:
        raise ConflictError(f"rollout {running.id} is still running on fleet {fleet}")
    serving = registry.serving(session=session, fleet=fleet)
    if serving is None or serving.model_name != name:
        raise ConflictError(
            f"fleet {fleet} serves no version of {name} yet: promote a first version to the"
            " fleet, then canary the next (an abort falls back to the fleet's version)"
        )
    if serving.version == version:
        raise ConflictError(f"fleet {fleet} already serves {name} {version}")
    fleet_agents = list(
        session.scalars(select(Agent).where(Agent.fleet == fleet).order_by(Agent.agent_id))
    )
    if agents:
        cohort = sorted({validate_id(a, "agent") for a in agents})
    elif percent is not None:
        if not 0 < percent <= 100:
            raise ContractError("percent must be in (0, 100]")
        cohort = choose_cohort(
            [a.agent_id for a in fleet_agents], fleet=fleet, version=version, percent=percent
        )
    else:
        raise ContractError("choose a cohort: a percentage of the fleet or named agents")
    if not cohort:
        raise ConflictError(f"fleet {fleet} has no agents to canary on")
    baseline_latency = _mean(
        [
            float(a.telemetry["latency_p99_ms"])
            for a in fleet_agents
            if a.agent_id not in cohort and a.telemetry.get("latency_p99_ms") is not None
        ]
        or [
            float(a.telemetry["latency_p99_ms"])
            for a in fleet_agents
            if a.telemetry.get("latency_p99_ms") is not None
        ]
    )
    rollout = Rollout(
        fleet=fleet,
        model_name=name,
        version=version,
        baseline_version=serving.version,
        cohort=cohort,
        percent=percent,
        criteria=criteria.model_dump(),
        state="running",
        evaluation={"baseline_latency_p99_ms": baseline_latency},
        started_at=now,
        window_ends_at=now + timedelta(seconds=criteria.window_s),
    )
    session.add(rollout)
    session.flush()
    registry.set_overrides(
        session=session,
        announcer=announcer,
        topics=topics,
        fleet=fleet,
        record=record,
        agents=cohort,
        kind="canary",
        key=key,
        rollout_id=rollout.id,
        ttl=ttl,
    )
    _event(session, rollout, "created", now, cohort=cohort, criteria=criteria.model_dump())
    log.info("rollout %d: %s %s to %s on %s", rollout.id, name, version, cohort, fleet)
    return rollout


def evaluate(
    *, session: Session, rollout: Rollout, now: datetime
) -> tuple[Decision, dict[str, Any]]:
    """What the cohort shows now, and what to do about it."""
    criteria = RolloutCriteria.model_validate(rollout.criteria)
    cohort = list(rollout.cohort)
    agents = {
        a.agent_id: a
        for a in session.scalars(select(Agent).where(Agent.agent_id.in_(cohort))).all()
    }
    refused = set(
        session.scalars(
            select(ModelStatusEvent.agent_id).where(
                ModelStatusEvent.agent_id.in_(cohort),
                ModelStatusEvent.model_version == rollout.version,
                ModelStatusEvent.state == "rejected",
                ModelStatusEvent.at >= rollout.started_at,
            )
        ).all()
    )
    reporting = [
        a
        for a in agents.values()
        if a.model_version == rollout.version
        and a.last_seen_at is not None
        and a.last_seen_at >= rollout.started_at
        and a.state == "online"
    ]
    agreement = _mean(
        [float(a.telemetry["agreement_rate"]) for a in reporting if "agreement_rate" in a.telemetry]
    )
    latency = _mean(
        [float(a.telemetry["latency_p99_ms"]) for a in reporting if "latency_p99_ms" in a.telemetry]
    )
    baseline = rollout.evaluation.get("baseline_latency_p99_ms")
    ratio = latency / baseline if latency is not None and baseline else None
    error_rate = len(refused) / len(cohort) if cohort else 0.0
    figures: dict[str, Any] = {
        "at": now.isoformat(),
        "cohort": len(cohort),
        "reporting": len(reporting),
        "refused": sorted(refused),
        "error_rate": error_rate,
        "agreement": agreement,
        "latency_p99_ms": latency,
        "baseline_latency_p99_ms": baseline,
        "latency_ratio": ratio,
    }
    reasons: list[str] = []
    if error_rate > criteria.max_error_rate:
        reasons.append(
            f"error rate {error_rate:.2f} over {criteria.max_error_rate:.2f}"
            f" (refused by {sorted(refused)})"
        )
    enough = len(reporting) >= criteria.min_samples
    floor = criteria.min_agreement
    if enough and floor is not None and agreement is not None and agreement < floor:
        reasons.append(f"agreement {agreement:.3f} under {floor:.3f}")
    latency_cap = criteria.max_latency_ratio
    if enough and latency_cap is not None and ratio is not None and ratio > latency_cap:
        reasons.append(f"p99 latency {ratio:.2f}x baseline, over {latency_cap}x")
    if reasons:
        figures["reasons"] = reasons
        return "abort", figures
    if now >= rollout.window_ends_at:
        if not enough:
            figures["reasons"] = [
                f"only {len(reporting)} of {criteria.min_samples} cohort agents reported"
                " the version by the end of the window"
            ]
            return "abort", figures
        if criteria.min_agreement is not None and agreement is None:
            figures["reasons"] = ["no agreement figures from the cohort by the end of the window"]
            return "abort", figures
        return ("promote" if criteria.auto_promote else "continue"), figures
    return "continue", figures


def _running(session: Session, rollout_id: int) -> Rollout:
    rollout = session.get(Rollout, rollout_id)
    if rollout is None:
        raise NotFoundError(f"rollout {rollout_id} does not exist")
    if rollout.state != "running":
        raise ConflictError(f"rollout {rollout_id} is already {rollout.state}")
    return rollout


def promote_rollout(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    rollout_id: int,
    key: FleetSigningKey,
    reason: str = "promoted by hand",
    now: datetime | None = None,
    ttl: timedelta = registry.DEFAULT_ANNOUNCEMENT_TTL,
) -> Rollout:
    """Move the canary version to the whole fleet."""
    now = now or datetime.now(UTC)
    rollout = _running(session, rollout_id)
    registry.promote(
        session=session,
        announcer=announcer,
        topics=topics,
        fleet=rollout.fleet,
        name=rollout.model_name,
        version=rollout.version,
        key=key,
        ttl=ttl,
    )
    rollout.state, rollout.reason, rollout.finished_at = "promoted", reason, now
    _event(session, rollout, "promoted", now, reason=reason)
    log.info("rollout %d promoted: %s", rollout.id, reason)
    return rollout


def abort_rollout(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    rollout_id: int,
    reason: str = "aborted by hand",
    now: datetime | None = None,
) -> Rollout:
    """Withdraw the cohort's overrides: its agents go back to the fleet's (baseline) version."""
    now = now or datetime.now(UTC)
    rollout = _running(session, rollout_id)
    registry.clear_overrides(
        session=session,
        announcer=announcer,
        topics=topics,
        fleet=rollout.fleet,
        agents=list(rollout.cohort),
        kind="canary",
    )
    rollout.state, rollout.reason, rollout.finished_at = "aborted", reason, now
    _event(session, rollout, "aborted", now, reason=reason, baseline=rollout.baseline_version)
    log.warning("rollout %d aborted: %s", rollout.id, reason)
    return rollout


def tick(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    key: FleetSigningKey,
    now: datetime | None = None,
    ttl: timedelta = registry.DEFAULT_ANNOUNCEMENT_TTL,
) -> list[tuple[int, Decision]]:
    """Evaluate every running rollout once and act on the result."""
    now = now or datetime.now(UTC)
    decided: list[tuple[int, Decision]] = []
    for rollout in session.scalars(select(Rollout).where(Rollout.state == "running")).all():
        decision, figures = evaluate(session=session, rollout=rollout, now=now)
        rollout.evaluation = {**rollout.evaluation, "last": figures}
        if decision == "abort":
            abort_rollout(
                session=session,
                announcer=announcer,
                topics=topics,
                rollout_id=rollout.id,
                reason="automatic abort: " + "; ".join(figures.get("reasons", [])),
                now=now,
            )
        elif decision == "promote":
            promote_rollout(
                session=session,
                announcer=announcer,
                topics=topics,
                rollout_id=rollout.id,
                key=key,
                reason="automatic promotion: the window passed within every criterion",
                now=now,
                ttl=ttl,
            )
        decided.append((rollout.id, decision))
    return decided


def list_rollouts(*, session: Session, fleet: str | None = None, limit: int = 100) -> list[Rollout]:
    stmt = select(Rollout).order_by(Rollout.id.desc()).limit(limit)
    if fleet is not None:
        stmt = stmt.where(Rollout.fleet == fleet)
    return list(session.scalars(stmt).all())


def get_rollout(*, session: Session, rollout_id: int) -> tuple[Rollout, list[RolloutEvent]]:
    rollout = session.get(Rollout, rollout_id)
    if rollout is None:
        raise NotFoundError(f"rollout {rollout_id} does not exist")
    events = list(
        session.scalars(
            select(RolloutEvent)
            .where(RolloutEvent.rollout_id == rollout_id)
            .order_by(RolloutEvent.id)
        ).all()
    )
    return rollout, events


class RolloutLoop:
    """The API process's ``rollout-tick`` thread: ``tick`` every ``interval_s``."""

    def __init__(
        self,
        state: ApiState,
        interval_s: float,
        *,
        ttl: timedelta = registry.DEFAULT_ANNOUNCEMENT_TTL,
    ) -> None:
        self.state = state
        self.interval_s = interval_s
        self.ttl = ttl
        self.workers = Workers("rollout")

    def start(self) -> RolloutLoop:
        self.workers.spawn("tick", self._tick, every=self.interval_s, wait_first=True)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.workers.stop(timeout)

    def health(self) -> dict[str, object]:
        return {"alive": self.workers.alive}

    def _tick(self) -> None:
        try:
            with self.state.sessions.begin() as session:
                self._refresh(session)
                running = session.scalars(
                    select(Rollout.id).where(Rollout.state == "running")
                ).first()
                if running is None:
                    return  # nothing to do; no broker connection needed
                tick(
                    session=session,
                    announcer=self.state.get_announcer(),
                    topics=self.state.settings.topics,
                    key=self.state.signing_key,
                    ttl=self.ttl,
                )
        except EdgeLoopError as exc:
            log.warning("rollout evaluation failed (retrying next tick): %s", exc)
        except SQLAlchemyError as exc:
            log.warning("rollout evaluation failed on the database: %s", exc)

    def _refresh(self, session: Session) -> None:
        """Sign again the retained announcements past half their lifetime (a cheap query)."""
        stale = datetime.now(UTC) - self.ttl / 2
        due = (
            session.scalars(select(FleetModel.fleet).where(FleetModel.updated_at < stale)).first()
            or session.scalars(
                select(AgentOverride.agent_id).where(AgentOverride.created_at < stale)
            ).first()
        )
        if due is None:
            return  # nothing to refresh; no broker connection needed
        registry.refresh_announcements(
            session=session,
            announcer=self.state.get_announcer(),
            topics=self.state.settings.topics,
            key=self.state.signing_key,
            ttl=self.ttl,
        )
