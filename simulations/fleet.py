"""Fleet load: hundreds of simulated agents against the real broker and the real verifier.

    edgeloop sim fleet [--sizes 50,100,200,400,800] [--rate 1.0] [--json]

What runs, all on loopback:

* a broker: a private Mosquitto configured like the one ``cloud-service
  broker-config`` generates (``set_tcp_nodelay true``, queues sized for the fleet),
  or any broker by URL;
* the verifier as its own process (``python -m cloud_service verifier``: MQTT
  ingest, blobs, teacher batches, verdicts, receipts) on PostgreSQL (a fresh
  database) or SQLite;
* the simulated fleet, in this process: one paho client per agent, each with its
  own connection and client id, all driven by one asyncio event loop (paho's
  external-loop hooks: a reader and, when needed, a writer per socket) instead of a
  thread each. Every agent publishes real sample envelopes (``shared.envelope``,
  ``SampleHeader``) at QoS 1 on its own samples topic at a fixed per-agent rate with
  a random phase, and subscribes to its own receipts and verdicts.

One step per fleet size: a warm-up, a measured window, then a drain (no more
publishing) until every sample has its verdict or the drain period ends.
Capture-to-verdict latency is measured on the agent: from the ``captured_at`` it
put in the header to the verdict's arrival. A sample without a verdict at the end
of the drain counts as lost. The knee is the first size whose achieved throughput
falls below ``knee_ratio`` of the offered load, that loses samples, or whose p99
exceeds its bound.

The simulated agents do not run the student, keep a spool or republish: they are
load, not ``edge_agent.Agent`` processes. The generator's own CPU time is reported
beside the figures so a saturated generator is not mistaken for a saturated cloud.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import paho.mqtt.client as mqtt
import psutil
from PIL import Image
from rich.console import Console
from rich.table import Table

from shared.broker import MosquittoProcess, free_port
from shared.envelope import encode_envelope
from shared.errors import EdgeLoopError, MessageError, TransportError
from shared.ids import new_sample_id
from shared.messages import Receipt, SampleHeader, Verdict, decode_message
from shared.mqtt import MqttTarget, ProtocolName, make_client, negotiate_protocol
from shared.topics import Topics

__all__ = [
    "FleetConfig",
    "FleetStep",
    "find_knee",
    "private_mosquitto",
    "run_fleet",
]

POSTGRES_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@dataclass(frozen=True)
class FleetConfig:
    """The knobs of one fleet sweep."""

    sizes: tuple[int, ...] = (50, 100, 200, 400, 800)
    rate_per_agent: float = 1.0  # samples/s each agent forwards
    warmup_s: float = 3.0
    duration_s: float = 20.0  # measured window, after the warm-up
    drain_s: float = 20.0
    image_px: int = 208  # camera crop side; JPEG q90 ~20 KB envelopes, as in bench/cloud.py
    teacher: str = "auto"  # auto | reference | quick | demo | a path to an ONNX file
    broker_url: str | None = None  # None: a private Mosquitto
    database_url: str | None = None  # None: a fresh PostgreSQL database, else SQLite
    postgres_admin_url: str = POSTGRES_ADMIN_URL
    fleet: str = "sim"
    knee_ratio: float = 0.9
    knee_p99_s: float = 1.0
    knee_p99_factor: float = 5.0
    seed: int = 0


@dataclass
class FleetStep:
    """The figures of one fleet size."""

    agents: int
    rate_per_agent: float
    offered_per_s: float  # nominal: agents x rate
    published_per_s: float  # what the generator actually sent in the window
    achieved_per_s: float  # verdicts received in the window
    receipts_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    published: int
    lost: int
    loss_share: float
    generator_cpu_cores: float  # CPU seconds per wall second of this process
    generator_lag_p99_ms: float  # how late the generator published against its schedule
    verifier_cpu_cores: float | None
    broker_cpu_cores: float | None
    window_s: float
    backlog_in: int = 0  # earlier steps' samples still without a verdict when this one began
    verifier_cpu_ms_per_verdict: float | None = None  # the verifier's CPU time per verdict
    load_avg_1m: float = 0.0  # the machine's 1-minute load average as the window ended
    healthy: bool = False

    def row(self) -> dict[str, Any]:
        return asdict(self)


# --- the broker --------------------------------------------------------------


def private_mosquitto(workdir: Path, *, max_queued: int = 200_000) -> MosquittoProcess:
    """A Mosquitto on a free loopback port, configured for a fleet (``with`` runs it)."""
    return MosquittoProcess(
        workdir,
        persistence=False,
        # Sized so the broker never drops a queued QoS 1 message in this run: loss then
        # means the cloud did not keep up, not a broker queue limit.
        max_queued=max_queued,
        extra_config="max_inflight_messages 1000\nmax_connections -1\n",
    )


# --- the database and the teacher ---------------------------------------------


@contextlib.contextmanager
def _database(config: FleetConfig, workdir: Path) -> Iterator[str]:
    """The configured database, else a fresh PostgreSQL database, else a SQLite file."""
    if config.database_url:
        yield config.database_url
        return
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"edgeloop_fleet_{uuid.uuid4().hex[:8]}"
    try:
        admin = create_engine(config.postgres_admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception:  # no PostgreSQL answering: SQLite keeps the simulation running
        yield f"sqlite:///{workdir / 'fleet.db'}"
        return
    try:
        url = make_url(config.postgres_admin_url).set(database=name)
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def resolve_teacher(choice: str, workdir: Path) -> tuple[Path, str]:
    """The teacher ONNX file for ``choice`` and a name for it in the report."""
    from distill.cache import bootstrap_reference_models, reference_model_path

    if choice == "demo":
        from cloud_service.demo_teacher import build_demo_teacher

        path = build_demo_teacher(workdir / "teacher.onnx", size=64, hidden=2048, seed=0)
        return path, "demo teacher (seeded, 64 px, 2048-wide dense; as bench/cloud.py)"
    if choice in ("reference", "auto"):
        try:
            return reference_model_path("teacher"), "reference teacher (full)"
        except EdgeLoopError:
            if choice == "reference":
                raise
    if choice in ("quick", "auto"):
        with contextlib.suppress(EdgeLoopError):
            return reference_model_path("teacher", quick=True), "reference teacher (quick)"
        models = bootstrap_reference_models(quick=True)
        return models.teacher_onnx, "reference teacher (quick)"
    path = Path(choice)
    if not path.is_file():
        raise EdgeLoopError(
            f"teacher {choice!r} is neither auto, reference, quick, demo nor an ONNX file"
        )
    return path, f"teacher {path.name}"


# --- the verifier process ------------------------------------------------------


class VerifierProcess:
    """``python -m cloud_service verifier`` with its settings in the environment."""

    def __init__(
        self, *, mqtt_url: str, database_url: str, teacher: Path, prefix: str, workdir: Path
    ) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.env = {
            **os.environ,
            "EDGELOOP_MQTT_URL": mqtt_url,
            "EDGELOOP_DATABASE_URL": database_url,
            "EDGELOOP_DATA_DIR": str(workdir / "cloud"),
            "EDGELOOP_TEACHER_MODEL": str(teacher),
            "EDGELOOP_TOPIC_PREFIX": prefix,
            "EDGELOOP_VERIFIER_CLIENT_ID": f"fleet-verifier-{uuid.uuid4().hex[:6]}",
            "EDGELOOP_MQTT_SESSION_EXPIRY_S": "0",
            "EDGELOOP_LOG_LEVEL": "WARNING",
        }
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "verifier.log"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def blob_dir(self) -> Path:
        return self.workdir / "cloud" / "blobs"

    def __enter__(self) -> VerifierProcess:
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cloud_service", "verifier", "--port", str(self.port)],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 90
        with httpx.Client(timeout=1.0) as http:
            while True:
                if self.process.poll() is not None:
                    raise TransportError(
                        f"the verifier exited at start; its log:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(f"http://127.0.0.1:{self.port}/readyz").status_code == 200:
                        return self
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise TransportError(f"the verifier was not ready in 90 s:\n{self.log_tail()}")
                time.sleep(0.2)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None


def _cpu_seconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        times = proc.cpu_times()
        total = times.user + times.system
        for child in proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                t = child.cpu_times()
                total += t.user + t.system
        return float(total)
    except psutil.Error:
        return None


# --- the simulated agents --------------------------------------------------------


def _camera_jpeg(px: int, seed: int) -> bytes:
    """A camera crop as JPEG q90: smooth texture plus noise, like bench/envelope.py's frames."""
    rng = np.random.default_rng(seed)
    pixels = (rng.random((px, px, 3)) * 60 + 100).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@dataclass
class _Ledger:
    """What the fleet sent and got back, keyed by sample id (one ledger per run)."""

    captured: dict[str, float] = field(default_factory=dict)  # sample id -> capture wall time
    step_of: dict[str, int] = field(default_factory=dict)
    verdict_at: dict[str, float] = field(default_factory=dict)
    receipt_at: dict[str, float] = field(default_factory=dict)
    refused: int = 0

    def on_verdict(self, payload: bytes | bytearray) -> None:
        now = time.time()
        try:
            verdict = decode_message(payload, Verdict)
        except MessageError:
            self.refused += 1
            return
        self.verdict_at.setdefault(verdict.sample_id, now)

    def on_receipt(self, payload: bytes | bytearray) -> None:
        now = time.time()
        try:
            receipt = decode_message(payload, Receipt)
        except MessageError:
            self.refused += 1
            return
        for sid in receipt.sample_ids:
            self.receipt_at.setdefault(sid, now)


class _SimAgent:
    """One simulated agent: its own paho client and connection, driven by the shared loop."""

    def __init__(
        self,
        name: str,
        client: mqtt.Client,
        topics: Topics,
        fleet: str,
        ledger: _Ledger,
    ) -> None:
        self.name = name
        self.client = client
        self.fleet = fleet
        self.ledger = ledger
        self.samples_topic = topics.samples(fleet, name)
        self.verdicts_topic = topics.verdicts(fleet, name)
        self.receipts_topic = topics.receipts(fleet, name)
        self.ready = asyncio.Event()
        self.misc_ok = True
        client.on_connect = self._on_connect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any
    ) -> None:
        if not getattr(reason, "is_failure", False):
            client.subscribe([(self.verdicts_topic, 1), (self.receipts_topic, 1)])

    def _on_subscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, codes: Any, props: Any
    ) -> None:
        self.ready.set()

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        if msg.topic == self.verdicts_topic:
            self.ledger.on_verdict(msg.payload)
        elif msg.topic == self.receipts_topic:
            self.ledger.on_receipt(msg.payload)


class _LoopDriver:
    """Drives many paho clients from one asyncio loop (paho's external event-loop hooks)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.clients: list[mqtt.Client] = []

    def attach(self, client: mqtt.Client) -> None:
        nodelay = client.on_socket_open  # make_client's TCP_NODELAY hook

        def on_open(c: mqtt.Client, userdata: Any, sock: Any) -> None:
            if nodelay is not None:
                nodelay(c, userdata, sock)
            self.loop.add_reader(sock, c.loop_read)

        def on_close(c: mqtt.Client, userdata: Any, sock: Any) -> None:
            self.loop.remove_reader(sock)
            self.loop.remove_writer(sock)

        def on_register_write(c: mqtt.Client, userdata: Any, sock: Any) -> None:
            self.loop.add_writer(sock, c.loop_write)

        def on_unregister_write(c: mqtt.Client, userdata: Any, sock: Any) -> None:
            self.loop.remove_writer(sock)

        client.on_socket_open = on_open
        client.on_socket_close = on_close
        client.on_socket_register_write = on_register_write
        client.on_socket_unregister_write = on_unregister_write
        self.clients.append(client)

    async def misc_loop(self) -> None:
        """Keepalive pings and retries for every client, once a second."""
        while True:
            for client in self.clients:
                client.loop_misc()
            await asyncio.sleep(1.0)


async def _connect_agents(
    agents: Sequence[_SimAgent], target: MqttTarget, *, batch: int = 50, timeout: float = 60.0
) -> None:
    for start in range(0, len(agents), batch):
        group = agents[start : start + batch]
        for agent in group:
            try:
                agent.client.connect(target.host, target.port, keepalive=60)
            except OSError as exc:
                raise TransportError(f"agent {agent.name} cannot connect: {exc}") from exc
        await asyncio.wait_for(asyncio.gather(*(a.ready.wait() for a in group)), timeout)


async def _publish_schedule(
    agents: Sequence[_SimAgent],
    *,
    rate: float,
    seconds: float,
    template: SampleHeader,
    image: bytes,
    ledger: _Ledger,
    step: int,
    seed: int,
    lags: list[float],
) -> None:
    """Each agent publishes every ``1/rate`` s from a random phase, for ``seconds``."""
    rng = random.Random(seed)
    period = 1.0 / rate
    phases = sorted((rng.random() * period, i) for i in range(len(agents)))
    start = time.monotonic()
    rounds = max(1, round(seconds * rate))
    due_list = [
        (k * period + phase, i) for k in range(rounds) for phase, i in phases
    ]  # already in time order
    pos = 0
    while pos < len(due_list):
        now = time.monotonic() - start
        due, _ = due_list[pos]
        if due > now:
            await asyncio.sleep(due - now)
            continue
        while pos < len(due_list) and due_list[pos][0] <= now:
            due, i = due_list[pos]
            lags.append(now - due)
            agent = agents[i]
            sample_id = new_sample_id()
            captured = time.time()
            header = template.model_copy(
                update={
                    "sample_id": sample_id,
                    "agent": agent.name,
                    "captured_at": datetime.fromtimestamp(captured, UTC),
                }
            )
            ledger.captured[sample_id] = captured
            ledger.step_of[sample_id] = step
            agent.client.publish(agent.samples_topic, encode_envelope(header, image), qos=1)
            pos += 1
        await asyncio.sleep(0)  # let sockets drain between bursts


def _sample_template(fleet: str, image: bytes, px: int) -> SampleHeader:
    scores = [0.61, 0.2, 0.05, 0.04, 0.03, 0.02, 0.02, 0.01, 0.01, 0.01]
    return SampleHeader(
        sample_id=new_sample_id(),
        fleet=fleet,
        agent="cam-00000",
        captured_at=datetime.now(UTC),
        model_name="edgeloop-student",
        model_version="sim",
        scores=scores,
        predicted=0,
        confidence=0.61,
        route_reason="low_confidence",
        priority=6,
        image_format="jpeg",
        image_width=px,
        image_height=px,
        image_bytes=len(image),
    )


def _payload_bytes(config: FleetConfig) -> int:
    """Bytes of one sample envelope as the simulated agents send it."""
    image = _camera_jpeg(config.image_px, config.seed)
    return len(encode_envelope(_sample_template(config.fleet, image, config.image_px), image))


def _percentile_ms(values: Sequence[float], q: float) -> float | None:
    return None if not values else round(float(np.percentile(values, q)) * 1000, 1)


# --- the knee ----------------------------------------------------------------------


def find_knee(
    steps: Sequence[FleetStep],
    *,
    ratio: float = 0.9,
    p99_limit_s: float = 1.0,
    p99_factor: float = 5.0,
) -> dict[str, Any]:
    """Mark each step healthy or not and name the knee: the step after the last healthy one.

    A step is healthy when achieved throughput is at least ``ratio`` of the load the
    generator sent, nothing was lost, its p99 is within ``max(p99_limit_s,
    p99_factor x the first step's p99)``, and it did not start behind (no backlog
    from an earlier step). Unhealthy steps below the last healthy one (a passing
    hiccup, such as a neighbour's burst on a shared machine) are listed, not taken
    for the knee.
    """
    base = next((s.p99_ms for s in steps if s.p99_ms is not None), None)
    bound_ms = max(p99_limit_s * 1000, p99_factor * base) if base is not None else None
    for step in steps:
        # Against what the generator really sent: a starved generator is not a slow cloud.
        sent = step.published_per_s
        tracks = sent > 0 and step.achieved_per_s >= ratio * sent
        tail_ok = step.p99_ms is not None and (bound_ms is None or step.p99_ms <= bound_ms)
        step.healthy = bool(tracks and step.lost == 0 and tail_ok and step.backlog_in == 0)
    healthy_at = [i for i, s in enumerate(steps) if s.healthy]
    last_ok = steps[healthy_at[-1]] if healthy_at else None
    after = healthy_at[-1] + 1 if healthy_at else 0
    knee = steps[after] if after < len(steps) else None
    hiccups = [s.agents for s in steps[: healthy_at[-1] if healthy_at else 0] if not s.healthy]
    capacity = max((s.achieved_per_s for s in steps), default=0.0)
    reason = None
    if knee is not None:
        why = []
        if knee.achieved_per_s < ratio * knee.published_per_s:
            why.append(
                f"achieved {knee.achieved_per_s:.0f}/s < {ratio:.0%} of offered"
                f" {knee.published_per_s:.0f}/s"
            )
        if knee.lost:
            why.append(f"{knee.lost} samples without a verdict after the drain")
        if knee.backlog_in:
            why.append(f"started behind by {knee.backlog_in} samples")
        if knee.p99_ms is None or (bound_ms is not None and knee.p99_ms > bound_ms):
            why.append(f"p99 {knee.p99_ms} ms > {bound_ms:.0f} ms" if bound_ms else "no verdicts")
        reason = "; ".join(why)
    short = [s.agents for s in steps if s.published_per_s < 0.95 * s.offered_per_s]
    return {
        "generator_short_at": short,  # sizes where the generator sent < 95% of its schedule
        "unhealthy_below_knee": hiccups,
        "knee_agents": knee.agents if knee else None,
        "last_healthy_agents": last_ok.agents if last_ok else None,
        "last_healthy_per_s": last_ok.achieved_per_s if last_ok else None,
        "max_achieved_per_s": capacity,
        "p99_bound_ms": bound_ms,
        "reason": reason,
    }


# --- the run -------------------------------------------------------------------------


def _step_figures(
    step: int,
    agents: int,
    config: FleetConfig,
    ledger: _Ledger,
    window: tuple[float, float],
    cpu: dict[str, float | None],
    lags: list[float],
    backlog_in: int,
) -> FleetStep:
    w0, w1 = window
    span = w1 - w0
    ids = [sid for sid, s in ledger.step_of.items() if s == step]
    in_window = [sid for sid in ids if w0 <= ledger.captured[sid] < w1]
    # Every verdict that arrived in the window counts: after an overloaded step the
    # verifier works through the earlier backlog first, and that is throughput too.
    verdicts_in_window = sum(1 for t in ledger.verdict_at.values() if w0 <= t < w1)
    receipts_in_window = sum(1 for sid in ids if w0 <= ledger.receipt_at.get(sid, -1) < w1)
    latencies = [
        ledger.verdict_at[sid] - ledger.captured[sid]
        for sid in in_window
        if sid in ledger.verdict_at
    ]
    lost = sum(1 for sid in ids if sid not in ledger.verdict_at)
    return FleetStep(
        agents=agents,
        rate_per_agent=config.rate_per_agent,
        offered_per_s=round(agents * config.rate_per_agent, 1),
        published_per_s=round(len(in_window) / span, 1),
        achieved_per_s=round(verdicts_in_window / span, 1),
        receipts_per_s=round(receipts_in_window / span, 1),
        p50_ms=_percentile_ms(latencies, 50),
        p99_ms=_percentile_ms(latencies, 99),
        mean_ms=round(float(np.mean(latencies)) * 1000, 1) if latencies else None,
        published=len(ids),
        lost=lost,
        loss_share=round(lost / max(1, len(ids)), 4),
        generator_cpu_cores=round(cpu["generator"] or 0.0, 3),
        generator_lag_p99_ms=_percentile_ms(lags, 99) or 0.0,
        verifier_cpu_cores=None if cpu["verifier"] is None else round(cpu["verifier"], 3),
        broker_cpu_cores=None if cpu["broker"] is None else round(cpu["broker"], 3),
        window_s=round(span, 2),
        backlog_in=backlog_in,
        verifier_cpu_ms_per_verdict=(
            round(cpu["verifier"] * span / verdicts_in_window * 1000, 2)
            if cpu["verifier"] is not None and verdicts_in_window
            else None
        ),
    )


async def _sweep(
    config: FleetConfig,
    target: MqttTarget,
    protocol: ProtocolName,
    topics: Topics,
    pids: dict[str, int | None],
    console: Console,
) -> list[FleetStep]:
    loop = asyncio.get_running_loop()
    driver = _LoopDriver(loop)
    misc = loop.create_task(driver.misc_loop(), name="paho-misc")
    ledger = _Ledger()
    run_id = uuid.uuid4().hex[:6]
    image = _camera_jpeg(config.image_px, config.seed)
    template = _sample_template(config.fleet, image, config.image_px)
    agents: list[_SimAgent] = []
    steps: list[FleetStep] = []
    try:
        for index, size in enumerate(config.sizes):
            new = []
            for i in range(len(agents), size):
                name = f"cam-{i:05d}"
                client = make_client(target, client_id=f"fleet-{run_id}-{i:05d}", protocol=protocol)
                client.max_inflight_messages_set(100)
                driver.attach(client)
                new.append(_SimAgent(name, client, topics, config.fleet, ledger))
            connect_started = time.monotonic()
            await _connect_agents(new, target)
            agents.extend(new)
            if new:
                console.print(
                    f"  {len(new)} agents connected in {time.monotonic() - connect_started:.1f} s"
                )
            fleet = agents[:size]
            backlog_in = sum(1 for sid in ledger.captured if sid not in ledger.verdict_at)
            lags: list[float] = []
            seconds = config.warmup_s + config.duration_s
            started = time.time()
            w0, w1 = started + config.warmup_s, started + seconds
            cpu0 = {
                "generator": time.process_time(),
                "verifier": _cpu_seconds(pids["verifier"]),
                "broker": _cpu_seconds(pids["broker"]),
            }
            await _publish_schedule(
                fleet,
                rate=config.rate_per_agent,
                seconds=seconds,
                template=template,
                image=image,
                ledger=ledger,
                step=index,
                seed=config.seed + index,
                lags=lags,
            )
            elapsed = time.time() - started
            load_end = os.getloadavg()[0]
            cpu1 = {
                "generator": time.process_time(),
                "verifier": _cpu_seconds(pids["verifier"]),
                "broker": _cpu_seconds(pids["broker"]),
            }
            cpu: dict[str, float | None] = {}
            for key, before in cpu0.items():
                after = cpu1[key]
                cpu[key] = None if before is None or after is None else (after - before) / elapsed
            # Drain: wait for the verdicts of everything this step published.
            ids = [sid for sid, s in ledger.step_of.items() if s == index]
            deadline = time.monotonic() + config.drain_s
            while time.monotonic() < deadline and any(sid not in ledger.verdict_at for sid in ids):
                await asyncio.sleep(0.2)
            step = _step_figures(index, size, config, ledger, (w0, w1), cpu, lags, backlog_in)
            step.load_avg_1m = round(load_end, 2)
            steps.append(step)
            console.print(
                f"[bold]{size} agents[/]: offered {step.offered_per_s:.0f}/s, achieved"
                f" {step.achieved_per_s:.0f}/s, p50 {step.p50_ms} ms, p99 {step.p99_ms} ms,"
                f" lost {step.lost}, generator {step.generator_cpu_cores:.2f} cores",
                highlight=False,
            )
    finally:
        misc.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await misc
        for agent in agents:
            agent.client.disconnect()
        await asyncio.sleep(0.2)
        for agent in agents:
            sock = agent.client.socket()
            if sock is not None:
                with contextlib.suppress(ValueError, OSError):
                    loop.remove_reader(sock)
                    loop.remove_writer(sock)
    return steps


def _storage_figures(database_url: str, blob_dir: Path) -> dict[str, Any]:
    """Bytes per stored sample: table + index + TOAST bytes of samples and verdicts, blobs."""
    from sqlalchemy import create_engine, func, select, text

    from cloud_service.db.models import Sample
    from cloud_service.db.models import Verdict as VerdictRow

    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            samples = int(conn.scalar(select(func.count()).select_from(Sample)) or 0)
            verdicts = int(conn.scalar(select(func.count()).select_from(VerdictRow)) or 0)
            if engine.dialect.name == "postgresql":
                s_bytes = int(conn.scalar(text("SELECT pg_total_relation_size('samples')")) or 0)
                v_bytes = int(conn.scalar(text("SELECT pg_total_relation_size('verdicts')")) or 0)
            else:
                s_bytes = v_bytes = 0
    finally:
        engine.dispose()
    blob_bytes = sum(p.stat().st_size for p in blob_dir.rglob("*") if p.is_file())
    out: dict[str, Any] = {
        "database": engine.dialect.name,
        "samples_stored": samples,
        "verdicts_stored": verdicts,
        "blob_bytes_per_sample": round(blob_bytes / samples, 1) if samples else None,
    }
    if s_bytes:
        out["sample_row_bytes"] = round(s_bytes / max(1, samples), 1)
        out["verdict_row_bytes"] = round(v_bytes / max(1, verdicts), 1)
    return out


def run_fleet(config: FleetConfig, *, console: Console | None = None) -> dict[str, Any]:
    """Run the sweep; return the steps, the knee and what the run stood on."""
    console = console or Console(stderr=True)
    workdir = Path(tempfile.mkdtemp(prefix="edgeloop-fleet-"))
    started = time.perf_counter()
    teacher, teacher_name = resolve_teacher(config.teacher, workdir)
    topics = Topics(prefix=f"edgeloop-fleet-{uuid.uuid4().hex[:6]}/v1")
    try:
        with contextlib.ExitStack() as stack:
            broker_pid: int | None = None
            if config.broker_url is None:
                broker = stack.enter_context(private_mosquitto(workdir))
                broker_url, broker_pid, broker_kind = broker.url, broker.pid, "private mosquitto"
            else:
                broker_url, broker_kind = config.broker_url, "given broker"
            target = MqttTarget.parse(broker_url)
            protocol = negotiate_protocol(target)
            database_url = stack.enter_context(_database(config, workdir))
            console.print(
                f"fleet: {teacher_name}; {broker_kind} (MQTT {protocol});"
                f" {database_url.split(':', 1)[0]}",
                highlight=False,
            )
            verifier = stack.enter_context(
                VerifierProcess(
                    mqtt_url=broker_url,
                    database_url=database_url,
                    teacher=teacher,
                    prefix=topics.prefix,
                    workdir=workdir,
                )
            )
            pids = {"verifier": verifier.pid, "broker": broker_pid}
            steps = asyncio.run(_sweep(config, target, protocol, topics, pids, console))
            storage = _storage_figures(database_url, verifier.blob_dir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    knee = find_knee(
        steps,
        ratio=config.knee_ratio,
        p99_limit_s=config.knee_p99_s,
        p99_factor=config.knee_p99_factor,
    )
    gen_peak = max((s.generator_cpu_cores for s in steps), default=0.0)
    return {
        "config": {**asdict(config), "sizes": list(config.sizes)},
        "teacher": teacher_name,
        "broker": broker_kind,
        "protocol": protocol,
        "payload_bytes": _payload_bytes(config),
        "steps": [s.row() for s in steps],
        "knee": knee,
        "storage": storage,
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_end": os.getloadavg()[0]},
        "generator_peak_cpu_cores": gen_peak,
        "generator_peak_machine_share": round(gen_peak / (os.cpu_count() or 1), 3),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def print_fleet(report: dict[str, Any], console: Console) -> None:
    """The sweep as a table, then the knee."""
    table = Table(
        title=f"fleet load: {report['teacher']}, {report['payload_bytes']} B envelopes,"
        f" {report['config']['rate_per_agent']}/s per agent"
    )
    heads = [
        "agents", "offered/s", "sent/s", "verdicts/s", "p50 ms", "p99 ms", "lost",
        "backlog in", "gen CPU", "verifier CPU", "CPU ms/verdict", "broker CPU", "load", "ok",
    ]  # fmt: skip
    for head in heads:
        table.add_column(head, justify="right")
    for s in report["steps"]:

        def cores(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        table.add_row(
            str(s["agents"]),
            f"{s['offered_per_s']:.0f}",
            f"{s['published_per_s']:.0f}",
            f"{s['achieved_per_s']:.0f}",
            str(s["p50_ms"]),
            str(s["p99_ms"]),
            str(s["lost"]),
            str(s.get("backlog_in", 0)),
            cores(s["generator_cpu_cores"]),
            cores(s["verifier_cpu_cores"]),
            cores(s.get("verifier_cpu_ms_per_verdict")),
            cores(s["broker_cpu_cores"]),
            cores(s.get("load_avg_1m")),
            "yes" if s["healthy"] else "no",
        )
    console.print(table)
    knee = report["knee"]
    if knee["knee_agents"] is None:
        console.print(
            f"no knee up to {report['steps'][-1]['agents']} agents"
            f" (max {knee['max_achieved_per_s']:.0f} verdicts/s)"
        )
    else:
        console.print(
            f"knee at {knee['knee_agents']} agents: {knee['reason']}. Last healthy:"
            f" {knee['last_healthy_agents']} agents at {knee['last_healthy_per_s']} verdicts/s;"
            f" most achieved: {knee['max_achieved_per_s']:.0f} verdicts/s.",
            highlight=False,
        )
    if knee.get("generator_short_at"):
        console.print(
            f"[yellow]the generator sent under 95% of its schedule at"
            f" {knee['generator_short_at']} agents: those rows understate the offered load[/]"
        )
    if knee.get("unhealthy_below_knee"):
        console.print(
            f"unhealthy below the knee (passing): {knee['unhealthy_below_knee']} agents",
            highlight=False,
        )
    console.print(
        f"generator: at most {report['generator_peak_cpu_cores']:.2f} cores"
        f" ({report['generator_peak_machine_share']:.0%} of {report['machine']['cpus']} CPUs);"
        f" storage: {report['storage']}",
        highlight=False,
    )
