"""Cloud verifier: dynamic batching, serving overhead, and end to end through Mosquitto.

Each figure is measured side by side with its baseline in one run (medians of repeats):

* batching: verifier throughput at saturation with dynamic batching (max batch 32)
  against the same batcher limited to batch size 1 (goal >= 4x);
* serving efficiency: batcher throughput against the raw ONNX Runtime session
  called in a loop at the same batch size (goal >= 0.85, 1.0 is the limit); frames
  reach the batcher as the verifier's ingest loop hands them over (``submit_many``,
  32 at a time), not one call per frame;
* end to end: samples/s from publish to stored verdict, through Mosquitto into
  PostgreSQL (SQLite when PostgreSQL is not reachable), against raw Mosquitto
  publish/subscribe of the same payloads; then p50/p99 capture-to-verdict latency
  at half of the measured maximum rate. Both sides use the same publisher client,
  QoS 1, MQTT version and number of ~20 KB envelopes, and take turns (a pipeline
  run, then a raw run, the verifier idle meanwhile), so a neighbour's load on this
  shared machine hits them alike. Both publishers stay at most ``LEAD`` messages
  ahead of what has arrived (raw) or been verified (pipeline): Mosquitto keeps at
  most ``max_queued_messages`` (1000 by default) for a subscriber that falls behind
  and drops the rest of a QoS 1 burst, which would leave a run waiting for verdicts
  of samples that never arrived. Beside each rate: CPU per sample of this process,
  of Mosquitto and of PostgreSQL, and how many of the machine's cores were busy;
* the verifier as deployed: ``cloud-service verifier`` in a subprocess, then with
  ``--workers 2``, against raw pub/sub round by round, ``DEPLOYED_SAMPLES`` (6000)
  per round: the steady state of a loaded verifier, not a short burst's start and
  drain. The CPU of the verifier's processes per sample, less the teacher's
  inference (raw ORT at batch 32, every core: the CPU of a pass) and the JPEG decode
  (the verifier's ``decode_image`` on a thread per core, as its decode pool runs it),
  is what the verifier itself costs per sample (goal <= 0.5 ms). Both baselines are
  measured right after each round and subtracted from that round's figure, and the
  median over rounds is reported: on a shared host the baselines move from one
  minute to the next as much as the verifier does;
* latency as the agent sees it: frame published -> its verdict back on the agent's
  verdict topic, p50 and p99 at 10%, 50% and 90% of one verifier process's measured
  capacity, against a raw round trip (publish -> a client that republishes -> back)
  of the same envelopes at the same rate.

The teacher is a seeded teacher-like model (``cloud_service.demo_teacher``: conv
stem and 2048-wide dense layers, 64x64 input), so the figures do not depend on
the reference models being trained.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
import psutil
from sqlalchemy import create_engine, func, select
from sqlalchemy.engine import make_url

from bench.common import Scrape, by_stage, markdown_table, scrape
from bench.envelope import typical_sample
from cloud_service.batcher import BatcherConfig, DynamicBatcher
from cloud_service.db.models import Sample, Verdict
from cloud_service.demo_teacher import build_demo_teacher
from cloud_service.settings import CloudSettings
from cloud_service.verifier import TeacherModel, decode_image
from cloud_service.worker import VerifierWorker
from shared.envelope import EnvelopeLimits, decode_envelope, encode_envelope
from shared.ids import new_sample_id
from shared.interpreter import switch_interval
from shared.mqtt import MqttTarget, make_client, negotiate_protocol
from shared.topics import Topics
from simulations.stack import Stack

SIZE = 64
BATCH = 32
# Camera crops of 208 px, JPEG q90: envelopes of ~20 KB, the payload size the goal names.
PAYLOAD_IMAGE_PX = 208
BROKER = "mqtt://127.0.0.1:1883"
# Messages a publisher may run ahead of what has arrived or been verified: half of
# Mosquitto's default max_queued_messages, so a burst is never cut short by the broker.
LEAD = 500


log = logging.getLogger(__name__)


def _frames(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return list(rng.integers(0, 255, (n, SIZE, SIZE, 3), dtype=np.uint8))


def _batcher_pass(teacher: TeacherModel, frames: list[np.ndarray], max_batch: int) -> Any:
    """One pass of all frames through a dynamic batcher (one instance, like the raw session)."""
    config = BatcherConfig(max_batch_size=max_batch, max_queue_delay_s=0.002, instances=1)
    batcher = DynamicBatcher(teacher.predict_many, config)

    # Handed over as the verifier hands over what its inbox drained: several requests
    # per call (one lock, one wake-up), here one full batch's worth at a time.
    chunks = [
        [(f, f.shape, 0, 0.0) for f in frames[i : i + BATCH]] for i in range(0, len(frames), BATCH)
    ]

    def once() -> None:
        futures = [future for chunk in chunks for future in batcher.submit_many(chunk)]
        for future in futures:
            future.result(60)

    return batcher, once


def _raw_pass(teacher: TeacherModel, frames: list[np.ndarray], batch: int) -> Any:
    """One pass of all frames through the raw session, in batches of ``batch``."""
    batches = [np.stack(frames[i : i + batch]) for i in range(0, len(frames), batch)]

    def once() -> None:
        for b in batches:
            teacher.predict(b)

    return once


def _interleaved_throughput(passes: dict[str, Any], n_frames: int, rounds: int) -> dict[str, float]:
    """Images/s per path: the paths take turns in each round, so a neighbour's load on
    this shared machine hits them alike; the median over rounds is reported."""
    for once in passes.values():
        once()  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(rounds):
        for name, once in passes.items():
            start = time.perf_counter()
            once()
            seconds[name].append(time.perf_counter() - start)
    return {name: n_frames / statistics.median(values) for name, values in seconds.items()}


def _envelopes(n: int, fleet: str, agent: str) -> list[bytes]:
    header, image = typical_sample(PAYLOAD_IMAGE_PX)
    out = []
    for _ in range(n):
        h = header.model_copy(update={"sample_id": new_sample_id(), "fleet": fleet, "agent": agent})
        out.append(encode_envelope(h, image))
    return out


def _fresh(payload: bytes) -> bytes:
    """The same envelope with ``captured_at`` now: latency counts from capture, not from
    when the bench prepared the batch (which added the publishing schedule to it)."""
    envelope = decode_envelope(payload, EnvelopeLimits())
    header = envelope.header.model_copy(update={"captured_at": datetime.now(UTC)})
    return encode_envelope(header, envelope.image)


def _publisher(protocol: Any) -> mqtt.Client:
    target = MqttTarget.parse(BROKER)
    client = make_client(target, client_id=f"bench-pub-{uuid.uuid4().hex[:6]}", protocol=protocol)
    client.max_inflight_messages_set(1000)
    client.max_queued_messages_set(0)
    client.connect(target.host, target.port)
    client.loop_start()
    return client


def _publish_paced(
    client: mqtt.Client,
    topic: str,
    payloads: list[bytes],
    done: Callable[[], int],
    *,
    lead: int = LEAD,
) -> None:
    """Publish ``payloads`` at QoS 1 as fast as the receiving side keeps up: never more
    than ``lead`` ahead of ``done()`` (messages arrived or samples verified so far)."""
    for i, payload in enumerate(payloads):
        while i - done() >= lead:
            time.sleep(0.0005)
        client.publish(topic, payload, qos=1)


class MachineCpu:
    """CPU seconds of this process, of the local Mosquitto and PostgreSQL processes, and
    of the whole machine, between ``start()`` and ``stop()``.

    Services are found by process name; a backend that started during the run counts
    from zero, one that ended during it is missed (PostgreSQL keeps a pool's backends
    for the run). The machine's busy time is every core's non-idle time.
    """

    SERVICES = {"mosquitto": "mosquitto", "postgres": "postgresql"}

    def __init__(self, tree: int | None = None) -> None:
        """``tree``: a process (the verifier's) whose CPU and its children's is reported too."""
        self._pids: dict[int, tuple[str, float]] = {}
        self._self = self._machine = self._wall = 0.0
        self._tree = tree
        self._tree_start: dict[int, float] = {}

    def _tree_times(self) -> dict[int, float]:
        if self._tree is None:
            return {}
        try:
            root = psutil.Process(self._tree)
            processes = [root, *root.children(recursive=True)]
        except psutil.Error:
            return {}
        times: dict[int, float] = {}
        for proc in processes:
            try:
                t = proc.cpu_times()
            except psutil.Error:
                continue
            times[proc.pid] = t.user + t.system
        return times

    def _services(self) -> dict[int, tuple[str, float]]:
        found: dict[int, tuple[str, float]] = {}
        for proc in psutil.process_iter(["name"]):
            name = proc.info["name"] or ""
            for prefix, service in self.SERVICES.items():
                if name.startswith(prefix):
                    try:
                        times = proc.cpu_times()
                    except psutil.Error:
                        continue
                    found[proc.pid] = (service, times.user + times.system)
        return found

    @staticmethod
    def _busy() -> float:
        # What this machine's cores ran (guest time is inside user time; steal is the
        # hypervisor's, not ours).
        times = psutil.cpu_times()
        return float(
            times.user
            + times.system
            + getattr(times, "nice", 0.0)
            + getattr(times, "irq", 0.0)
            + getattr(times, "softirq", 0.0)
        )

    def start(self) -> None:
        self._pids = self._services()
        self._tree_start = self._tree_times()
        self._self = time.process_time()
        self._wall = time.perf_counter()
        self._machine = self._busy()

    def stop(self, count: int) -> dict[str, float]:
        """Milliseconds of CPU per message (``count`` messages), and cores busy."""
        # The machine's busy time and the wall clock are read together (the process scan
        # below takes a while on a busy host, and would count as busy time beyond the
        # wall); /proc/stat ticks 100 times a second per core, so a short interval
        # is within 20 ms per core of the truth.
        machine = self._busy() - self._machine
        wall = time.perf_counter() - self._wall
        used = {"this process": time.process_time() - self._self}
        if self._tree is not None:
            tree = self._tree_times()
            used["verifier"] = sum(t - self._tree_start.get(pid, 0.0) for pid, t in tree.items())
        for service in self.SERVICES.values():
            used[service] = 0.0
        for pid, (service, seconds) in self._services().items():
            before = self._pids.get(pid)
            used[service] += seconds - (before[1] if before else 0.0)
        per = {name: 1e3 * seconds / max(count, 1) for name, seconds in used.items()}
        per["machine"] = 1e3 * machine / max(count, 1)
        per["cores busy"] = machine / max(wall, 1e-9)
        per["cores"] = float(os.cpu_count() or 1)
        return per


class _Arrivals:
    """A QoS 1 subscriber to one topic that counts what arrives and notes when (per
    sample id, when ``key`` reads a payload's ids: a verdict batch carries several)."""

    def __init__(
        self,
        topic: str,
        expected: int,
        protocol: Any,
        key: Callable[[bytes], list[str]] | None = None,
    ) -> None:
        target = MqttTarget.parse(BROKER)
        self.count = 0
        self.last = 0.0
        self.key = key
        self.times: dict[str, float] = {}
        self.expected = expected
        self.all_arrived = threading.Event()
        self.client = make_client(
            target, client_id=f"bench-sub-{uuid.uuid4().hex[:6]}", protocol=protocol
        )
        self.client.on_message = self._on_message
        self.client.connect(target.host, target.port)
        self.client.loop_start()
        self.client.subscribe(topic, qos=1)
        time.sleep(0.3)

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        self.last = time.perf_counter()
        if self.key is None:
            self.count += 1
        else:
            ids = self.key(bytes(message.payload))
            for sample_id in ids:
                self.times[sample_id] = self.last
            self.count += len(ids)
        if self.count >= self.expected:
            self.all_arrived.set()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class _Echo:
    """Republishes every message of one topic to another at QoS 1: the raw round trip's
    far end, the place of the verifier."""

    def __init__(self, source: str, target_topic: str, protocol: Any) -> None:
        target = MqttTarget.parse(BROKER)
        self.client = make_client(
            target, client_id=f"bench-echo-{uuid.uuid4().hex[:6]}", protocol=protocol
        )
        self.client.max_inflight_messages_set(1000)
        self.client.max_queued_messages_set(0)
        self.target_topic = target_topic
        self.client.on_message = self._on_message
        self.client.connect(target.host, target.port)
        self.client.loop_start()
        self.client.subscribe(source, qos=1)
        time.sleep(0.3)

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        client.publish(self.target_topic, message.payload, qos=1)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _envelope_ids(payload: bytes) -> list[str]:
    return [_envelope_id(payload)]


def _envelope_id(payload: bytes) -> str:
    """An envelope's sample id, read from its JSON header alone."""
    from shared.envelope import PREFIX_SIZE

    length = int.from_bytes(payload[6:8], "big")
    return str(json.loads(payload[PREFIX_SIZE : PREFIX_SIZE + length])["sample_id"])


def _verdict_ids(payload: bytes) -> list[str]:
    """The sample ids of a verdict message (a batch, or one verdict), read cheaply."""
    message = json.loads(payload)
    return [str(v["sample_id"]) for v in message.get("verdicts", [message])]


def _round_trips(
    out_topic: str,
    back_topic: str,
    payloads: list[bytes],
    rate: float,
    protocol: Any,
    key: Callable[[bytes], list[str]],
) -> tuple[list[float], int]:
    """Publish ``payloads`` at ``rate``/s and time each until its answer arrives on
    ``back_topic`` (in this process, as at the agent): seconds per answered payload, and
    how many got no answer within a minute."""
    back = _Arrivals(back_topic, len(payloads), protocol, key=key)
    pub = _publisher(protocol)
    sent: dict[str, float] = {}
    start = time.perf_counter()
    for i, payload in enumerate(payloads):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sent[_envelope_id(payload)] = time.perf_counter()
        pub.publish(out_topic, payload, qos=1)
    back.all_arrived.wait(60)
    pub.disconnect()
    pub.loop_stop()
    back.close()
    trips = [back.times[k] - t for k, t in sent.items() if k in back.times]
    return trips, len(payloads) - len(trips)


LATENCY_LOADS = (0.1, 0.5, 0.9)  # shares of one verifier process's measured capacity


def _latency_sweep(topics: Topics, capacity: float, protocol: Any, quick: bool) -> dict[str, Any]:
    """Frame answered at the agent -> the teacher's verdict back at the agent, p50 and
    p99, at each share of ``capacity``, against a raw publish -> echo -> subscribe round
    trip of the same envelopes at the same rate, the two taking turns."""
    seconds = 2.0 if quick else 4.0
    out: dict[str, Any] = {}
    for share in LATENCY_LOADS:
        rate = share * capacity
        n = max(50, round(rate * seconds))
        fleet, agent = "bench", f"lat-{uuid.uuid4().hex[:6]}"
        trips, lost = _round_trips(
            topics.samples(fleet, agent),
            topics.verdicts(fleet, agent),
            _envelopes(n, fleet, agent),
            rate,
            protocol,
            _verdict_ids,
        )
        raw_out = f"bench-rt/{uuid.uuid4().hex[:8]}"
        echo = _Echo(f"{raw_out}/out", f"{raw_out}/back", protocol)
        try:
            raw_trips, raw_lost = _round_trips(
                f"{raw_out}/out",
                f"{raw_out}/back",
                _envelopes(n, "bench", "raw"),
                rate,
                protocol,
                _envelope_ids,
            )
        finally:
            echo.close()

        def ms(values: list[float], q: float) -> float | None:
            return round(float(np.percentile(values, q)) * 1000, 2) if values else None

        out[f"{share:.0%}"] = {
            "rate_per_s": round(rate, 1),
            "samples": n,
            "p50_ms": ms(trips, 50),
            "p99_ms": ms(trips, 99),
            "unanswered": lost,
            "raw_p50_ms": ms(raw_trips, 50),
            "raw_p99_ms": ms(raw_trips, 99),
            "raw_unanswered": raw_lost,
        }
    return out


def _raw_pubsub(payloads: list[bytes], protocol: Any) -> tuple[float, dict[str, float]]:
    """Messages/s of plain QoS 1 publish -> subscribe of the same payloads, and the CPU
    per message meanwhile (``MachineCpu``)."""
    topic = f"bench-raw/{uuid.uuid4().hex[:8]}/samples"
    arrivals = _Arrivals(topic, len(payloads), protocol)
    pub = _publisher(protocol)
    cpu = MachineCpu()
    cpu.start()
    start = time.perf_counter()
    _publish_paced(pub, topic, payloads, lambda: arrivals.count)
    # Should the broker still drop messages (a lower queue limit than Mosquitto's
    # default), the rate is that of what arrived, timed to the last arrival, never a
    # wait that ran into the timeout.
    deadline = time.monotonic() + 60
    while not arrivals.all_arrived.wait(0.05) and time.monotonic() < deadline:
        if arrivals.count and time.perf_counter() - arrivals.last > 2.0:
            break
    count = arrivals.count
    elapsed = (arrivals.last if count else time.perf_counter()) - start
    used = cpu.stop(max(count, 1))
    pub.disconnect()
    pub.loop_stop()
    arrivals.close()
    if count < len(payloads):
        log.warning("raw pub/sub: %d of %d messages arrived", count, len(payloads))
    return count / max(elapsed, 1e-9), used


def _count(engine: Any, model: Any, prefix_fleet: str) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(model)) or 0)


def _end_to_end(
    worker: VerifierWorker, engine: Any, topics: Topics, n: int, rate: float | None, protocol: Any
) -> tuple[float, list[float], dict[str, float]]:
    """Publish n samples (at ``rate``/s, or as fast as the verifier keeps up); seconds
    until all verified, the capture-to-verdict latencies, and the CPU per sample
    meanwhile (``MachineCpu``)."""
    fleet, agent = "bench", f"cam-{uuid.uuid4().hex[:6]}"
    payloads = _envelopes(n, fleet, agent)
    before = worker.counts["verdicts"]
    pub = _publisher(protocol)
    topic = topics.samples(fleet, agent)
    cpu = MachineCpu()
    cpu.start()
    start = time.perf_counter()
    if rate:
        for i, payload in enumerate(payloads):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pub.publish(topic, _fresh(payload), qos=1)
    else:
        _publish_paced(pub, topic, payloads, lambda: worker.counts["verdicts"] - before)
    deadline = time.monotonic() + 120
    while worker.counts["verdicts"] - before < n and time.monotonic() < deadline:
        time.sleep(0.005)
    elapsed = time.perf_counter() - start
    used = cpu.stop(n)
    pub.disconnect()
    pub.loop_stop()
    with engine.connect() as conn:
        latencies = [
            float(x)
            for x in conn.scalars(
                select(Verdict.latency_s)
                .join(Sample, Sample.sample_id == Verdict.sample_id)
                .where(Sample.agent_id == agent)
            ).all()
        ]
    return elapsed, latencies, used


WORKERS = 2  # verifier processes in the several-process pipeline run (one per core here)
# Samples per round of the verifier as deployed: about five seconds of a loaded
# verifier, so its CPU per sample is the steady state's: a short burst also pays for
# filling and draining the pipeline (the last teacher batches part-full, the threads
# waking for little).
DEPLOYED_SAMPLES = 6000
DEPLOYED_QUICK = 600


def _processes_end_to_end(
    topics: Topics, n: int, protocol: Any, tree: int | None = None
) -> tuple[float, dict[str, float]]:
    """Publish n samples to verifier processes (as fast as they keep up); seconds until
    every verdict came back over MQTT, and the CPU per sample meanwhile (the verifier's
    own: ``tree``, its process, and its children)."""
    fleet, agent = "bench", f"cam-{uuid.uuid4().hex[:6]}"
    payloads = _envelopes(n, fleet, agent)
    verdicts = _Arrivals(topics.verdicts(fleet, agent), n, protocol, key=_verdict_ids)
    pub = _publisher(protocol)
    cpu = MachineCpu(tree)
    cpu.start()
    start = time.perf_counter()
    _publish_paced(pub, topics.samples(fleet, agent), payloads, lambda: verdicts.count)
    verdicts.all_arrived.wait(120)
    elapsed = time.perf_counter() - start
    used = cpu.stop(n)
    pub.disconnect()
    pub.loop_stop()
    verdicts.close()
    if verdicts.count < n:
        log.warning("verifier processes: %d of %d verdicts heard", verdicts.count, n)
    return elapsed, used


def _teacher_cpu_ms(teacher_pass: Callable[[], None], n_frames: int) -> float:
    """CPU milliseconds per sample of the teacher alone (raw ORT at batch 32, the
    session's threads on every core, no spinning): this process's CPU over one pass."""
    started = time.process_time()
    teacher_pass()
    return round((time.process_time() - started) / n_frames * 1e3, 3)


def _decode_cpu_ms(threads: int, repeats: int = 5, calls: int = 200) -> float:
    """CPU milliseconds the verifier spends decoding one benchmark payload's image to the
    teacher's input, with ``threads`` threads decoding at once (OpenCV releases the
    GIL; the verifier's decode pool keeps every core decoding under load, and two
    decodes side by side each cost more than one alone); median over repeats."""
    _, image = typical_sample(PAYLOAD_IMAGE_PX)
    decode_image(image, (SIZE, SIZE))

    def decode_many() -> None:
        for _ in range(calls):
            decode_image(image, (SIZE, SIZE))

    samples = []
    for _ in range(repeats):
        workers = [threading.Thread(target=decode_many) for _ in range(threads)]
        started = time.process_time()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        samples.append((time.process_time() - started) / (calls * threads) * 1e3)
    return round(statistics.median(samples), 3)


def _median_each(runs: list[dict[str, float]]) -> dict[str, float]:
    """The median of each figure over runs."""
    return {key: round(statistics.median(run_[key] for run_ in runs), 3) for key in runs[0]}


def _cpu_table(figures: dict[str, Any]) -> str:
    """Where the machine's CPU goes per message, and the verifier's own share (goal 1)."""
    deployed = {
        "one verifier process": ("deployed_1_cpu_ms_per_sample", 1),
        f"{WORKERS} verifier processes": ("e2e_workers_cpu_ms_per_sample", WORKERS),
    }
    columns = {
        "pipeline (verifier in this process)": figures["e2e_cpu_ms_per_sample"],
        **{name: figures.get(key) for name, (key, _) in deployed.items()},
        "raw pub/sub": figures["raw_cpu_ms_per_msg"],
    }
    shown = {name: per for name, per in columns.items() if per}
    rows: list[list[Any]] = [
        [f"{name} (ms per message)", *(per.get(name, "-") for per in shown.values())]
        for name in ("this process", "verifier", *MachineCpu.SERVICES.values(), "machine")
    ]
    rows.append(
        [
            "cores busy",
            *(f"{per['cores busy']:.2f} of {per['cores']:.0f}" for per in shown.values()),
        ]
    )
    if any(name in shown for name in deployed):
        rows.append(
            [
                "verifier CPU beyond the teacher and the decode (ms per sample; goal <= 0.5)",
                *(
                    figures.get(f"verifier_overhead_ms_per_sample_{deployed[name][1]}p", "-")
                    if name in deployed
                    else "-"
                    for name in shown
                ),
            ]
        )
    blank = ["-"] * (len(shown) - 1)
    for label, key in (
        (
            "the teacher alone (ms per sample: raw ORT, batch 32, every core; after each round)",
            "teacher_cpu_ms_per_sample",
        ),
        (
            "the JPEG decode alone (ms per sample: the verifier's decode_image, a thread per"
            " core; after each round)",
            "decode_cpu_ms_per_sample",
        ),
        (
            "the JPEG decode alone on one thread (ms per sample; information)",
            "decode_cpu_ms_per_sample_one_thread",
        ),
        (
            "machine CPU per sample that 0.5 of the raw rate allows, every core busy"
            " (the retired pipeline goal)",
            "goal_cpu_budget_ms_per_sample",
        ),
    ):
        rows.append([label, figures[key], *blank])
    return markdown_table(["CPU during the runs (medians)", *shown], rows)


def run(quick: bool = False) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="edgeloop-bench-cloud-"))
    model = build_demo_teacher(workdir / "teacher.onnx", size=SIZE, hidden=2048, seed=0)
    teacher = TeacherModel(model)
    n_frames = 256 if quick else 512
    frames = _frames(n_frames)

    # The raw session at batch 32: the batcher's baseline here, goal 1's teacher later.
    teacher_pass = _raw_pass(teacher, frames, BATCH)
    batcher_32, batched_pass = _batcher_pass(teacher, frames, BATCH)
    batcher_1, single_pass = _batcher_pass(teacher, frames, 1)
    # The batcher serves inside the verifier, which runs CPython's switch interval at
    # verifier_switch_interval_ms: the batcher and the raw session are timed under it.
    switch_ms = CloudSettings.model_fields["verifier_switch_interval_ms"].default
    with switch_interval(switch_ms), batcher_32, batcher_1:
        rates = _interleaved_throughput(
            {
                "batched": batched_pass,
                "single": single_pass,
                "raw": teacher_pass,
                "raw_single": _raw_pass(teacher, frames, 1),
            },
            len(frames),
            rounds=7 if quick else 15,
        )
    batched, single = rates["batched"], rates["single"]
    raw, raw_single = rates["raw"], rates["raw_single"]

    figures: dict[str, Any] = {
        "batcher_img_per_s_batch32": round(batched, 1),
        "batcher_img_per_s_batch1": round(single, 1),
        "raw_ort_img_per_s_batch32": round(raw, 1),
        "raw_ort_img_per_s_batch1": round(raw_single, 1),
        "batching_speedup": round(batched / single, 2),
        "serving_efficiency": round(batched / raw, 3),
        "provider": teacher.info.provider,
        "switch_interval_ms": switch_ms,
    }
    tables = [
        markdown_table(
            ["path", "batch", "images/s"],
            [
                ["raw ORT session", 1, raw_single],
                ["dynamic batcher", 1, single],
                ["raw ORT session", BATCH, raw],
                ["dynamic batcher", BATCH, batched],
            ],
        ),
        markdown_table(
            ["goal", "measured", "target"],
            [
                ["batching speedup (batch 32 / batch 1)", figures["batching_speedup"], ">= 4"],
                [
                    "serving efficiency (batcher / raw ORT)",
                    figures["serving_efficiency"],
                    ">= 0.85",
                ],
            ],
        ),
    ]

    # End to end: Mosquitto -> verifier -> PostgreSQL.
    target = MqttTarget.parse(BROKER)
    try:
        protocol = negotiate_protocol(target)
    except Exception as exc:  # no broker: report the in-process figures only
        figures["end_to_end"] = f"skipped: {exc}"
        return {"figures": figures, "tables": tables}
    topics = Topics(prefix=f"bench-{uuid.uuid4().hex[:8]}/v1")
    stack = Stack(
        workdir,
        broker=BROKER,
        db="postgres",  # a fresh PostgreSQL database; SQLite when none answers
        verifier="in-process",
        teacher=model,
        topic_prefix=topics.prefix,
        cloud={
            "verifier_client_id": f"bench-verifier-{uuid.uuid4().hex[:6]}",
            "mqtt_session_expiry_s": 0,
            "max_batch_size": BATCH,
            "max_queue_delay_ms": 2.0,
            "review_audit_share": 0.02,
        },
        name="bench",
    )
    n = 600 if quick else 1500
    steady = DEPLOYED_QUICK if quick else DEPLOYED_SAMPLES  # per round of the verifier as deployed
    repeats = 5
    cores = os.cpu_count() or 1
    with stack:
        url = stack.database_url
        engine = create_engine(url)
        try:
            worker = stack.worker
            _end_to_end(worker, engine, topics, 100, None, protocol)  # warm-up
            _raw_pubsub(_envelopes(100, "bench", "raw"), protocol)
            e2e_rates: list[float] = []
            raw_rates: list[float] = []
            cpu: list[dict[str, float]] = []
            raw_cpu: list[dict[str, float]] = []
            for _ in range(repeats):
                elapsed, _lat, used = _end_to_end(worker, engine, topics, n, None, protocol)
                e2e_rates.append(n / elapsed)
                cpu.append(used)
                raw_rate, raw_used = _raw_pubsub(_envelopes(n, "bench", "raw"), protocol)
                raw_rates.append(raw_rate)
                raw_cpu.append(raw_used)
            e2e = statistics.median(e2e_rates)
            raw_mqtt = statistics.median(raw_rates)
            half = e2e / 2
            lat_runs = []
            for _ in range(3 if quick else 5):
                _, lat, _cpu = _end_to_end(worker, engine, topics, n // 4, half, protocol)
                lat_runs.append(lat)
            latencies = sorted(x for run_ in lat_runs for x in run_)
            stack.worker.stop()
            # The verifier as deployed: `cloud-service verifier` in its own process (its
            # CPU per sample is goal 1's), then WORKERS processes on the broker's shared
            # subscription (MQTT v5, PostgreSQL), with their own client ids and group.
            # Beside each round, raw pub/sub of the same payloads.
            deployed: dict[int, dict[str, Any]] = {}
            latency: dict[str, Any] = {}
            if protocol == "5" and not url.startswith("sqlite"):
                for workers in (1, WORKERS):
                    processes = stack.verifier_process(
                        workers=workers,
                        ready_timeout_s=120.0,
                        stop_timeout_s=60.0,
                        verifier_client_id=f"bench-workers-{uuid.uuid4().hex[:6]}",
                        verifier_group=f"bench-{uuid.uuid4().hex[:6]}",
                    )
                    deployed_rates: list[float] = []
                    ratios: list[float] = []
                    runs_cpu: list[dict[str, float]] = []
                    runs_threads: list[dict[str, float]] = []
                    metrics = [
                        f"http://127.0.0.1:{processes.port + i}/metrics" for i in range(workers)
                    ]
                    with processes:
                        _processes_end_to_end(topics, 300, protocol)  # warm-up
                        for _ in range(repeats):
                            threads_before = scrape(metrics)
                            elapsed, cpu_used = _processes_end_to_end(
                                topics, steady, protocol, tree=processes.pid
                            )
                            runs_threads.append(
                                _per_sample_by_stage(scrape(metrics).since(threads_before), steady)
                            )
                            deployed_rates.append(steady / elapsed)
                            raw_rate, _raw_used = _raw_pubsub(
                                _envelopes(steady, "bench", "raw"), protocol
                            )
                            ratios.append(deployed_rates[-1] / raw_rate)
                            # Goal 1's baselines, measured right after the round they
                            # are subtracted from: the host's state moves them as much
                            # as it moves the verifier.
                            cpu_used["teacher"] = _teacher_cpu_ms(teacher_pass, len(frames))
                            cpu_used["decode"] = _decode_cpu_ms(cores, repeats=3)
                            runs_cpu.append(cpu_used)
                        if workers == 1:
                            latency = _latency_sweep(
                                topics, statistics.median(deployed_rates), protocol, quick
                            )
                    deployed[workers] = {
                        "samples_per_s": statistics.median(deployed_rates),
                        "vs_raw": statistics.median(ratios),
                        "cpu": _median_each(runs_cpu),
                        "beyond": [
                            round(r["verifier"] - r["teacher"] - r["decode"], 3) for r in runs_cpu
                        ],
                        "threads": {
                            stage: round(
                                statistics.median(r.get(stage, 0.0) for r in runs_threads), 3
                            )
                            for stage in {stage for r in runs_threads for stage in r}
                        },
                    }
        finally:
            engine.dispose()
    p50 = float(np.percentile(latencies, 50)) * 1000
    p99 = float(np.percentile(latencies, 99)) * 1000
    db = make_url(url).get_backend_name()
    figures.update(
        {
            "e2e_database": db,
            "e2e_samples_per_s": round(e2e, 1),
            "raw_mosquitto_msgs_per_s": round(raw_mqtt, 1),
            "e2e_vs_raw_mqtt": round(e2e / raw_mqtt, 3),
            "latency_rate_per_s": round(half, 1),
            "capture_to_verdict_p50_ms": round(p50, 1),
            "capture_to_verdict_p99_ms": round(p99, 1),
            "e2e_payload_bytes": len(_envelopes(1, "bench", "x")[0]),
            "e2e_samples": n,
            "deployed_samples_per_round": steady,
            "e2e_runs_samples_per_s": [round(r, 1) for r in e2e_rates],
            "raw_runs_msgs_per_s": [round(r, 1) for r in raw_rates],
            "e2e_workers": WORKERS if deployed else None,
            "e2e_workers_samples_per_s": (
                round(deployed[WORKERS]["samples_per_s"], 1) if deployed else None
            ),
            "e2e_workers_vs_raw_mqtt": round(deployed[WORKERS]["vs_raw"], 3) if deployed else None,
            "e2e_workers_cpu_ms_per_sample": deployed[WORKERS]["cpu"] if deployed else None,
            "deployed_1_samples_per_s": (
                round(deployed[1]["samples_per_s"], 1) if deployed else None
            ),
            "deployed_1_cpu_ms_per_sample": deployed[1]["cpu"] if deployed else None,
            "latency": latency or None,
            "e2e_cpu_ms_per_sample": _median_each(cpu),
            "raw_cpu_ms_per_msg": _median_each(raw_cpu),
            # Goal 1's baselines: medians over the one-process rounds, each measured
            # right after its round (without a deployed run, once here).
            "teacher_cpu_ms_per_sample": (
                deployed[1]["cpu"]["teacher"]
                if deployed
                else _teacher_cpu_ms(teacher_pass, len(frames))
            ),
            "decode_cpu_ms_per_sample": (
                deployed[1]["cpu"]["decode"] if deployed else _decode_cpu_ms(cores)
            ),
            "decode_cpu_ms_per_sample_one_thread": _decode_cpu_ms(1),
            "goal_cpu_budget_ms_per_sample": round(1e3 * cores / (0.5 * raw_mqtt), 3),
        }
    )
    # Goal 1: the verifier's CPU per sample beyond the teacher's inference and the decode,
    # round by round (each round less the baselines measured right after it); the median.
    for workers, run_ in deployed.items():
        figures[f"verifier_overhead_ms_per_sample_{workers}p"] = round(
            statistics.median(run_["beyond"]), 3
        )
        figures[f"verifier_overhead_runs_ms_{workers}p"] = run_["beyond"]
        figures[f"verifier_threads_ms_per_sample_{workers}p"] = run_["threads"]
    tables.append(
        markdown_table(
            ["end to end (Mosquitto, QoS 1)", "value"],
            [
                [f"verifier: publish -> stored verdict in {db} (samples/s)", e2e],
                ["raw Mosquitto pub/sub, same payloads (msgs/s)", raw_mqtt],
                ["ratio", figures["e2e_vs_raw_mqtt"]],
                [
                    f"{WORKERS} verifier processes (`--workers {WORKERS}`): samples/s; ratio to"
                    " raw (per round)",
                    f"{figures['e2e_workers_samples_per_s']}; {figures['e2e_workers_vs_raw_mqtt']}"
                    if deployed
                    else "not run (needs MQTT v5 and PostgreSQL)",
                ],
                [
                    "one verifier process (`cloud-service verifier`): samples/s",
                    figures["deployed_1_samples_per_s"] or "not run",
                ],
                [f"capture-to-verdict p50 at {half:.0f}/s (ms)", p50],
                [f"capture-to-verdict p99 at {half:.0f}/s (ms)", p99],
            ],
        )
    )
    tables.append(_cpu_table(figures))
    if deployed and deployed[1]["threads"]:
        tables.append(_thread_table({w: run_["threads"] for w, run_ in deployed.items()}))
    if latency:
        tables.append(_latency_table(latency, figures["deployed_1_samples_per_s"]))
    return {"figures": figures, "tables": tables}


def _per_sample_by_stage(used: Scrape, samples: int) -> dict[str, float]:
    """Milliseconds of CPU per sample by verifier stage over one round (``used``: what
    each thread's CPU, ``edgeloop_thread_cpu_seconds``, grew by)."""
    return {stage: value / samples * 1e3 for stage, value in by_stage(used.threads).items()}


def _thread_table(by_workers: dict[int, dict[str, float]]) -> str:
    """The verifier's CPU per sample by thread, a column per process count."""
    stages = sorted(
        {stage for figures in by_workers.values() for stage in figures},
        key=lambda stage: -by_workers[1].get(stage, 0.0),
    )
    rows = [
        [stage, *(round(figures.get(stage, 0.0), 3) for figures in by_workers.values())]
        for stage in stages
        if any(figures.get(stage, 0.0) >= 0.001 for figures in by_workers.values())
    ]
    headers = [
        "verifier CPU per sample by thread (ms, medians over the rounds)",
        *(f"{w} process{'es' if w > 1 else ''}" for w in by_workers),
    ]
    return (
        markdown_table(headers, rows)
        + "\n\nFrom each verifier process's edgeloop_thread_cpu_seconds around each round:"
        " decode (the envelope, the checks, the JPEG to the teacher's input), teacher (its"
        " batches; ORT's own pool threads are in other), verifier-verdicts (rows, verdict"
        " messages), blobs (image files), verifier-mqtt-io (the broker link),"
        " verifier-store (sample rows, receipts)."
    )


def _latency_table(latency: dict[str, Any], capacity: float) -> str:
    rows = [
        [
            share,
            row["rate_per_s"],
            row["p50_ms"],
            row["p99_ms"],
            row["raw_p50_ms"],
            row["raw_p99_ms"],
            f"{row['unanswered']}; {row['raw_unanswered']}",
        ]
        for share, row in latency.items()
    ]
    return (
        markdown_table(
            [
                f"load (share of {capacity:g} samples/s, one verifier process)",
                "samples/s",
                "frame -> verdict at the agent p50 ms",
                "p99 ms",
                "raw round trip p50 ms",
                "raw p99 ms",
                "unanswered (pipeline; raw)",
            ],
            rows,
        )
        + "\n\nThe agent's side is this process: it publishes ~20 KB envelopes at QoS 1 at a"
        " steady rate and times each until the verdict for it arrives on its verdict topic."
        " Raw: the same envelopes to a client that republishes each at QoS 1 to a topic this"
        " process subscribes to (two broker hops, as the pipeline's), in turn with the"
        " pipeline at the same rate."
    )
