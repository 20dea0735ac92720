"""Chaos scenarios on loopback, shared by the short tests and ``scripts/chaos.py``.

Each scenario runs real parts: a private Mosquitto, the real edge ``Agent`` (tiny
student, disk spool), the real verifier (in-process, or a ``cloud-service verifier``
subprocess where it is to be SIGKILLed), a database; it injects one fault and
returns counts, judged against the database after the system drained:

- ``lost``: forwarded by the agent, never stored, not evicted from the spool; over
  HTTP, a write answered 2xx that the store does not hold (or an enrollment token
  spent whose answer never arrived);
- ``duplicated``: stored sample rows or verdict rows beyond one per sample id; over
  HTTP, a label stored twice or a token spent twice;
- ``without_verdict``: stored, still no verdict;
- ``evicted``: dropped by the spool's eviction policy (by design, counted);
- ``redelivered``: deliveries the cloud absorbed as duplicates (expected, harmless);
- ``refused``: requests or writes refused while the fault lasted and retried by the
  client (expected; each one was retried until it succeeded);
- ``server_errors``: HTTP 5xx answers (must be zero);
- ``crashed``: processes killed by the scenario (injected, not found);
- ``recovered``: every kind of client was served again after the fault.

The PostgreSQL scenario runs a private server (``initdb`` into a temp folder, a free
port) that it stops and starts; the API scenario runs ``cloud-service api`` as a
subprocess that it SIGKILLs and starts again.

Every loop is bounded in count and time.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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

from cloud_service.db.crud import hash_token
from cloud_service.db.models import Agent as AgentRow
from cloud_service.db.models import EnrollmentToken, Label, Sample, Verdict
from cloud_service.demo_teacher import build_demo_teacher
from cloud_service.settings import CloudSettings
from cloud_service.worker import VerifierWorker
from edge_agent.agent import Agent
from edge_agent.engine import EngineOptions, OrtEngine
from edge_agent.enroll import enroll
from edge_agent.settings import AgentSettings
from edge_agent.testing import make_tiny_student
from shared.broker import free_port
from shared.errors import ConfigError, TransportError
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
        outcome.lost += max(0, len(forwarded - stored) - evicted)
        outcome.duplicated += (rows - len(stored)) + (verdict_rows - len(verified))
        outcome.without_verdict += len(stored - verified)
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


def _reached(items: list[str], n: int) -> Callable[[], bool]:
    return lambda: len(items) >= n


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
                until(_reached(forwarded, frames_n * (k + 1) // (kills + 1)), 60)
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


# --- PostgreSQL restart ------------------------------------------------------

POSTGRES_BIN = Path(os.environ.get("EDGELOOP_POSTGRES_BIN", "/usr/lib/postgresql/15/bin"))


def postgres_binaries() -> Path | None:
    """The folder holding ``initdb`` and ``postgres``, or None when PostgreSQL is not installed."""
    for folder in (POSTGRES_BIN, *(Path(p) for p in os.get_exec_path())):
        if (folder / "initdb").exists() and (folder / "postgres").exists():
            return folder
    return None


class PostgresProcess:
    """A private PostgreSQL on a free loopback port: ``start()``, ``stop()``, its ``url``.

    As root the server runs as the ``postgres`` user (PostgreSQL refuses root), so its
    data folder is made outside pytest's root-only temp tree.
    """

    def __init__(self, binaries: Path) -> None:
        self.binaries = binaries
        self.folder = Path(tempfile.mkdtemp(prefix="edgeloop-chaos-pg-"))
        self.data = self.folder / "data"
        self.port = free_port()
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = "postgres"
            entry = pwd.getpwnam(self.user)
            os.chown(self.folder, entry.pw_uid, entry.pw_gid)
        self.process: subprocess.Popen[bytes] | None = None
        initdb = [str(binaries / "initdb"), "-D", str(self.data), "-A", "trust"]
        subprocess.run(
            [*initdb, "-U", "postgres", "--no-sync", "-E", "UTF8"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            user=self.user,
        )

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self, timeout: float = 30.0) -> None:
        log = (self.folder / "postgres.log").open("ab")
        options = {
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self.folder),
            "fsync": "off",
            "max_connections": "40",
            "shared_buffers": "16MB",
        }
        command = [str(self.binaries / "postgres"), "-D", str(self.data), "-p", str(self.port)]
        for name, value in options.items():
            command += ["-c", f"{name}={value}"]
        self.process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            user=self.user,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not start: {self.log_tail()}")
            if _accepts(self.port):
                ready = subprocess.run(
                    [str(self.binaries / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                if ready.returncode == 0:
                    return
            time.sleep(0.1)

    def stop(self) -> None:
        """A fast shutdown: open connections are cut, as in a restart."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def log_tail(self) -> str:
        path = self.folder / "postgres.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def postgres_restart(
    rig: Rig, *, frames_n: int = 200, down_s: float = 3.0, stream_s: float | None = None
) -> Outcome:
    """PostgreSQL stops for ``down_s`` while the agent streams; samples flow before, during, after.

    The stream is paced over ``stream_s`` (default ``down_s + 6``) so a third of it
    lands before the outage and the rest during and after it.
    """
    binaries = postgres_binaries()
    if binaries is None:
        raise RuntimeError("PostgreSQL binaries (initdb, postgres) are not installed")
    outcome = Outcome(
        "PostgreSQL restarted", f"{frames_n} frames, PostgreSQL down {down_s:g} s mid-stream"
    )
    pg = PostgresProcess(binaries)
    forwarded: list[str] = []
    try:
        pg.start()
        rig.database_url = pg.url
        pace = (stream_s if stream_s is not None else down_s + 6.0) / frames_n
        with VerifierWorker(rig.cloud_settings()) as worker, rig.agent() as agent:
            until(lambda: agent.publisher.connected, 10)
            thread = threading.Thread(
                target=_stream, args=(agent, frames(16), frames_n, forwarded, pace)
            )
            thread.start()
            until(lambda: len(forwarded) >= frames_n // 3, 60)
            pg.stop()
            at_stop = len(forwarded)
            time.sleep(down_s)
            during = len(forwarded) - at_stop
            pg.start()
            thread.join(max(120.0, 3 * frames_n * pace))
            _drain(rig, forwarded, 120)
            until(lambda: agent.spool.depth == 0, 60)
            outcome.redelivered = worker.counts["duplicates"]
            refused = worker.metrics.registry.get_sample_value("edgeloop_store_errors_total")
            outcome.refused = int(refused or 0)
            outcome.notes.append(f"{during} frames forwarded while PostgreSQL was down")
            outcome.notes.append(f"{outcome.refused} storage attempts refused and retried")
        return rig.judge(outcome, set(forwarded))
    finally:
        pg.close()


# --- API restart -------------------------------------------------------------

ADMIN_TOKEN = "chaos-admin-token-0123456789abcdef"


@contextmanager
def api_process(
    rig: Rig, log: Path, **extra_env: str
) -> Iterator[tuple[str, Callable[[], subprocess.Popen[bytes]]]]:
    """``cloud-service api`` on a fixed free port, started on demand; all stopped at the end.

    ``extra_env`` adds or overrides ``EDGELOOP_*`` variables of the process."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "EDGELOOP_MQTT_URL": rig.broker.url,
        "EDGELOOP_TOPIC_PREFIX": rig.topics.prefix,
        "EDGELOOP_DATABASE_URL": rig.database_url,
        "EDGELOOP_DATA_DIR": str(rig.folder / "cloud"),
        "EDGELOOP_TEACHER_MODEL": str(rig.teacher),
        "EDGELOOP_ADMIN_TOKEN": ADMIN_TOKEN,
        "EDGELOOP_LOG_LEVEL": "WARNING",
        "EDGELOOP_ROLLOUT_TICK_S": "0",
        "EDGELOOP_BLOB_FSYNC": "false",
        # The load is many requests from one address: limits are tested elsewhere.
        "EDGELOOP_RATE_LIMIT_ENROLL_PER_MIN": "0",
        "EDGELOOP_RATE_LIMIT_UPLOAD_PER_MIN": "0",
        **extra_env,
    }
    started: list[subprocess.Popen[bytes]] = []
    command = [sys.executable, "-m", "cloud_service", "api", "--host", "127.0.0.1"]

    def start() -> subprocess.Popen[bytes]:
        with log.open("ab") as handle:
            process = subprocess.Popen(
                [*command, "--port", str(port)],
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
            )
        started.append(process)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    return process
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the API did not come up: {log.read_text()[-2000:]}")

    try:
        yield base, start
    finally:
        for process in started:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)


@dataclass
class ApiLoad:
    """What the HTTP clients did while the API was killed and restarted."""

    base: str
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    refused: int = 0  # connection refused or cut: retried
    server_errors: int = 0
    minted: set[str] = field(default_factory=set)  # agent ids whose token was answered 201
    enrolled: dict[str, str] = field(default_factory=dict)  # agent id -> api token
    enroll_lost: int = 0  # token spent, answer never received
    enroll_refused: int = 0  # an answered token refused at enrollment
    labels_acked: dict[str, int] = field(default_factory=dict)  # sample id -> label
    label_retries_unknown: int = 0  # a label POST whose answer was lost, then retried
    polls: int = 0
    infers: int = 0
    errors: list[str] = field(default_factory=list)

    def call(self, method: str, path: str, **kwargs: Any) -> tuple[httpx.Response | None, int]:
        """One request, retried on transport errors until answered; (answer, transport errors)."""
        failures = 0
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            with self.lock:
                self.requests += 1
            try:
                response = httpx.request(method, self.base + path, timeout=10, **kwargs)
            except httpx.TransportError:
                failures += 1
                with self.lock:
                    self.refused += 1
                time.sleep(0.2)
                continue
            if response.status_code >= 500:
                with self.lock:
                    self.server_errors += 1
                    self.errors.append(f"{method} {path}: {response.status_code}")
            return response, failures
        return None, failures


ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _enroll_loop(load: ApiLoad, fleet: str) -> None:
    i = 0
    while not load.stop.is_set():
        agent_id = f"enr-{i}"
        i += 1
        response, _ = load.call(
            "POST",
            "/v1/enrollment-tokens",
            json={"fleet": fleet, "agent_id": agent_id},
            headers=ADMIN_HEADERS,
        )
        if response is None or response.status_code != 201:
            load.errors.append(f"token for {agent_id}: {response and response.status_code}")
            continue
        token = response.json()["token"]
        with load.lock:
            load.minted.add(agent_id)
        unsure = False
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                answer = enroll(load.base, token, agent_id=agent_id, timeout=10)
            except TransportError:
                unsure = True  # the request may have been spent before the answer was lost
                with load.lock:
                    load.refused += 1
                time.sleep(0.2)
                continue
            except ConfigError as exc:
                with load.lock:
                    if unsure and "already used" in str(exc):
                        load.enroll_lost += 1
                    else:
                        load.enroll_refused += 1
                    load.errors.append(f"enroll {agent_id}: {exc}")
                break
            with load.lock:
                load.enrolled[agent_id] = answer["api_token"]
            break
        time.sleep(0.05)


def _poll_loop(load: ApiLoad, teacher: str) -> None:
    frame: dict[str, Any] = {"name": "frames", "shape": [1, 32, 32, 3], "datatype": "UINT8"}
    frame["data"] = [0] * (32 * 32 * 3)
    body = {"inputs": [frame]}
    while not load.stop.is_set():
        response, _ = load.call("GET", f"/v2/models/{teacher}/ready")
        if response is not None and response.status_code == 200:
            with load.lock:
                load.polls += 1
        response, _ = load.call("POST", f"/v2/models/{teacher}/infer", json=body)
        if response is not None and response.status_code == 200:
            with load.lock:
                load.infers += 1
        elif response is not None:
            load.errors.append(f"infer: {response.status_code} {response.text[:120]}")
        time.sleep(0.05)


def _label_loop(load: ApiLoad, forwarded: list[str]) -> None:
    done = 0
    while not load.stop.is_set():
        if done >= len(forwarded):
            time.sleep(0.1)
            continue
        sample_id = forwarded[done]
        label = done % 2  # every model here has at least two classes
        response, failures = load.call(
            "POST",
            f"/v1/samples/{sample_id}/labels",
            json={"label": label, "labeled_by": "chaos"},
            headers=ADMIN_HEADERS,
        )
        if response is not None and response.status_code == 404:
            time.sleep(0.1)  # not stored yet: it is on its way over MQTT
            continue
        if response is not None and response.status_code == 201:
            with load.lock:
                load.labels_acked[sample_id] = label
                load.label_retries_unknown += failures > 0
        elif response is not None:
            load.errors.append(f"label: {response.status_code} {response.text[:120]}")
        done += 1
        time.sleep(0.05)


def api_restart(
    rig: Rig,
    *,
    frames_n: int = 200,
    kills: int = 1,
    down_s: float = 1.0,
    pace_s: float = 0.03,
    served_after: int = 5,
) -> Outcome:
    """SIGKILL ``cloud-service api`` ``kills`` times while agents enroll, poll and upload.

    The kills are spread over the stream (``frames_n`` frames, ``pace_s`` apart); each
    restart waits ``down_s`` before starting the API again.

    Samples stream over MQTT to an in-process verifier meanwhile; HTTP clients retry
    on refused or cut connections. Judged: samples as everywhere; every enrollment
    answered (a token spent whose answer was lost counts as lost); every acknowledged
    label stored once; no 5xx.
    """
    outcome = Outcome(
        "API restart",
        f"{frames_n} frames + enroll/poll/infer/label load, {kills} SIGKILL(s), down {down_s:g} s",
    )
    forwarded: list[str] = []
    teacher = rig.cloud_settings().teacher_name
    with (
        VerifierWorker(rig.cloud_settings()) as worker,
        api_process(rig, rig.folder / "api.log") as (base, start),
    ):
        process = start()
        load = ApiLoad(base)
        with rig.agent() as agent:
            until(lambda: agent.publisher.connected, 10)
            stream = threading.Thread(
                target=_stream, args=(agent, frames(16), frames_n, forwarded, pace_s)
            )
            clients = [
                threading.Thread(target=_enroll_loop, args=(load, FLEET), name="enroll"),
                threading.Thread(target=_poll_loop, args=(load, teacher), name="poll"),
                threading.Thread(target=_label_loop, args=(load, forwarded), name="label"),
            ]
            stream.start()
            for thread in clients:
                thread.start()
            for k in range(kills):
                until(_reached(forwarded, frames_n * (k + 1) // (kills + 1)), 120)
                os.kill(process.pid, signal.SIGKILL)
                process.wait(10)
                outcome.crashed += 1
                time.sleep(down_s)
                process = start()
            # After the last restart every kind of client is served again, ``served_after``
            # times each, before the load stops.
            since = (load.polls, len(load.enrolled), len(load.labels_acked))
            outcome.recovered = until(
                lambda: (
                    load.polls >= since[0] + served_after
                    and len(load.enrolled) >= since[1] + served_after
                    and len(load.labels_acked) >= min(since[2] + served_after, frames_n)
                ),
                60,
            )
            stream.join(180)
            load.stop.set()
            for thread in clients:
                thread.join(120)
            _drain(rig, forwarded, 90)
            until(lambda: agent.spool.depth == 0, 30)
        outcome.redelivered = worker.counts["duplicates"]
    outcome.refused = load.refused
    outcome.server_errors = load.server_errors
    # Every answered write must be in the store: tokens, enrollments (with the API
    # token that was answered), labels; none of them twice.
    engine = create_engine(rig.database_url)
    try:
        with engine.connect() as conn:
            tokens_for = list(conn.scalars(select(EnrollmentToken.agent_id)))
            keys = dict(conn.execute(select(AgentRow.agent_id, AgentRow.api_token_hash)).all())
            used = list(
                conn.scalars(
                    select(EnrollmentToken.used_by).where(EnrollmentToken.used_at.is_not(None))
                )
            )
            mine = select(Label.sample_id, Label.label).where(Label.labeled_by == "chaos")
            labels = list(conn.execute(mine))
    finally:
        engine.dispose()
    tokens_lost = len(load.minted - set(tokens_for))
    enrollments_lost = sum(
        1 for agent_id, token in load.enrolled.items() if keys.get(agent_id) != hash_token(token)
    )
    twice = len(used) - len(set(used))
    stored_labels: dict[str, list[int]] = {}
    for sample_id, label in labels:
        stored_labels.setdefault(sample_id, []).append(label)
    labels_lost = sum(
        1 for sid, label in load.labels_acked.items() if label not in stored_labels.get(sid, [])
    )
    labels_twice = sum(len(v) - 1 for v in stored_labels.values() if len(v) > 1)
    outcome.lost += (
        tokens_lost + enrollments_lost + load.enroll_lost + load.enroll_refused + labels_lost
    )
    outcome.duplicated += twice + labels_twice
    outcome.notes += [
        f"{load.requests} HTTP requests",
        f"{len(load.minted)} enrollment tokens answered ({tokens_lost} not stored)",
        f"{len(load.enrolled)} agents enrolled ({enrollments_lost} not stored, "
        f"{load.enroll_lost} tokens spent with the answer lost, "
        f"{load.enroll_refused} answered tokens refused)",
        f"{load.polls} polls, {load.infers} infers answered",
        f"{len(load.labels_acked)} labels acknowledged ({labels_lost} missing, "
        f"{labels_twice} stored twice after a retry)",
    ]
    if load.errors:
        outcome.notes.append(f"first errors: {load.errors[:3]}")
    return rig.judge(outcome, set(forwarded))


SCENARIOS: dict[str, Callable[..., Outcome]] = {
    "broker_restart": broker_restart,
    "verifier_sigkill": verifier_sigkill,
    "api_restart": api_restart,
    "agent_offline": agent_offline,
    "spool_full": spool_full,
    "postgres_restart": postgres_restart,
}
