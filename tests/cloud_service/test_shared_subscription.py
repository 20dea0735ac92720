"""Two verifiers share one fleet's samples through an MQTT v5 shared subscription."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from sqlalchemy import func, select

from cloud_service.db.models import Sample, Verdict
from cloud_service.settings import CloudSettings
from cloud_service.worker import VerifierWorker
from shared.messages import Receipt, decode_verdicts
from shared.mqtt import MqttTarget, negotiate_protocol
from shared.topics import Topics
from tests.cloud_service.conftest import image_bytes, make_envelope, publisher, wait_until

# The quick reference teacher trains once a test session (about 20 s on a quiet
# two-core machine, minutes on a busy one), inside whichever test asks first.
pytestmark = [pytest.mark.mqtt, pytest.mark.sql, pytest.mark.slow, pytest.mark.timeout(900)]

SAMPLES = 120


# Bounds, not expectations: each wait returns as soon as its condition holds, and only a
# lost or stuck sample runs into it (a busy host verifies 120 samples in minutes).
def _wait(predicate: Callable[[], bool], timeout: float = 300.0) -> bool:
    return wait_until(predicate, timeout, step=0.05)


@pytest.fixture
def shared_database_url(database_url: str) -> Iterator[str]:
    """PostgreSQL: several verifiers writing one database is a PostgreSQL deployment."""
    if database_url.startswith("sqlite"):
        pytest.skip("several verifiers on one database run on PostgreSQL; SQLite runs one")
    yield database_url


def test_two_verifiers_share_the_samples_and_verify_each_once(
    make_settings: Callable[..., CloudSettings],
    mosquitto: Any,
    topics: Topics,
    shared_database_url: str,
    collector_factory: Callable[..., Any],
    request: pytest.FixtureRequest,
) -> None:
    # Asked for here, after the database fixture had its say: a skipped run trains nothing.
    quick_models = request.getfixturevalue("quick_models")
    protocol = negotiate_protocol(MqttTarget.parse(mosquitto.url))
    assert protocol == "5", "the private Mosquitto must speak MQTT v5 for shared subscriptions"
    fleet, agent = "fleet-a", "cam-1"
    group = f"verifiers-{uuid.uuid4().hex[:6]}"
    collector = collector_factory(
        mosquitto.url, [topics.receipts(fleet, agent), topics.verdicts(fleet, agent)], protocol
    )

    def settings(name: str) -> CloudSettings:
        return make_settings(
            mqtt_url=mosquitto.url,
            topic_prefix=topics.prefix,
            database_url=shared_database_url,
            teacher_model=quick_models.teacher_onnx,
            verifier_group=group,
            verifier_client_id=f"test-{name}-{uuid.uuid4().hex[:8]}",
            mqtt_session_expiry_s=30,
        )

    size = quick_models.frame_size
    with ExitStack() as stack:
        # One after the other: the first applies the migrations, the second finds them done.
        first = stack.enter_context(VerifierWorker(settings("verifier-a")))
        second = stack.enter_context(VerifierWorker(settings("verifier-b")))
        workers = [first, second]
        assert all(w.protocol == "5" for w in workers)
        assert all(w.subscriptions()[0].startswith(f"$share/{group}/") for w in workers)

        pub = publisher(mosquitto.url, protocol)
        try:
            sent: list[str] = []
            for i in range(SAMPLES):
                header, envelope = make_envelope(
                    fleet=fleet,
                    agent=agent,
                    image=image_bytes(size, seed=i),
                    size=size,
                    priority=i % 8,  # below the shedding priorities: none is left pending
                )
                sent.append(header.sample_id)
                pub.publish(topics.samples(fleet, agent), envelope, qos=1)

            def verdict_rows() -> int:
                with first.sessions() as session:
                    return int(session.scalar(select(func.count()).select_from(Verdict)) or 0)

            assert _wait(lambda: verdict_rows() >= SAMPLES), (
                f"{verdict_rows()} of {SAMPLES} verified; counts {[w.counts for w in workers]}"
            )
        finally:
            pub.loop_stop()
            pub.disconnect()

        with first.sessions() as session:
            sample_ids = session.scalars(select(Sample.sample_id)).all()
            verdict_ids = session.scalars(select(Verdict.sample_id)).all()
            statuses = set(session.scalars(select(Sample.status)).all())

        # Every sample stored once and verified exactly once: none lost, none doubled.
        assert sorted(sample_ids) == sorted(sent)
        assert sorted(verdict_ids) == sorted(sent)
        assert statuses <= {"verified", "flagged"}

        # Both verifiers took a share, and the broker gave each message to one of them.
        stored = [w.counts["stored"] for w in workers]
        verified = [w.counts["verdicts"] for w in workers]
        assert all(n > 0 for n in stored), f"stored per verifier: {stored}"
        assert all(n > 0 for n in verified), f"verdicts per verifier: {verified}"
        assert sum(stored) == SAMPLES, f"stored per verifier: {stored}"
        assert sum(verified) == SAMPLES, f"verdicts per verifier: {verified}"
        assert all(w.counts["duplicates"] == 0 for w in workers)

        def receipted() -> set[str]:
            ids: set[str] = set()
            for topic, payload in collector.messages:
                if topic.endswith("/receipts"):
                    ids.update(Receipt.model_validate_json(payload).sample_ids)
            return ids

        def verdicts_heard() -> set[str]:
            return {
                verdict.sample_id
                for topic, payload in collector.messages
                if topic.endswith("/verdicts")
                for verdict in decode_verdicts(payload)
            }

        # The agent hears a receipt and a verdict for every sample, whichever verifier took it.
        assert collector.wait_for(lambda: receipted() >= set(sent), timeout=120)
        assert collector.wait_for(lambda: verdicts_heard() >= set(sent), timeout=120)
