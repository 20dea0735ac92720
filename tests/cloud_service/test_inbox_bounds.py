"""The verifier's inbox is bounded by count and bytes, with back-pressure on QoS 1."""

from __future__ import annotations

import io
import queue
import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from PIL import Image
from sqlalchemy import select

from cloud_service.db.models import Sample
from cloud_service.ingest import InboxBudget
from cloud_service.settings import CloudSettings
from cloud_service.verifier_transport import VerifierTransport
from cloud_service.worker import VerifierWorker
from shared.messages import Receipt
from shared.topics import Topics
from tests.cloud_service.conftest import make_envelope, publisher, wait_until

BIG = 400  # pixels a side: a noise JPEG of a few hundred KB


def _big_jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (BIG, BIG, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


class _Held:
    """What the worker holds between its inbox and its store, measured from outside."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes = 0
        self.messages = 0
        self.peak_bytes = 0
        self.peak_messages = 0

    def add(self, size: int) -> None:
        with self.lock:
            self.bytes += size
            self.messages += 1
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            self.peak_messages = max(self.peak_messages, self.messages)

    def remove(self, messages: int, size: int) -> None:
        with self.lock:
            self.bytes -= size
            self.messages -= messages


def _instrument(worker: VerifierWorker, held: _Held, gate: threading.Event) -> None:
    """Count what enters the inbox and leaves through the store; stall the store on ``gate``."""

    class Tracking(queue.Queue[Any]):
        def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
            held.add(len(item.payload))
            super().put(item, block, timeout)

    worker.transport.inbox = Tracking()
    store = worker.ingest.store

    def stalled_store(messages: list[Any], outcomes: list[Any], images: Any = None) -> None:
        assert gate.wait(120), "the test never released the store"
        store(messages, outcomes, images)
        held.remove(len(messages), sum(len(m.payload) for m in messages))

    worker.ingest.store = stalled_store  # type: ignore[method-assign]


def _settings(
    make_settings: Callable[..., CloudSettings],
    broker: Any,
    topics: Topics,
    database_url: str,
    client_id: str,
    **overrides: Any,
) -> CloudSettings:
    return make_settings(
        mqtt_url=broker.url,
        topic_prefix=topics.prefix,
        database_url=database_url,
        verifier_client_id=client_id,
        mqtt_session_expiry_s=60,
        **overrides,
    )


def test_budget_bounds_count_and_bytes_and_close_wakes_a_waiter() -> None:
    budget = InboxBudget(max_messages=3, max_bytes=100)
    assert budget.try_acquire(60) and budget.try_acquire(40)
    assert not budget.try_acquire(1)  # bytes full
    budget.release(2, 100)
    assert budget.try_acquire(500)  # alone, one larger than the bound is let in
    assert not budget.try_acquire(0)
    budget.release(1, 500)
    for _ in range(3):
        assert budget.try_acquire(0)
    assert not budget.try_acquire(0)  # count full
    assert budget.peak_messages == 3 and budget.peak_bytes == 500
    answers: list[bool] = []
    waiter = threading.Thread(target=lambda: answers.append(budget.acquire(10)))
    waiter.start()
    assert wait_until(lambda: budget.waiting == 1, 30)
    budget.release(1, 0)
    waiter.join(30)
    assert answers == [True]
    waiter = threading.Thread(target=lambda: answers.append(budget.acquire(10)))
    waiter.start()
    assert wait_until(lambda: budget.waiting == 1, 30)
    budget.close()
    waiter.join(30)
    assert answers == [True, False] and not waiter.is_alive()


@pytest.mark.mqtt
@pytest.mark.sql
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_inbox_stays_within_its_bytes_while_stalled_and_loses_no_qos1_sample(
    make_settings: Callable[..., CloudSettings],
    broker: Any,
    topics: Topics,
    database_url: str,
    collector_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fleet, agent = "fleet-a", "cam-1"
    bound = 2 * 1024 * 1024
    images = [_big_jpeg(seed) for seed in range(4)]
    size = len(make_envelope(fleet=fleet, agent=agent, image=images[0], size=BIG)[1])
    assert 100_000 < size < bound // 3
    collector = collector_factory(broker.url, [topics.receipts(fleet, agent)], broker.protocol)
    arrived = threading.Semaphore(0)
    on_message = VerifierTransport._on_message

    def counting(self: VerifierTransport, *args: Any) -> None:
        on_message(self, *args)
        arrived.release()

    monkeypatch.setattr(VerifierTransport, "_on_message", counting)
    settings = _settings(
        make_settings,
        broker,
        topics,
        database_url,
        f"test-inbox-{uuid.uuid4().hex[:8]}",
        inbox_max_bytes=bound,
        inbox_max_messages=1000,
    )
    held, gate = _Held(), threading.Event()
    worker = VerifierWorker(settings)
    _instrument(worker, held, gate)
    pub = publisher(broker.url, broker.protocol)
    try:
        worker.start()
        # A QoS 0 flood while the store is stalled: nothing resends QoS 0, so what does
        # not fit is dropped, never buffered.
        flood = 30
        for i in range(flood):
            _, envelope = make_envelope(
                fleet=fleet, agent=agent, image=images[i % len(images)], size=BIG
            )
            pub.publish(topics.samples(fleet, agent), envelope, qos=0)
        for _ in range(flood):
            assert arrived.acquire(timeout=60), "the QoS 0 flood did not reach the verifier"
        assert held.peak_bytes <= bound, f"held {held.peak_bytes} bytes over a {bound} bound"
        # QoS 1 samples now: the MQTT thread waits for room instead of buffering them.
        sent: list[str] = []
        for i in range(12):
            header, envelope = make_envelope(
                fleet=fleet, agent=agent, image=images[i % len(images)], size=BIG
            )
            sent.append(header.sample_id)
            pub.publish(topics.samples(fleet, agent), envelope, qos=1)
        assert wait_until(lambda: worker.inbox.waiting == 1, 60)
        dropped = worker.metrics.inbox_dropped.labels("qos0_inbox_full")._value.get()
        assert dropped >= flood - bound // size
        gate.set()
        assert wait_until(lambda: worker.counts["stored"] >= len(sent), 120)

        def receipted() -> set[str]:
            ids: set[str] = set()
            for _topic, payload in collector.messages:
                ids.update(Receipt.model_validate_json(payload).sample_ids)
            return ids

        assert collector.wait_for(lambda: receipted() >= set(sent), 60)
        with worker.sessions() as session:
            stored = set(session.scalars(select(Sample.sample_id)))
        assert set(sent) <= stored
        assert held.peak_bytes <= bound and worker.inbox.peak_bytes <= bound
        metrics = worker.metrics.render().decode()
        assert "edgeloop_verifier_inbox_bytes " in metrics
        assert 'edgeloop_verifier_inbox_dropped_total{reason="qos0_inbox_full"}' in metrics
    finally:
        gate.set()
        pub.loop_stop()
        pub.disconnect()
        worker.stop()


@pytest.mark.mqtt
@pytest.mark.sql
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_stop_returns_while_the_mqtt_thread_waits_and_the_next_verifier_gets_the_rest(
    make_settings: Callable[..., CloudSettings],
    broker: Any,
    topics: Topics,
    database_url: str,
) -> None:
    fleet, agent = "fleet-a", "cam-1"
    bound = 1024 * 1024
    image = _big_jpeg(7)
    client_id = f"test-inbox-stop-{uuid.uuid4().hex[:8]}"
    settings = _settings(
        make_settings,
        broker,
        topics,
        database_url,
        client_id,
        inbox_max_bytes=bound,
        inbox_max_messages=1000,
    )
    held, gate = _Held(), threading.Event()
    worker = VerifierWorker(settings)
    _instrument(worker, held, gate)
    pub = publisher(broker.url, broker.protocol)
    sent: list[str] = []
    try:
        worker.start()
        for _ in range(10):
            header, envelope = make_envelope(fleet=fleet, agent=agent, image=image, size=BIG)
            sent.append(header.sample_id)
            pub.publish(topics.samples(fleet, agent), envelope, qos=1)
        assert wait_until(lambda: worker.inbox.waiting == 1, 60)
        stopper = threading.Thread(target=worker.stop)
        stopper.start()
        # The MQTT thread gives up its wait (its message stays the broker's) ...
        assert wait_until(lambda: worker.inbox.waiting == 0, 60)
        gate.set()  # ... and the store finishes what it holds.
        stopper.join(120)
        assert not stopper.is_alive(), "stop() hung with the MQTT thread on a full inbox"
        # Nothing acked was lost and nothing unacked is gone: the next verifier on the
        # same session stores the rest.
        with VerifierWorker(settings) as again:
            assert wait_until(
                lambda: again.counts["stored"] + worker.counts["stored"] >= len(sent), 120
            )
            with again.sessions() as session:
                stored = set(session.scalars(select(Sample.sample_id)))
        assert set(sent) <= stored
    finally:
        gate.set()
        pub.loop_stop()
        pub.disconnect()
        worker.stop()
