"""Which agents would refuse a version, judged from what their heartbeats report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from cloud_service.db.models import Agent, ModelVersion
from cloud_service.errors import ConflictError
from shared.manifest import ModelManifest, agent_refusal

__all__ = ["AgentRefusal", "agent_refusals", "check_agents", "refusal_message"]


@dataclass(frozen=True)
class AgentRefusal:
    """An agent that would refuse a version, and why (its model-status reason slug)."""

    agent_id: str
    fleet: str
    reason: str
    message: str


def agent_refusals(
    *,
    session: Session,
    manifest: ModelManifest,
    fleet: str | None = None,
    agents: Sequence[str] | None = None,
) -> list[AgentRefusal]:
    """The agents that would refuse ``manifest``, judged from what their heartbeats report.

    Whom: ``agents`` when given, else the agents of ``fleet``, else the agents serving a
    model of the same name. An agent that reports no input size, runtime or opset (one
    older than these heartbeat fields) is left out; it reports its answer on install.
    """
    stmt = select(Agent).order_by(Agent.agent_id)
    if agents is not None:
        stmt = stmt.where(Agent.agent_id.in_(list(agents)))
    elif fleet is not None:
        stmt = stmt.where(Agent.fleet == fleet)
    refusals: list[AgentRefusal] = []
    for agent in session.scalars(stmt):
        telemetry = agent.telemetry or {}
        if agents is None and fleet is None and telemetry.get("model_name") != manifest.name:
            continue
        hw = telemetry.get("input_hw")
        runtime, max_opset = telemetry.get("runtime_version"), telemetry.get("max_opset")
        if not (isinstance(hw, list) and len(hw) == 2 and runtime and max_opset):
            continue
        refusal = agent_refusal(
            manifest,
            input_hw=(int(hw[0]), int(hw[1])),
            max_opset=int(max_opset),
            runtime_version=str(runtime),
        )
        if refusal is not None:
            refusals.append(AgentRefusal(agent.agent_id, agent.fleet, *refusal))
    return refusals


def refusal_message(manifest: ModelManifest, refusals: Sequence[AgentRefusal]) -> str:
    shown = "; ".join(f"agent {r.agent_id} (fleet {r.fleet}): {r.message}" for r in refusals[:3])
    more = f" and {len(refusals) - 3} more" if len(refusals) > 3 else ""
    return (
        f"{len(refusals)} agent(s) would refuse {manifest.name} {manifest.version}"
        f" ({refusals[0].reason}): {shown}{more}"
    )


def check_agents(
    session: Session,
    record: ModelVersion,
    *,
    fleet: str | None = None,
    agents: Sequence[str] | None = None,
) -> None:
    """ConflictError (409) if agents about to be told of ``record`` would refuse it."""
    try:
        manifest = ModelManifest.model_validate(record.manifest)
    except ValidationError as exc:
        raise ConflictError(
            f"{record.name} {record.version} has no valid manifest to announce"
            f" ({exc.error_count()} problem(s)); register the model again",
            reason="invalid_manifest",
        ) from exc
    refusals = agent_refusals(session=session, manifest=manifest, fleet=fleet, agents=agents)
    if refusals:
        raise ConflictError(refusal_message(manifest, refusals), reason=refusals[0].reason)
