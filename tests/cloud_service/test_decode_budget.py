"""A sample past the decode budget at cloud ingest: dead-lettered, its decoder killed,
and the samples sent beside it stored."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import select

from cloud_service.db.models import DeadLetter, Sample
from cloud_service.ingest import DeadLetterRow, IngestSample, classify
from cloud_service.settings import CloudSettings
from cloud_service.worker import VerifierWorker
from shared.decode_pool import DecodePool
from shared.envelope import EnvelopeLimits
from shared.topics import Topics
from tests.cloud_service.conftest import image_bytes, make_envelope, publisher, wait_until
from tests.shared.decoders import slow_progressive_jpeg
from tests.shared.jpeg_bomb import progressive_jpeg

BOMB_SIDE = 2000


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """Tens of milliseconds to decode anywhere: far past a budget of 1 ms."""
    return slow_progressive_jpeg(BOMB_SIDE)


@pytest.fixture
def tiny_budget_pool() -> Iterator[DecodePool]:
    with DecodePool(
        1, budget_s=0.001, preload=("cloud_service.verifier",), name="test-decode"
    ) as pool:
        yield pool


def _classify(image: bytes, size: int, pool: DecodePool) -> object:
    topics = Topics()
    _header, payload = make_envelope(image=image, size=size)
    return classify(
        topics.samples("fleet-a", "cam-1"),
        payload,
        topics=topics,
        limits=EnvelopeLimits(),
        input_size=(32, 32),
        decode_pool=pool,
    )


def test_classify_dead_letters_a_sample_past_its_decode_budget(
    bomb: bytes, tiny_budget_pool: DecodePool
) -> None:
    before = tiny_budget_pool.pids
    outcome = _classify(bomb, BOMB_SIDE, tiny_budget_pool)
    assert isinstance(outcome, DeadLetterRow)
    assert outcome.reason == "image_decode_timeout"
    assert (outcome.fleet, outcome.agent_id) == ("fleet-a", "cam-1")
    assert tiny_budget_pool.pids != before  # its decoder was killed and replaced


def test_baseline_samples_decode_in_process_whatever_the_budget(
    tiny_budget_pool: DecodePool,
) -> None:
    outcome = _classify(image_bytes(), 32, tiny_budget_pool)
    assert isinstance(outcome, IngestSample)
    assert outcome.pixels.shape == (32, 32, 3)
    assert tiny_budget_pool.timeouts == 0


def test_a_progressive_sample_within_its_budget_is_decoded_in_the_pool() -> None:
    with DecodePool(1, budget_s=60, preload=("cloud_service.verifier",)) as pool:
        outcome = _classify(progressive_jpeg(32), 32, pool)
        assert isinstance(outcome, IngestSample)
        assert outcome.pixels.shape == (32, 32, 3)
        assert pool.decoded == 1  # a worker decoded it


@pytest.mark.mqtt
@pytest.mark.sql
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_bomb_over_the_broker_is_dead_lettered_and_the_others_are_stored(
    make_settings: Callable[..., CloudSettings],
    broker: Any,
    topics: Topics,
    database_url: str,
    bomb: bytes,
) -> None:
    fleet, agent = "fleet-a", "cam-1"
    settings = make_settings(
        mqtt_url=broker.url,
        topic_prefix=topics.prefix,
        database_url=database_url,
        verifier_client_id=f"test-verifier-{uuid.uuid4().hex[:8]}",
        mqtt_session_expiry_s=30,
        decode_budget_ms=1.0,
        decode_workers=2,
    )
    with VerifierWorker(settings) as worker:
        pub = publisher(broker.url, broker.protocol)
        sent: list[str] = []
        bombs: list[str] = []
        for i in range(30):
            if i % 10 == 3:
                header, envelope = make_envelope(
                    image=bomb, size=BOMB_SIDE, fleet=fleet, agent=agent
                )
                bombs.append(header.sample_id)
            else:  # baseline JPEGs: decoded in-process, outside the budget
                header, envelope = make_envelope(fleet=fleet, agent=agent)
                sent.append(header.sample_id)
            pub.publish(topics.samples(fleet, agent), envelope, qos=1)
        done = wait_until(lambda: worker.counts["stored"] + worker.counts["dead_letters"] >= 30, 60)
        pub.loop_stop()
        pub.disconnect()
        assert done, worker.counts
        with worker.sessions() as session:
            stored = set(session.scalars(select(Sample.sample_id)).all())
            reasons = session.scalars(select(DeadLetter.reason)).all()
        assert worker.decode_pool.timeouts >= len(bombs)
    assert stored == set(sent)
    assert sorted(reasons) == ["image_decode_timeout"] * len(bombs)
