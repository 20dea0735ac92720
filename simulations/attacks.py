"""Attacks on loopback, run by the short attack tests and ``scripts/chaos.py --attacks``.

Each scenario plays one attacker against real parts (its own ``chaos_stack``: a private
Mosquitto, the real edge ``Agent``, the real verifier, a database, ``cloud-service
api`` as a subprocess) while legitimate traffic flows, and counts:

- ``tried``: hostile inputs sent;
- ``refused``: hostile inputs refused (dead-lettered with a reason, answered 4xx, cut
  off by a server, refused by the broker or the agent);
- ``accepted``: hostile inputs that took effect (stored as valid, answered 2xx,
  installed): must be zero;
- ``crashes``: 5xx answers, processes that died: must be zero;
- ``legit_sent`` / ``legit_lost``: the legitimate traffic beside the attack, and what
  of it was not stored (or not answered): must be zero.

Every loop is bounded in count and time.
"""

from __future__ import annotations

import io
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import paho.mqtt.client as mqtt
import psutil
from PIL import Image
from sqlalchemy import create_engine, func, select

from cloud_service.db.models import DeadLetter, Sample
from edge_agent.agent import Agent
from shared.envelope import encode_envelope
from shared.ids import new_sample_id
from shared.images import MAX_JPEG_SCANS
from shared.messages import SampleHeader
from simulations.chaos_rig import (
    ADMIN_TOKEN,
    FLEET,
    chaos_agent,
    chaos_stack,
    drain,
    frames,
    stream_frames,
    until,
)
from simulations.processes import ServiceProcess
from simulations.samples import scan_bomb
from simulations.stack import Stack

__all__ = [
    "AttackOutcome",
    "junk_on_agent_topic",
    "nul_inputs",
    "oversized_bodies",
    "sample_id_collision",
    "scan_bombs",
    "slow_headers",
]


@dataclass
class AttackOutcome:
    finding: str
    attack: str
    tried: int = 0
    refused: int = 0
    accepted: int = 0
    crashes: int = 0
    legit_sent: int = 0
    legit_lost: int = 0
    rss_growth_mb: float = 0.0  # the attacked process's peak RSS over its RSS before
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.accepted == 0 and self.crashes == 0 and self.legit_lost == 0

    def row(self) -> dict[str, Any]:
        return {
            "finding": self.finding,
            "attack": self.attack,
            "tried": self.tried,
            "refused": self.refused,
            "accepted": self.accepted,
            "crashes": self.crashes,
            "legit_sent": self.legit_sent,
            "legit_lost": self.legit_lost,
            "ok": self.ok,
            "notes": "; ".join(self.notes),
        }


# --- MQTT attacker ------------------------------------------------------------


def _attacker(stack: Stack, client_id: str = "") -> mqtt.Client:
    assert stack.broker is not None
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
    client.connect("127.0.0.1", stack.broker.port)
    client.loop_start()
    return client


def _publish_all(client: mqtt.Client, topic: str, payloads: list[bytes], qos: int = 1) -> None:
    for payload in payloads:
        client.publish(topic, payload, qos=qos).wait_for_publish(30)


def _jpeg(pixels: np.ndarray, *, progressive: bool = False) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90, progressive=progressive)
    return buffer.getvalue()


def _envelope(
    agent: str, image: bytes, size: tuple[int, int], sample_id: str | None = None
) -> bytes:
    header = SampleHeader(
        sample_id=sample_id or new_sample_id(),
        fleet=FLEET,
        agent=agent,
        captured_at=datetime.now(UTC),
        model_name="student",
        model_version="attack",
        scores=[0.1] * 10,
        predicted=0,
        confidence=0.1,
        route_reason="low_confidence",
        image_format="jpeg",
        image_width=size[0],
        image_height=size[1],
        image_bytes=len(image),
    )
    return encode_envelope(header, image)


def _count(stack: Stack, statement: Any) -> int:
    engine = create_engine(stack.database_url)
    try:
        with engine.connect() as conn:
            return int(conn.scalar(statement) or 0)
    finally:
        engine.dispose()


def _dead_letters(stack: Stack, agent: str, reasons: tuple[str, ...] | None = None) -> int:
    query = select(func.count()).select_from(DeadLetter).where(DeadLetter.agent_id == agent)
    if reasons:
        query = query.where(DeadLetter.reason.in_(reasons))
    return _count(stack, query)


def _stored(stack: Stack, agent: str) -> int:
    return _count(stack, select(func.count()).select_from(Sample).where(Sample.agent_id == agent))


def _stream_legit(stack: Stack, agent: Agent, n: int, out: list[str]) -> threading.Thread:
    thread = threading.Thread(
        target=stream_frames, args=(agent, frames(16), n, out, 0.005), daemon=True
    )
    thread.start()
    return thread


def _legit_lost(stack: Stack, forwarded: list[str]) -> int:
    engine = create_engine(stack.database_url)
    try:
        with engine.connect() as conn:
            stored = set(conn.scalars(select(Sample.sample_id).where(Sample.agent_id == "cam-1")))
    finally:
        engine.dispose()
    return len(set(forwarded) - stored)


def scan_bombs(folder: Path, *, bombs: int = 4, frames_n: int = 100) -> AttackOutcome:
    """JPEG bombs from a hostile device while a legitimate agent streams.

    Half are scan bombs over the scan limit (refused before decoding); half are large
    progressive JPEGs under it, whose decode the time budget must stop.
    """
    outcome = AttackOutcome(
        "1 JPEG scan bomb", f"{bombs} bombs from cam-evil beside {frames_n} legitimate frames"
    )
    rng = np.random.default_rng(7)
    slow = _jpeg(rng.integers(0, 255, (1000, 1000, 3), dtype=np.uint8), progressive=True)
    payloads = []
    for i in range(bombs):
        if i % 2 == 0:
            payloads.append(_envelope("cam-evil", scan_bomb(MAX_JPEG_SCANS * 100), (64, 64)))
        else:
            payloads.append(_envelope("cam-evil", slow, (1000, 1000)))
    forwarded: list[str] = []
    stack = chaos_stack(folder, verifier="in-process", cloud={"decode_budget_ms": 20.0})
    with stack, chaos_agent(stack) as agent:
        until(lambda: agent.publisher.connected, 10)
        attacker = _attacker(stack)
        try:
            thread = _stream_legit(stack, agent, frames_n, forwarded)
            _publish_all(attacker, stack.topics.samples(FLEET, "cam-evil"), payloads)
            thread.join(120)
        finally:
            attacker.loop_stop()
            attacker.disconnect()
        drain(stack.database_url, forwarded, 90)
        until(lambda: _dead_letters(stack, "cam-evil") + _stored(stack, "cam-evil") >= bombs, 60)
    outcome.tried = bombs
    outcome.refused = _dead_letters(stack, "cam-evil")
    outcome.accepted = _stored(stack, "cam-evil")
    outcome.legit_sent = len(forwarded)
    outcome.legit_lost = _legit_lost(stack, forwarded)
    scans = _dead_letters(stack, "cam-evil", ("jpeg_too_many_scans",))
    budget = _dead_letters(stack, "cam-evil", ("image_decode_timeout",))
    outcome.notes.append(f"dead letters by reason: scans {scans}, budget {budget}")
    return outcome


def junk_on_agent_topic(folder: Path, *, junk: int = 60, frames_n: int = 100) -> AttackOutcome:
    """Junk published on a legitimate agent's samples topic before and while it streams."""
    outcome = AttackOutcome(
        "6 breaker turned against an agent", f"{junk} junk messages on cam-1's topic"
    )
    forwarded: list[str] = []
    junk_payloads = [os.urandom(200) for _ in range(junk)]
    stack = chaos_stack(folder, verifier="in-process", cloud={"breaker_min_messages": 20})
    topic = stack.topics.samples(FLEET, "cam-1")
    with stack, chaos_agent(stack) as agent:
        until(lambda: agent.publisher.connected, 10)
        attacker = _attacker(stack)
        try:
            _publish_all(attacker, topic, junk_payloads[: junk // 2])
            until(lambda: _dead_letters(stack, "cam-1") >= junk // 2, 30)
            thread = _stream_legit(stack, agent, frames_n, forwarded)
            _publish_all(attacker, topic, junk_payloads[junk // 2 :])
            thread.join(120)
        finally:
            attacker.loop_stop()
            attacker.disconnect()
        drain(stack.database_url, forwarded, 60)
    outcome.tried = junk
    outcome.refused = _count(
        stack,
        select(func.count())
        .select_from(DeadLetter)
        .where(DeadLetter.agent_id == "cam-1", DeadLetter.sample_id.is_(None)),
    )
    outcome.legit_sent = len(forwarded)
    outcome.legit_lost = _legit_lost(stack, forwarded)
    dead_legit = _count(
        stack,
        select(func.count())
        .select_from(DeadLetter)
        .where(DeadLetter.sample_id.in_(forwarded or ["-"])),
    )
    outcome.notes.append(f"legitimate samples dead-lettered {dead_legit} times")
    return outcome


def sample_id_collision(folder: Path, *, n: int = 20) -> AttackOutcome:
    """A second device sends samples reusing the ids the first one's samples carry."""
    outcome = AttackOutcome(
        "9 sample id reused across agents", f"{n} samples from cam-2 reusing cam-1's ids"
    )
    forwarded: list[str] = []
    image = _jpeg(np.full((48, 64, 3), 90, np.uint8))
    stack = chaos_stack(folder, verifier="in-process")
    with stack, chaos_agent(stack) as agent:
        until(lambda: agent.publisher.connected, 10)
        stream_frames(agent, frames(8), n, forwarded, 0.0)
        drain(stack.database_url, forwarded, 60)
        other = _attacker(stack)
        try:
            payloads = [_envelope("cam-2", image, (64, 48), sample_id=s) for s in forwarded]
            _publish_all(other, stack.topics.samples(FLEET, "cam-2"), payloads)
        finally:
            other.loop_stop()
            other.disconnect()
        until(lambda: _stored(stack, "cam-2") >= len(forwarded), 30)
    outcome.tried = len(forwarded)
    outcome.legit_sent = 2 * len(forwarded)
    outcome.legit_lost = len(forwarded) - _stored(stack, "cam-2") + _legit_lost(stack, forwarded)
    outcome.refused = 0  # both devices' samples are legitimate: the point is to keep both
    return outcome


# --- HTTP attacker ------------------------------------------------------------


def _api(stack: Stack) -> ServiceProcess:
    api = stack.api
    assert isinstance(api, ServiceProcess)
    return api


def _pid(process: ServiceProcess) -> int:
    pid = process.pid
    assert pid is not None
    return pid


def _rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def _big_body(total: int, chunk: int = 1 << 20) -> Any:
    block = b"{" + b" " * (chunk - 1)
    sent = 0
    while sent < total:
        yield block
        sent += len(block)


def oversized_bodies(folder: Path, *, mb: int = 200, parallel: int = 4) -> AttackOutcome:
    """Unauthenticated 200 MB bodies to an authenticated route and to enrollment."""
    outcome = AttackOutcome(
        "2 bodies read before authentication",
        f"{parallel} x {mb} MB POST /v1/rollouts, {parallel} x {mb} MB POST /v1/enroll, no token",
    )
    with chaos_stack(folder, api="subprocess") as stack:
        process = _api(stack)
        base = process.url
        before = _rss_mb(_pid(process))
        peak = before
        done = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not done.is_set() and process.running:
                peak = max(peak, _rss_mb(_pid(process)))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()

        def post(path: str) -> int:
            try:
                response = httpx.post(
                    base + path,
                    content=_big_body(mb << 20),
                    headers={"content-type": "application/json"},
                    timeout=120,
                )
            except httpx.TransportError:
                return 0  # cut off by the server: refused
            return response.status_code

        with ThreadPoolExecutor(parallel * 2) as pool:
            paths = ["/v1/rollouts"] * parallel + ["/v1/enroll"] * parallel
            statuses = list(pool.map(post, paths))
        done.set()
        watcher.join(5)
        legit = httpx.get(base + "/healthz", timeout=10).status_code
        outcome.tried = len(statuses)
        outcome.refused = sum(1 for s in statuses if s == 0 or 400 <= s < 500)
        outcome.accepted = sum(1 for s in statuses if 200 <= s < 300)
        outcome.crashes = sum(1 for s in statuses if s >= 500) + (not process.running)
        outcome.legit_sent = 1
        outcome.legit_lost = int(legit != 200)
        outcome.rss_growth_mb = peak - before
        outcome.notes.append(
            f"API RSS {before:.0f} MB before, peak {peak:.0f} MB (+{peak - before:.0f} MB);"
            f" answers {sorted(set(statuses))}"
        )
    return outcome


def _partial_request(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=5)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    return sock


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except TimeoutError:
        return False
    except OSError:
        return True


def slow_headers(
    folder: Path, *, connections: int = 200, header_timeout_s: float = 1.0
) -> AttackOutcome:
    """``connections`` half-sent request heads held open (slowloris) against the API."""
    outcome = AttackOutcome(
        "9 slow headers", f"{connections} connections holding a half-sent request head"
    )
    timeouts = {"http_header_timeout_s": header_timeout_s}
    with chaos_stack(folder, api="subprocess", cloud=timeouts) as stack:
        process = _api(stack)
        socks = [_partial_request("127.0.0.1", process.port) for _ in range(connections)]
        legit = httpx.get(process.url + "/healthz", timeout=30).status_code
        closed = sum(_closed_by_server(s, header_timeout_s * 10) for s in socks)
        for s in socks:
            s.close()
        outcome.tried = connections
        outcome.refused = closed
        outcome.accepted = connections - closed
        outcome.crashes = int(not process.running)
        outcome.legit_sent = 1
        outcome.legit_lost = int(legit != 200)
    return outcome


def nul_inputs(folder: Path) -> AttackOutcome:
    """NUL and control bytes in query strings and paths, and V2 shapes past 2^52."""
    outcome = AttackOutcome("9 NUL and overflow inputs", "NUL in queries and paths, huge V2 shape")
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    requests: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "/v1/samples?agent=%00", {}),
        ("GET", "/v1/samples?fleet=a%00b", {}),
        ("GET", "/v1/samples/%00", {}),
        ("GET", "/v1/agents/x%00y", {}),
        ("GET", "/v1/dead-letters?reason=%00", {}),
        ("GET", "/ui/queue?agent=%00", {}),
        (
            "POST",
            "/v2/models/teacher/infer",
            {
                "json": {
                    "inputs": [
                        {
                            "name": "frames",
                            "shape": [2**52 + 1, 1],
                            "datatype": "UINT8",
                            "data": [1],
                        }
                    ]
                }
            },
        ),
    ]
    with chaos_stack(folder, api="subprocess") as stack:
        base = stack.api_url
        for method, path, kwargs in requests:
            answer = httpx.request(method, base + path, headers=headers, timeout=30, **kwargs)
            outcome.tried += 1
            if answer.status_code >= 500:
                outcome.crashes += 1
            elif 300 <= answer.status_code < 500:  # a 303 to the login page refuses too
                outcome.refused += 1
            else:
                outcome.accepted += 1
                outcome.notes.append(f"{method} {path}: {answer.status_code}")
    return outcome
