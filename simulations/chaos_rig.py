"""What every fault and attack scenario runs on, and how its outcome is judged.

``chaos_stack(folder, ...)`` is a ``Stack`` for one scenario, all under ``folder``: a
private Mosquitto, a seeded demo teacher, a tiny student (one ORT engine the agents
share), SQLite (or the database given), and the verifier and API the scenario asks for.
Its agents forward every frame. ``judge`` counts, against the database after the system
drained, what was lost, duplicated or left without a verdict (see ``simulations.chaos``).

Every loop is bounded in count and time.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from sqlalchemy import create_engine, func, select

from cloud_service.db.models import Sample, Verdict
from cloud_service.demo_teacher import build_demo_teacher
from edge_agent.agent import Agent
from edge_agent.testing import make_tiny_student
from simulations.stack import Stack, VerifierProcesses

__all__ = [
    "ADMIN_HEADERS",
    "ADMIN_TOKEN",
    "FLEET",
    "VERIFIER_PROCESS",
    "Outcome",
    "chaos_agent",
    "chaos_stack",
    "drain",
    "frames",
    "judge",
    "reached",
    "stream_frames",
    "until",
]

FLEET = "fleet-chaos"
ADMIN_TOKEN = "chaos-admin-token-0123456789abcdef"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

# The cloud parts: quick storage, no review share, a persistent verifier session; the
# API process with the admin token, no rollout loop and no rate limits (the load is
# many requests from one address: limits are tested elsewhere).
_CLOUD: dict[str, Any] = {
    "blob_fsync": False,
    "review_audit_share": 0.0,
    "mqtt_session_expiry_s": 900,
    "admin_token": ADMIN_TOKEN,
    "rollout_tick_s": 0,
    "rate_limit_enroll_per_min": 0,
    "rate_limit_upload_per_min": 0,
}
# The agents: forward every frame, quick heartbeats, resends and reconnects.
_EDGE: dict[str, Any] = {
    "intra_op_threads": 1,
    "warmup_runs": 1,
    "max_wait_ms": 2.0,
    "heartbeat_s": 1.0,
    "audit_share": 0.0,
    "route_max_prob_below": 1.01,  # forward every frame
    "resend_after_s": 2.0,
    "reconnect_min_s": 0.1,
    "reconnect_max_s": 0.5,
}
# The verifier as a process (the one a scenario SIGKILLs).
VERIFIER_PROCESS = VerifierProcesses(1, {"mqtt_session_expiry_s": 600, "ingest_max_batch": 20})


def chaos_stack(
    folder: Path,
    *,
    verifier: Literal["in-process"] | VerifierProcesses | None = None,
    api: Literal["in-process", "subprocess"] | None = None,
    db: str = "sqlite",
    cloud: Mapping[str, Any] | None = None,
) -> Stack:
    """A stack for one scenario under ``folder`` (not started); ``cloud`` adds settings."""
    folder.mkdir(parents=True, exist_ok=True)
    teacher = build_demo_teacher(folder / "teacher.onnx", size=32, classes=10, seed=1)
    student = make_tiny_student(folder / "student.onnx", size=32)
    values = {
        **_CLOUD,
        "verifier_client_id": f"chaos-verifier-{uuid.uuid4().hex[:8]}",
        **(cloud or {}),
    }
    return Stack(
        folder,
        broker="mosquitto",
        db=db,
        verifier=verifier,
        api=api,
        teacher=teacher,
        student=student,
        fleet=FLEET,
        topic_prefix=f"edgeloop-chaos/{uuid.uuid4().hex[:8]}/v1",
        cloud=values,
        edge=_EDGE,
        name="chaos",
    )


def chaos_agent(stack: Stack, agent: str = "cam-1", **settings: Any) -> Agent:
    """An agent on the stack's shared engine (not started); ``settings`` override its own."""
    return stack.agent(agent, settings=settings, engine=stack.engine)


def until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def frames(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, (48, 64, 3), dtype=np.uint8) for _ in range(n)]


@dataclass
class Outcome:
    fault: str
    tried: str
    forwarded: int = 0
    stored: int = 0
    lost: int = 0
    duplicated: int = 0
    without_verdict: int = 0
    evicted: int = 0
    redelivered: int = 0
    refused: int = 0
    server_errors: int = 0
    crashed: int = 0
    recovered: bool = True  # served again after the fault, within the scenario's bound
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.duplicated == 0
            and self.without_verdict == 0
            and self.server_errors == 0
            and self.recovered
        )

    def row(self) -> dict[str, Any]:
        return {
            "fault": self.fault,
            "tried": self.tried,
            "forwarded": self.forwarded,
            "stored": self.stored,
            "lost": self.lost,
            "duplicated": self.duplicated,
            "without_verdict": self.without_verdict,
            "evicted_by_policy": self.evicted,
            "redelivered": self.redelivered,
            "refused": self.refused,
            "server_errors": self.server_errors,
            "crashed": self.crashed,
            "recovered": self.recovered,
            "ok": self.ok,
            "notes": "; ".join(self.notes),
        }


def judge(database_url: str, outcome: Outcome, forwarded: set[str], *, evicted: int = 0) -> Outcome:
    """Count what of ``forwarded`` the store lacks, holds twice or holds without a verdict."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            stored = set(conn.scalars(select(Sample.sample_id)))
            rows = conn.scalar(select(func.count()).select_from(Sample)) or 0
            verdict_rows = conn.scalar(select(func.count()).select_from(Verdict)) or 0
            verified = set(conn.scalars(select(Verdict.sample_id)))
    finally:
        engine.dispose()
    outcome.forwarded = len(forwarded)
    outcome.stored = len(stored & forwarded)
    outcome.evicted = evicted
    outcome.lost += max(0, len(forwarded - stored) - evicted)
    outcome.duplicated += (rows - len(stored)) + (verdict_rows - len(verified))
    outcome.without_verdict += len(stored - verified)
    return outcome


def stream_frames(
    agent: Agent, pool: list[np.ndarray], n: int, out: list[str], pace_s: float
) -> None:
    """``n`` frames from ``pool`` through the agent; the ids of those it forwarded to ``out``."""
    for i in range(n):
        result = agent.process(pool[i % len(pool)], source="chaos")
        if getattr(result, "sample_id", None):
            out.append(result.sample_id)
        if pace_s:
            time.sleep(pace_s)


def reached(items: list[str], n: int) -> Callable[[], bool]:
    return lambda: len(items) >= n


def drain(database_url: str, forwarded: list[str], timeout: float) -> None:
    """Wait (up to ``timeout``) until every forwarded sample has its verdict."""
    engine = create_engine(database_url)
    want = set(forwarded)

    def done() -> bool:
        with engine.connect() as conn:
            verified = set(conn.scalars(select(Verdict.sample_id)))
        return want <= verified

    until(done, timeout)
    engine.dispose()
