"""What the agent reports about itself: ``/v1/status``, the retained heartbeat, its last will.

The heartbeat (``heartbeat-loop``) publishes the retained ``AgentStatus`` every
``heartbeat_s`` while the link is up; the same message says ``offline`` as the
link's last will and on a clean stop. ``docs/architecture.md`` ("Topics") lists
the status topic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from edge_agent.forwarding import Forwarding
from edge_agent.intake import FrameSource, Intake
from edge_agent.settings import AgentSettings
from edge_agent.telemetry import Telemetry
from edge_agent.updates import ModelUpdater
from edge_agent.uplink import Publisher
from edge_agent.verdicts import VerdictKeeper
from shared.lifecycle import Workers
from shared.messages import AgentStatus, encode_message
from shared.onnx_support import max_supported_opset, runtime_version

__all__ = ["StatusReporter", "status_payload"]

log = logging.getLogger(__name__)


def status_payload(settings: AgentSettings, state: str, **fields: Any) -> bytes:
    """An encoded ``AgentStatus`` for this agent (fields that are None left out)."""
    status = AgentStatus(
        fleet=settings.fleet,
        agent=settings.agent_id,
        state=state,
        sent_at=datetime.now(UTC),
        **{k: v for k, v in fields.items() if v is not None},
    )
    return encode_message(status)


class StatusReporter:
    """The agent's status from its parts, and the heartbeat that publishes it."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        telemetry: Telemetry,
        publisher: Publisher,
        intake: Intake,
        forwarding: Forwarding,
        verdicts: VerdictKeeper,
        updater: ModelUpdater,
        sources: Sequence[FrameSource],
        ready: Callable[[], bool],
        started_at: float,
    ) -> None:
        self.settings = settings
        self.telemetry = telemetry
        self.publisher = publisher
        self.intake = intake
        self.forwarding = forwarding
        self.verdicts = verdicts
        self.updater = updater
        self.sources = sources
        self.ready = ready
        self.started_at = started_at
        self.topic_status = settings.topics.status(settings.fleet, settings.agent_id)
        self._workers = Workers("heartbeat")

    def start(self) -> StatusReporter:
        self._workers.spawn("loop", self._heartbeat)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._workers.stop(timeout)

    def health(self) -> dict[str, object]:
        return dict(self._workers.health())

    def status(self) -> dict[str, Any]:
        """Everything the heartbeat, ``/v1/status`` and ``edge-agent status`` show."""
        spool = self.forwarding.spool.stats()
        engine = self.intake.engine
        t = self.telemetry
        t.spool_depth.set(spool.depth)
        t.spool_bytes.set(spool.bytes)
        t.evicted.labels("audit").set(spool.evicted_audit)
        t.evicted.labels("oldest").set(spool.evicted_oldest)
        t.connected.set(int(self.publisher.connected))
        t.webhook_pending.set(self.verdicts.webhook.pending)
        snap = t.snapshot()
        return {
            "fleet": self.settings.fleet,
            "agent": self.settings.agent_id,
            "ready": self.ready(),
            "connected": self.publisher.connected,
            "uplink": self._uplink_status(),
            "model": {
                "name": engine.name,
                "version": engine.version,
                "provider": engine.provider,
                "labels": list(engine.labels),
                "input_hw": list(engine.input_hw),
            },
            "updates": self.updater.status(),
            "spool": asdict(spool),
            "spool_errors": self.forwarding.spool_errors,
            "verdict_write_errors": self.verdicts.store.write_errors,
            "over_budget": self.intake.router.over_budget,
            "sources": [src.status() for src in self.sources],
            "uptime_s": round(time.monotonic() - self.started_at, 1),
            **snap,
        }

    def _uplink_status(self) -> dict[str, Any]:
        link_status = getattr(self.publisher, "status", None)
        if link_status is None:  # an in-memory publisher
            return {"connected": self.publisher.connected}
        return dict(link_status())

    def publish(self) -> None:
        """Publish the retained heartbeat now."""
        st = self.status()
        payload = status_payload(
            self.settings,
            "online",
            model_version=st["model"]["version"],
            provider=st["model"]["provider"],
            frames_per_s=st["frames_per_s"],
            latency_p50_ms=st["latency_p50_ms"],
            latency_p99_ms=st["latency_p99_ms"],
            forward_rate=st["forward_rate"],
            spool_depth=st["spool"]["depth"],
            dropped_frames=st["dropped_frames"],
            agreement_rate=st["agreement_rate"],
            cpu_percent=st["cpu_percent"],
            memory_mb=st["memory_mb"],
            gpu=st["gpu"],
            model_name=st["model"]["name"],
            input_hw=st["model"]["input_hw"],
            runtime_version=runtime_version(),
            max_opset=self.settings.max_model_opset or max_supported_opset(),
        )
        self.publisher.publish(self.topic_status, payload, qos=1, retain=True)

    def publish_offline(self) -> None:
        """Say ``offline`` (a clean disconnect does not fire the will) and flush the link."""
        if not self.publisher.connected:
            return
        self.publisher.publish(
            self.topic_status, status_payload(self.settings, "offline"), qos=1, retain=True
        )
        flush = getattr(self.publisher, "flush", None)
        if flush is not None:
            flush(2.0)

    def _heartbeat(self) -> None:
        while not self._workers.wait(self.settings.heartbeat_s):
            if self.publisher.connected:
                try:
                    self.publish()
                except Exception:  # telemetry must never stop the agent
                    log.exception("heartbeat failed")
