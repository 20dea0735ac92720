"""The fleet simulation's agents: paho clients driven from one asyncio event loop.

Each ``SimAgent`` has its own connection and client id, publishes real sample envelopes
(``shared.envelope``, ``SampleHeader``) at QoS 1 on its own samples topic, and subscribes
to its own receipts and verdicts; ``LoopDriver`` hooks every client's socket into the
loop (paho's external-loop hooks: a reader and, when needed, a writer per socket)
instead of a thread each. ``publish_schedule`` publishes at a fixed per-agent rate from
a random phase; the ``Ledger`` notes what was sent and when its receipt and verdict came.
"""

from __future__ import annotations

import asyncio
import io
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
from PIL import Image

from shared.envelope import encode_envelope
from shared.errors import MessageError, TransportError
from shared.ids import new_sample_id
from shared.messages import Receipt, SampleHeader, decode_message, decode_verdicts
from shared.mqtt import MqttTarget
from shared.topics import Topics

__all__ = [
    "Ledger",
    "LoopDriver",
    "SimAgent",
    "camera_jpeg",
    "connect_agents",
    "payload_bytes",
    "publish_schedule",
    "sample_template",
]


def camera_jpeg(px: int, seed: int) -> bytes:
    """A camera crop as JPEG q90: smooth texture plus noise, like bench/envelope.py's frames."""
    rng = np.random.default_rng(seed)
    pixels = (rng.random((px, px, 3)) * 60 + 100).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@dataclass
class Ledger:
    """What the fleet sent and got back, keyed by sample id (one ledger per run)."""

    captured: dict[str, float] = field(default_factory=dict)  # sample id -> capture wall time
    step_of: dict[str, int] = field(default_factory=dict)
    verdict_at: dict[str, float] = field(default_factory=dict)
    receipt_at: dict[str, float] = field(default_factory=dict)
    refused: int = 0

    def on_verdict(self, payload: bytes | bytearray) -> None:
        now = time.time()
        try:
            verdicts = decode_verdicts(payload)
        except MessageError:
            self.refused += 1
            return
        for verdict in verdicts:
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


class SimAgent:
    """One simulated agent: its own paho client and connection, driven by the shared loop."""

    def __init__(
        self,
        name: str,
        client: mqtt.Client,
        topics: Topics,
        fleet: str,
        ledger: Ledger,
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


class LoopDriver:
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


async def connect_agents(
    agents: Sequence[SimAgent], target: MqttTarget, *, batch: int = 50, timeout: float = 60.0
) -> None:
    for start in range(0, len(agents), batch):
        group = agents[start : start + batch]
        for agent in group:
            try:
                agent.client.connect(target.host, target.port, keepalive=60)
            except OSError as exc:
                raise TransportError(f"agent {agent.name} cannot connect: {exc}") from exc
        await asyncio.wait_for(asyncio.gather(*(a.ready.wait() for a in group)), timeout)


async def publish_schedule(
    agents: Sequence[SimAgent],
    *,
    rate: float,
    seconds: float,
    template: SampleHeader,
    image: bytes,
    ledger: Ledger,
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


def sample_template(fleet: str, image: bytes, px: int) -> SampleHeader:
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


def payload_bytes(fleet: str, px: int, seed: int) -> int:
    """Bytes of one sample envelope as the simulated agents send it."""
    image = camera_jpeg(px, seed)
    return len(encode_envelope(sample_template(fleet, image, px), image))
