"""Where agents stand with a version: installed, refused (and why), installing or pending."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from cloud_service.db.models import Agent, AgentOverride, FleetModel, ModelStatusEvent, ModelVersion

__all__ = ["AgentInstall", "InstallSummary", "install_summary"]


@dataclass(frozen=True)
class AgentInstall:
    """Where one agent stands with one version, from its model-status reports."""

    agent_id: str
    fleet: str
    state: str  # installed | refused | installing | replaced | pending
    reason: str | None
    at: datetime | None


@dataclass(frozen=True)
class InstallSummary:
    """Per-agent install state of a version, and the state to show for it."""

    installs: list[AgentInstall]
    state: str  # the registry's state, but "refused" / "partly refused" while agents refuse it

    def count(self, state: str) -> int:
        return sum(1 for item in self.installs if item.state == state)


_STEP_STATE = {
    "active": "installed",
    "rolled-back": "installed",  # reported for the version rolled back to
    "rejected": "refused",
    "downloaded": "installing",
    "verified": "installing",
}


def install_summary(*, session: Session, record: ModelVersion) -> InstallSummary:
    """Which agents installed ``record``, refused it (with the reason) or have yet to answer.

    The agents meant to run it are those of the fleets announcing it (less those held on
    another version by an override) and those an override points at it; any other agent
    that reported on it is listed too.
    """
    name, version = record.name, record.version
    fleets = set(
        session.scalars(
            select(FleetModel.fleet).where(
                FleetModel.model_name == name, FleetModel.version == version
            )
        )
    )
    overrides = list(session.scalars(select(AgentOverride)))
    targeted: dict[str, str] = {}
    if fleets:
        for agent_id, fleet in session.execute(
            select(Agent.agent_id, Agent.fleet).where(Agent.fleet.in_(fleets))
        ):
            targeted[agent_id] = fleet
    for override in overrides:
        if (override.model_name, override.version) == (name, version):
            targeted[override.agent_id] = override.fleet
        else:
            targeted.pop(override.agent_id, None)
    latest: dict[str, ModelStatusEvent] = {}
    events = session.scalars(
        select(ModelStatusEvent)
        .where(ModelStatusEvent.model_name == name, ModelStatusEvent.model_version == version)
        .order_by(ModelStatusEvent.id)
    )
    for step in events:
        latest[step.agent_id] = step  # the last step each agent reported wins
    agents = {
        a.agent_id: a
        for a in session.scalars(
            select(Agent).where(Agent.agent_id.in_(set(targeted) | set(latest)))
        )
    }
    installs: list[AgentInstall] = []
    for agent_id in sorted(set(targeted) | set(latest)):
        agent = agents.get(agent_id)
        serves = agent is not None and agent.model_version == version
        event = latest.get(agent_id)
        fleet = targeted.get(agent_id) or (event.fleet if event else agent.fleet if agent else "")
        if event is None:
            state = "installed" if serves else "pending"
            installs.append(AgentInstall(agent_id, fleet, state, None, None))
            continue
        state = _STEP_STATE.get(event.state, event.state)
        if (
            state == "installed"
            and agent is not None
            and agent.model_version not in (None, version)
        ):
            state = "replaced"  # rolled back from it, or moved on to another version
        reason = event.reason if state == "refused" else None
        installs.append(AgentInstall(agent_id, fleet, state, reason, event.at))
    summary = InstallSummary(installs=installs, state=record.state)
    refused, installed = summary.count("refused"), summary.count("installed")
    if refused and not installed:
        shown = "refused"
    elif refused:
        shown = "partly refused"
    else:
        shown = record.state
    return InstallSummary(installs=installs, state=shown)
