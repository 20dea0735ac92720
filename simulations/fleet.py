"""Fleet load: hundreds of simulated agents against the real broker and the real verifier.

    edgeloop sim fleet [--sizes 50,100,200,400,800] [--rate 1.0] [--json]

What runs, all on loopback (a ``simulations.stack.Stack``):

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
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from shared.broker import MosquittoProcess
from shared.errors import EdgeLoopError
from shared.mqtt import MqttTarget, ProtocolName, make_client, negotiate_protocol
from shared.topics import Topics
from simulations.databases import POSTGRES_ADMIN_URL
from simulations.fleet_agents import (
    Ledger,
    LoopDriver,
    SimAgent,
    camera_jpeg,
    connect_agents,
    payload_bytes,
    publish_schedule,
    sample_template,
)
from simulations.fleet_figures import (
    FleetStep,
    cpu_seconds,
    find_knee,
    print_fleet,
    step_figures,
    storage_figures,
)
from simulations.stack import Stack, subprocess

__all__ = [
    "POSTGRES_ADMIN_URL",
    "FleetConfig",
    "FleetStep",
    "find_knee",
    "print_fleet",
    "private_mosquitto",
    "run_fleet",
]


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


# --- the teacher ---------------------------------------------------------------


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


# --- the run -------------------------------------------------------------------------


async def _sweep(
    config: FleetConfig,
    target: MqttTarget,
    protocol: ProtocolName,
    topics: Topics,
    pids: dict[str, int | None],
    console: Console,
) -> list[FleetStep]:
    loop = asyncio.get_running_loop()
    driver = LoopDriver(loop)
    misc = loop.create_task(driver.misc_loop(), name="paho-misc")
    ledger = Ledger()
    run_id = uuid.uuid4().hex[:6]
    image = camera_jpeg(config.image_px, config.seed)
    template = sample_template(config.fleet, image, config.image_px)
    agents: list[SimAgent] = []
    steps: list[FleetStep] = []
    try:
        for index, size in enumerate(config.sizes):
            new = []
            for i in range(len(agents), size):
                name = f"cam-{i:05d}"
                client = make_client(target, client_id=f"fleet-{run_id}-{i:05d}", protocol=protocol)
                client.max_inflight_messages_set(100)
                driver.attach(client)
                new.append(SimAgent(name, client, topics, config.fleet, ledger))
            connect_started = time.monotonic()
            await connect_agents(new, target)
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
                "verifier": cpu_seconds(pids["verifier"]),
                "broker": cpu_seconds(pids["broker"]),
            }
            await publish_schedule(
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
                "verifier": cpu_seconds(pids["verifier"]),
                "broker": cpu_seconds(pids["broker"]),
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
            step = step_figures(
                index, size, config.rate_per_agent, ledger, (w0, w1), cpu, lags, backlog_in
            )
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


def run_fleet(config: FleetConfig, *, console: Console | None = None) -> dict[str, Any]:
    """Run the sweep; return the steps, the knee and what the run stood on."""
    console = console or Console(stderr=True)
    workdir = Path(tempfile.mkdtemp(prefix="edgeloop-fleet-"))
    started = time.perf_counter()
    teacher, teacher_name = resolve_teacher(config.teacher, workdir)
    topics = Topics(prefix=f"edgeloop-fleet-{uuid.uuid4().hex[:6]}/v1")
    # The verifier as its own process: its own client id, no persistent session.
    verifier = subprocess(
        1, verifier_client_id=f"fleet-verifier-{uuid.uuid4().hex[:6]}", mqtt_session_expiry_s=0
    )
    try:
        if config.broker_url is None:
            broker: str | MosquittoProcess = private_mosquitto(workdir)
            broker_kind = "private mosquitto"
        else:
            broker, broker_kind = config.broker_url, "given broker"
        stack = Stack(
            workdir,
            broker=broker,
            db=config.database_url or "postgres",
            verifier=verifier,
            teacher=teacher,
            topic_prefix=topics.prefix,
            name="fleet",
            postgres_admin_url=config.postgres_admin_url,
        )
        with stack:
            assert stack.broker is not None and stack.verifier is not None
            target = MqttTarget.parse(stack.broker.url)
            protocol = negotiate_protocol(target)
            console.print(
                f"fleet: {teacher_name}; {broker_kind} (MQTT {protocol});"
                f" {stack.database_url.split(':', 1)[0]}",
                highlight=False,
            )
            pids = {"verifier": stack.verifier.pid, "broker": stack.broker.pid}
            steps = asyncio.run(_sweep(config, target, protocol, topics, pids, console))
            blob_dir = stack.cloud_settings().resolved_blob_dir
            storage = storage_figures(stack.database_url, blob_dir)
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
        "payload_bytes": payload_bytes(config.fleet, config.image_px, config.seed),
        "steps": [s.row() for s in steps],
        "knee": knee,
        "storage": storage,
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_end": os.getloadavg()[0]},
        "generator_peak_cpu_cores": gen_peak,
        "generator_peak_machine_share": round(gen_peak / (os.cpu_count() or 1), 3),
        "wall_s": round(time.perf_counter() - started, 1),
    }
