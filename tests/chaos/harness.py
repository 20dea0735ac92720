"""Chaos scenarios on loopback, shared by the short tests and ``scripts/chaos.py``.

Each scenario runs real parts: a private Mosquitto, the real edge ``Agent`` (tiny
student, disk spool), the real verifier (in-process, or a ``cloud-service verifier``
subprocess where it is to be SIGKILLed), a database; it injects one fault and
returns counts, judged against the database after the system drained:

- ``lost``: forwarded by the agent, never stored, not evicted from the spool;
- ``duplicated``: stored sample rows or verdict rows beyond one per sample id;
- ``without_verdict``: stored, still no verdict;
- ``evicted``: dropped by the spool's eviction policy (by design, counted);
- ``redelivered``: deliveries the cloud absorbed as duplicates (expected, harmless).

Every loop is bounded in count and time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from sqlalchemy import create_engine, func, select

from cloud_service.db.models import Sample, Verdict
from cloud_service.demo_teacher import build_demo_teacher
from cloud_service.settings import CloudSettings
from cloud_service.worker import VerifierWorker
from edge_agent.agent import Agent
from edge_agent.engine import EngineOptions, OrtEngine
from edge_agent.settings import AgentSettings
from edge_agent.testing import make_tiny_student
from shared.broker import free_port
from shared.topics import Topics
from tests.conftest import MosquittoProcess

FLEET = "fleet-chaos"


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
    crashed: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.without_verdict == 0

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
            "crashed": self.crashed,
            "ok": self.ok,
            "notes": "; ".join(self.notes),
        }


class Rig:
    """A private broker, models and settings for one scenario, all under ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        (folder / "broker").mkdir(parents=True, exist_ok=True)
        self.broker = MosquittoProcess(folder / "broker")
        self.broker.start()
        self.topics = Topics(prefix=f"edgeloop-chaos/{uuid.uuid4().hex[:8]}/v1")
        self.teacher = build_demo_teacher(folder / "teacher.onnx", size=32, classes=10, seed=1)
        self.student = make_tiny_student(folder / "student.onnx", size=32)
        self.engine = OrtEngine(self.student, EngineOptions(intra_op_threads=1, warmup_runs=1))
        self.database_url = f"sqlite:///{folder / 'cloud.db'}"
        self.verifier_id = f"chaos-verifier-{uuid.uuid4().hex[:8]}"

    def cloud_settings(self, **overrides: Any) -> CloudSettings:
        values: dict[str, Any] = {
            "data_dir": self.folder / "cloud",
            "mqtt_url": self.broker.url,
            "topic_prefix": self.topics.prefix,
            "database_url": self.database_url,
            "teacher_model": self.teacher,
            "blob_fsync": False,
            "review_audit_share": 0.0,
            "verifier_client_id": self.verifier_id,
            "mqtt_session_expiry_s": 900,
        }
        values.update(overrides)
        return CloudSettings(**values)

    def agent_settings(self, agent: str = "cam-1", **overrides: Any) -> AgentSettings:
        values: dict[str, Any] = {
            "data_dir": self.folder / agent,
            "model_path": self.student,
            "fleet": FLEET,
            "agent_id": agent,
            "mqtt_url": self.broker.url,
            "topic_prefix": self.topics.prefix,
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
        values.update(overrides)
        return AgentSettings(**values)

    def agent(self, agent: str = "cam-1", **overrides: Any) -> Agent:
        return Agent(self.agent_settings(agent, **overrides), engine=self.engine)

    def judge(self, outcome: Outcome, forwarded: set[str], *, evicted: int = 0) -> Outcome:
        engine = create_engine(self.database_url)
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
        outcome.lost = max(0, len(forwarded - stored) - evicted)
        outcome.duplicated = (rows - len(stored)) + (verdict_rows - len(verified))
        outcome.without_verdict = len(stored - verified)
        return outcome

    def close(self) -> None:
        self.broker.stop()


def _stream(agent: Agent, pool: list[np.ndarray], n: int, out: list[str], pace_s: float) -> None:
    for i in range(n):
        result = agent.process(pool[i % len(pool)], source="chaos")
        if getattr(result, "sample_id", None):
            out.append(result.sample_id)
        if pace_s:
            time.sleep(pace_s)


def _drain(rig: Rig, forwarded: list[str], timeout: float) -> None:
    engine = create_engine(rig.database_url)
    want = set(forwarded)

    def done() -> bool:
        with engine.connect() as conn:
            verified = set(conn.scalars(select(Verdict.sample_id)))
        return want <= verified

    until(done, timeout)
    engine.dispose()


def broker_restart(rig: Rig, *, frames_n: int = 200, down_s: float = 1.0) -> Outcome:
    """The broker restarts while the agent streams and the verifier ingests."""
    outcome = Outcome("broker restart mid-stream", f"{frames_n} frames, broker down {down_s} s")
    forwarded: list[str] = []
    with VerifierWorker(rig.cloud_settings()) as worker, rig.agent() as agent:
        until(lambda: agent.publisher.connected, 10)
        thread = threading.Thread(
            target=_stream, args=(agent, frames(16), frames_n, forwarded, 0.01)
        )
        thread.start()
        until(lambda: len(forwarded) >= frames_n // 3, 30)
        rig.broker.stop()
        time.sleep(down_s)
        rig.broker.start()
        thread.join(120)
        _drain(rig, forwarded, 60)
        until(lambda: agent.spool.depth == 0, 30)
        outcome.redelivered = worker.counts["duplicates"]
    return rig.judge(outcome, set(forwarded))


@contextmanager
def verifier_process(rig: Rig, log: Path) -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """Start ``cloud-service verifier`` processes on demand; all are stopped at the end."""
    port = free_port()
    env = {
        **os.environ,
        "EDGELOOP_MQTT_URL": rig.broker.url,
        "EDGELOOP_TOPIC_PREFIX": rig.topics.prefix,
        "EDGELOOP_DATABASE_URL": rig.database_url,
        "EDGELOOP_DATA_DIR": str(rig.folder / "cloud"),
        "EDGELOOP_TEACHER_MODEL": str(rig.teacher),
        "EDGELOOP_VERIFIER_CLIENT_ID": rig.verifier_id,
        "EDGELOOP_MQTT_SESSION_EXPIRY_S": "600",
        "EDGELOOP_LOG_LEVEL": "WARNING",
        "EDGELOOP_INGEST_MAX_BATCH": "20",
        "EDGELOOP_BLOB_FSYNC": "false",
        "EDGELOOP_REVIEW_AUDIT_SHARE": "0",
    }
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        with log.open("ab") as handle:
            process = subprocess.Popen(
                [sys.executable, "-m", "cloud_service", "verifier", "--port", str(port)],
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
            )
        started.append(process)
        ok = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            try:
                ok = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                break
            time.sleep(0.1)
        if not ok:
            raise RuntimeError(f"verifier did not become ready: {log.read_text()[-2000:]}")
        return process

    try:
        yield start
    finally:
        for process in started:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()


def verifier_sigkill(rig: Rig, *, frames_n: int = 200, kills: int = 1) -> Outcome:
    """SIGKILL the verifier subprocess mid-stream, ``kills`` times; restart it each time."""
    outcome = Outcome("verifier SIGKILL", f"{frames_n} frames, {kills} SIGKILL(s) mid-stream")
    forwarded: list[str] = []
    with verifier_process(rig, rig.folder / "verifier.log") as start:
        process = start()
        with rig.agent() as agent:
            until(lambda: agent.publisher.connected, 10)
            thread = threading.Thread(
                target=_stream, args=(agent, frames(16), frames_n, forwarded, 0.01)
            )
            thread.start()
            for k in range(kills):
                until(lambda k=k: len(forwarded) >= frames_n * (k + 1) // (kills + 1), 60)
                os.kill(process.pid, signal.SIGKILL)
                process.wait(10)
                outcome.crashed += 1
                process = start()
            thread.join(120)
            _drain(rig, forwarded, 90)
            until(lambda: agent.spool.depth == 0, 30)
    return rig.judge(outcome, set(forwarded))


def agent_offline(rig: Rig, *, frames_n: int = 60, offline_s: float = 3.0) -> Outcome:
    """The agent stops with unreceipted samples, stays away, comes back and streams again."""
    outcome = Outcome("agent offline, then back", f"{frames_n} frames each side, off {offline_s} s")
    forwarded: list[str] = []
    with VerifierWorker(rig.cloud_settings()) as worker:
        with rig.agent() as agent:
            until(lambda: agent.publisher.connected, 10)
            _stream(agent, frames(16), frames_n, forwarded, 0.0)
            depth_at_stop = agent.spool.depth
        outcome.notes.append(f"spool depth at stop {depth_at_stop}")
        time.sleep(offline_s)
        with rig.agent() as agent:
            until(lambda: agent.publisher.connected, 10)
            _stream(agent, frames(16, seed=1), frames_n, forwarded, 0.0)
            _drain(rig, forwarded, 60)
            until(lambda: agent.spool.depth == 0, 30)
        outcome.redelivered = worker.counts["duplicates"]
    return rig.judge(outcome, set(forwarded))


def spool_full(rig: Rig, *, frames_n: int = 300, max_bytes: int = 1 << 16) -> Outcome:
    """Broker away while frames arrive into a spool capped at ``max_bytes`` (a full disk)."""
    outcome = Outcome(
        "agent spool full (byte cap)", f"{frames_n} frames, broker down, spool {max_bytes} B"
    )
    forwarded: list[str] = []
    with VerifierWorker(rig.cloud_settings()) as worker:
        with rig.agent(spool_max_bytes=max_bytes) as agent:
            until(lambda: agent.publisher.connected, 10)
            rig.broker.stop()
            _stream(agent, frames(16), frames_n, forwarded, 0.0)
            stats = agent.spool.stats()
            evicted = stats.evicted_audit + stats.evicted_oldest
            outcome.notes.append(f"answered {frames_n} frames with the broker down")
            rig.broker.start()
            until(lambda: agent.spool.depth == 0, 60)
            kept = set(forwarded[-max(1, len(forwarded) - evicted) :]) if evicted else set()
            _drain(rig, list(kept) or forwarded, 60)
        outcome.redelivered = worker.counts["duplicates"]
    return rig.judge(outcome, set(forwarded), evicted=evicted)


SCENARIOS: dict[str, Callable[..., Outcome]] = {
    "broker_restart": broker_restart,
    "verifier_sigkill": verifier_sigkill,
    "agent_offline": agent_offline,
    "spool_full": spool_full,
}
