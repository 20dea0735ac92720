"""Sample ids are unique per agent: another agent's sample with the same id is not lost."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from sqlalchemy import func, select

from cloud_service.db import crud
from cloud_service.db.models import Sample, Verdict
from cloud_service.db.session import make_engine, make_session_factory, upgrade_database
from cloud_service.ingest import IngestSample, sample_row
from cloud_service.settings import CloudSettings
from shared.ids import new_sample_id
from shared.messages import Receipt, decode_verdicts
from shared.topics import Topics
from tests.cloud_service.conftest import image_bytes, make_envelope, make_header, publisher
from tests.cloud_service.test_worker import _wait, running_worker

pytestmark = [pytest.mark.sql]


def _row(agent: str, sample_id: str, fleet: str = "fleet-a") -> dict[str, Any]:
    image = image_bytes()
    header = make_header(image, fleet=fleet, agent=agent, sample_id=sample_id)
    pixels = np.zeros((32, 32, 3), np.uint8)
    sample = IngestSample(header, image, pixels)
    return sample_row(sample, datetime.now(UTC), sample.image_key)


def test_store_samples_keeps_each_agents_sample_once(database_url: str) -> None:
    upgrade_database(database_url)
    engine = make_engine(database_url)
    sessions = make_session_factory(engine)
    sid = new_sample_id()
    try:
        with sessions.begin() as session:
            first = crud.store_samples(session=session, rows=[_row("cam-1", sid)])
        assert first == {("fleet-a", "cam-1", sid): (sid, True)}
        # Another agent's sample with that id, twice in one batch, and a third agent's.
        with sessions.begin() as session:
            second = crud.store_samples(
                session=session,
                rows=[_row("cam-2", sid), _row("cam-2", sid), _row("cam-3", sid, "fleet-b")],
            )
        cam2, new2 = second[("fleet-a", "cam-2", sid)]
        cam3, new3 = second[("fleet-b", "cam-3", sid)]
        assert new2 and new3 and len({sid, cam2, cam3}) == 3
        assert cam2 == crud.colliding_sample_id("fleet-a", "cam-2", sid, 1)
        # Redeliveries, in any order and together: stored once, under the same ids.
        with sessions.begin() as session:
            again = crud.store_samples(
                session=session,
                rows=[_row("cam-3", sid, "fleet-b"), _row("cam-1", sid), _row("cam-2", sid)],
            )
        assert again == {
            ("fleet-b", "cam-3", sid): (cam3, False),
            ("fleet-a", "cam-1", sid): (sid, False),
            ("fleet-a", "cam-2", sid): (cam2, False),
        }
        with sessions() as session:
            rows = {
                (r.agent_id, r.edge_sample_id): r.sample_id
                for r in session.scalars(select(Sample)).all()
            }
        assert rows == {("cam-1", sid): sid, ("cam-2", sid): cam2, ("cam-3", sid): cam3}
    finally:
        engine.dispose()


def test_of_several_rows_with_one_key_the_first_is_stored(database_url: str) -> None:
    # Ingest relies on it: the images of the other rows are deleted as unreferenced.
    upgrade_database(database_url)
    engine = make_engine(database_url)
    sessions = make_session_factory(engine)
    sid = new_sample_id()
    rows = [{**_row("cam-1", sid), "image_key": f"packs/x.pack/{i}-1.jpg"} for i in range(3)]
    try:
        with sessions.begin() as session:
            stored = crud.store_samples(session=session, rows=rows)
        assert stored == {("fleet-a", "cam-1", sid): (sid, True)}
        with sessions() as session:
            keys = session.scalars(select(Sample.image_key).where(Sample.sample_id == sid)).all()
        assert keys == ["packs/x.pack/0-1.jpg"]
    finally:
        engine.dispose()


@pytest.mark.mqtt
def test_two_agents_with_one_sample_id_each_get_their_receipt_and_verdict(
    make_settings: Callable[..., CloudSettings],
    broker: Any,
    topics: Topics,
    database_url: str,
    collector_factory: Any,
) -> None:
    fleet = "fleet-a"
    agents = ("cam-1", "cam-2")
    collector = collector_factory(
        broker.url,
        [topics.receipts(fleet, a) for a in agents] + [topics.verdicts(fleet, a) for a in agents],
        broker.protocol,
    )
    sid = new_sample_id()
    envelopes = {
        agent: make_envelope(
            fleet=fleet, agent=agent, sample_id=sid, predicted=i, image=image_bytes(seed=i)
        )[1]
        for i, agent in enumerate(agents)
    }

    def received(kind: str, agent: str) -> list[bytes]:
        topic = topics.receipts(fleet, agent) if kind == "receipts" else None
        topic = topic or topics.verdicts(fleet, agent)
        return [payload for t, payload in collector.messages if t == topic]

    def receipted(agent: str) -> set[str]:
        return {
            i
            for p in received("receipts", agent)
            for i in Receipt.model_validate_json(p).sample_ids
        }

    with running_worker(make_settings, broker, topics, database_url) as worker:
        pub = publisher(broker.url, broker.protocol)
        for agent in agents:
            pub.publish(topics.samples(fleet, agent), envelopes[agent], qos=1).wait_for_publish(10)
        assert _wait(lambda: worker.counts["verdicts"] >= 2, 60)
        for agent in agents:
            assert collector.wait_for(lambda agent=agent: sid in receipted(agent), 30)
            assert collector.wait_for(lambda agent=agent: len(received("verdicts", agent)) >= 1)
        # Redelivery of both: still stored once each, and each stored verdict goes back
        # to its own agent with the id that agent sent.
        for agent in agents:
            pub.publish(topics.samples(fleet, agent), envelopes[agent], qos=1).wait_for_publish(10)
        assert _wait(lambda: worker.counts["duplicates"] >= 2, 60)
        for agent in agents:
            assert collector.wait_for(lambda agent=agent: len(received("verdicts", agent)) >= 2)
        with worker.sessions() as session:
            samples = {s.agent_id: s for s in session.scalars(select(Sample)).all()}
            verdict_rows = session.scalar(select(func.count()).select_from(Verdict))
        pub.loop_stop()
        pub.disconnect()
    assert set(samples) == set(agents) and verdict_rows == 2
    assert {s.edge_sample_id for s in samples.values()} == {sid}
    assert len({s.sample_id for s in samples.values()}) == 2
    assert {s.edge_predicted for s in samples.values()} == {0, 1}
    for agent in agents:
        verdicts = [v for p in received("verdicts", agent) for v in decode_verdicts(p)]
        assert {(v.sample_id, v.fleet, v.agent) for v in verdicts} == {(sid, fleet, agent)}
        assert sid in receipted(agent)
