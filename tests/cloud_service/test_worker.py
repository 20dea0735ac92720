"""Ingest and verification through the real broker into both databases."""

from __future__ import annotations

import gc
import json
import struct
import threading
import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import func, select, update

from cloud_service.db.models import Agent, DeadLetter, Sample, Verdict
from cloud_service.settings import CloudSettings
from cloud_service.worker import VerifierWorker
from shared.broker import free_port
from shared.errors import TransportError
from shared.messages import AgentStatus, Receipt, decode_verdicts, encode_message
from shared.topics import Topics
from tests.cloud_service.conftest import (
    dead_blob_writer,
    image_bytes,
    make_envelope,
    make_header,
    publisher,
    wait_until,
)

pytestmark = [pytest.mark.mqtt, pytest.mark.sql]


@contextmanager
def running_worker(
    make_settings: Callable[..., CloudSettings],
    broker: object,
    topics: Topics,
    database_url: str,
    **overrides: object,
) -> Iterator[VerifierWorker]:
    settings = make_settings(
        mqtt_url=broker.url,  # type: ignore[attr-defined]
        topic_prefix=topics.prefix,
        database_url=database_url,
        verifier_client_id=f"test-verifier-{uuid.uuid4().hex[:8]}",
        mqtt_session_expiry_s=30,
        **overrides,
    )
    with VerifierWorker(settings) as worker:
        yield worker


def _raw_envelope(header: bytes, image: bytes, *, version: int = 1) -> bytes:
    crc = zlib.crc32(image, zlib.crc32(header))
    return struct.pack(">4sBBHI", b"ELSE", version, 0, len(header), crc) + header + image


def _wait(predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
    return wait_until(predicate, timeout, step=0.05)


def test_samples_are_stored_receipted_and_verified(
    make_settings: Callable[..., CloudSettings],
    broker: Any,
    topics: Topics,
    database_url: str,
    collector_factory: Any,
) -> None:
    fleet, agent = "fleet-a", "cam-1"
    collector = collector_factory(
        broker.url, [topics.receipts(fleet, agent), topics.verdicts(fleet, agent)], broker.protocol
    )
    with running_worker(make_settings, broker, topics, database_url) as worker:
        pub = publisher(broker.url, broker.protocol)
        sent = []
        images = {}
        for i in range(40):
            image = image_bytes(seed=i)
            header, envelope = make_envelope(fleet=fleet, agent=agent, priority=i % 10, image=image)
            sent.append(header.sample_id)
            images[header.sample_id] = image
            pub.publish(topics.samples(fleet, agent), envelope, qos=1)
        # The same sample twice more: stored once, receipted each time.
        header, envelope = make_envelope(fleet=fleet, agent=agent, sample_id=sent[0])
        pub.publish(topics.samples(fleet, agent), envelope, qos=1).wait_for_publish(5)
        assert _wait(lambda: worker.counts["verdicts"] >= 40)
        pub.publish(topics.samples(fleet, agent), envelope, qos=1).wait_for_publish(5)
        assert _wait(lambda: worker.counts["duplicates"] >= 2)

        def receipted() -> set[str]:
            ids: set[str] = set()
            for topic, payload in collector.messages:
                if topic.endswith("/receipts"):
                    ids.update(Receipt.model_validate_json(payload).sample_ids)
            return ids

        assert collector.wait_for(lambda: receipted() >= set(sent))
        assert collector.wait_for(
            lambda: len({t for t, _ in collector.messages if t.endswith("/verdicts")}) > 0
        )
        with worker.sessions() as session:
            assert session.scalar(select(func.count()).select_from(Sample)) == 40
            assert session.scalar(select(func.count()).select_from(Verdict)) == 40
            statuses = set(session.scalars(select(Sample.status)).all())
            assert statuses <= {"verified", "flagged"}
            rows = session.execute(select(Sample.sample_id, Sample.image_key))
            keys = {sample_id: key for sample_id, key in rows}
        # Each row reads back its own image; a batch's images share one pack file.
        assert {sid: worker.blobs.get(key) for sid, key in keys.items()} == images
        packs = {key.rsplit("/", 1)[0] for key in keys.values()}
        assert all(pack.endswith(".pack") for pack in packs) and len(packs) < len(keys)
        pub.loop_stop()
        pub.disconnect()
    verdicts = [v for t, p in collector.messages if "verdicts" in t for v in decode_verdicts(p)]
    # 40 new verdicts, plus the stored one republished for the duplicate after verification.
    assert {v.sample_id for v in verdicts} == set(sent)
    assert len(verdicts) >= 40
    assert all(v.teacher_model == "teacher" and len(v.scores) == 10 for v in verdicts)
    metrics = worker.metrics.render().decode()
    assert "edgeloop_verifier_batch_size_count" in metrics
    assert 'edgeloop_agent_forwarded_samples_total{agent="cam-1",fleet="fleet-a"} 42.0' in metrics
    assert 'edgeloop_thread_cpu_seconds_total{thread="other"}' in metrics


def test_every_malformed_case_lands_in_dead_letters_with_its_reason(
    make_settings: Callable[..., CloudSettings], broker: Any, topics: Topics, database_url: str
) -> None:
    fleet, agent = "fleet-a", "cam-1"
    topic = topics.samples(fleet, agent)
    good_image = image_bytes()
    header = make_header(good_image, fleet=fleet, agent=agent)
    header_json = json.loads(encode_message(header))

    def with_fields(**fields: object) -> bytes:
        return json.dumps({**header_json, **fields}).encode()

    truncated_jpeg = good_image[: len(good_image) // 2]
    big_png = image_bytes(size=64, fmt="PNG", seed=3)
    cases: dict[str, bytes] = {
        "truncated": b"ELSE",
        "bad_magic": b"this is not an envelope at all",
        "checksum": _raw_envelope(encode_message(header), good_image)[:-1] + b"\x00",
        "unknown_schema": _raw_envelope(with_fields(schema="edgeloop.verdict"), good_image),
        "unsupported_version": _raw_envelope(with_fields(v=2), good_image),
        "invalid_message": _raw_envelope(with_fields(confidence="high"), good_image),
        "too_large": make_envelope(image=big_png, size=64, fmt="png", fleet=fleet, agent=agent)[1],
        "bad_image": _raw_envelope(
            encode_message(make_header(truncated_jpeg, fleet=fleet, agent=agent)),
            truncated_jpeg,
        ),
        "topic_mismatch": make_envelope(fleet=fleet, agent="cam-2")[1],
    }
    # A newer envelope format version is refused too (reason unsupported_version).
    extra = _raw_envelope(encode_message(header), good_image, version=9)
    with running_worker(
        make_settings, broker, topics, database_url, max_image_bytes=4096
    ) as worker:
        pub = publisher(broker.url, broker.protocol)
        for payload in [*cases.values(), extra]:
            pub.publish(topic, payload, qos=1).wait_for_publish(5)
        # A status on the samples topic is refused as invalid too, never stored.
        assert _wait(lambda: worker.counts["dead_letters"] >= len(cases) + 1)
        pub.loop_stop()
        pub.disconnect()
        with worker.sessions() as session:
            rows = session.scalars(select(DeadLetter).order_by(DeadLetter.id)).all()
            assert session.scalar(select(func.count()).select_from(Sample)) == 0
        metrics = worker.metrics.render().decode()
    reasons = [row.reason for row in rows]
    assert reasons == [*cases.keys(), "unsupported_version"], [(r.reason, r.message) for r in rows]
    for row in rows:
        assert row.message and row.topic == topic and row.payload_size > 0
    assert 'edgeloop_dead_letters_total{reason="topic_mismatch"} 1.0' in metrics


def test_agent_status_and_last_will_update_the_agents_table(
    make_settings: Callable[..., CloudSettings], broker: Any, topics: Topics, database_url: str
) -> None:
    fleet, agent = "fleet-a", "cam-9"
    with running_worker(make_settings, broker, topics, database_url) as worker:
        pub = publisher(broker.url, broker.protocol)
        online = AgentStatus(
            fleet=fleet,
            agent=agent,
            state="online",
            sent_at=datetime.now(UTC),
            model_version="s-7",
            frames_per_s=29.5,
            spool_depth=3,
        )
        pub.publish(topics.status(fleet, agent), encode_message(online), qos=1).wait_for_publish(5)

        def state() -> str | None:
            with worker.sessions() as session:
                row = session.get(Agent, agent)
                return row.state if row else None

        assert _wait(lambda: state() == "online")
        offline = AgentStatus(fleet=fleet, agent=agent, state="offline", sent_at=datetime.now(UTC))
        pub.publish(topics.status(fleet, agent), encode_message(offline), qos=1).wait_for_publish(5)
        assert _wait(lambda: state() == "offline")
        # A status naming another agent than its topic is refused.
        pub.publish(topics.status(fleet, "cam-8"), encode_message(offline), qos=1)
        assert _wait(lambda: worker.counts["dead_letters"] == 1)
        pub.publish(topics.status(fleet, agent), b"", qos=1, retain=True)  # clears retained
        pub.loop_stop()
        pub.disconnect()
        with worker.sessions() as session:
            row = session.get(Agent, agent)
            assert row is not None and row.model_version == "s-7"
            assert row.telemetry.get("frames_per_s") is None  # the offline status replaced it


def _smooth_jpeg(height: int, width: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], axis=-1)
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


@pytest.mark.parametrize(("source", "size"), [((208, 208), (64, 64)), ((64, 96), (64, 64))])
def test_decode_image_scales_to_the_teacher_input(
    source: tuple[int, int], size: tuple[int, int]
) -> None:
    import io

    import numpy as np
    from PIL import Image

    from cloud_service.verifier import decode_image

    data = _smooth_jpeg(*source)
    got = decode_image(data, size)
    assert got.shape == (*size, 3) and got.dtype == np.uint8 and got.flags.c_contiguous
    # Same picture as a full decode resized by Pillow, up to JPEG and filter differences.
    with Image.open(io.BytesIO(data)) as image:
        want = np.asarray(image.convert("RGB").resize(size[::-1], Image.Resampling.BOX))
    assert np.abs(got.astype(int) - want.astype(int)).mean() < 4
    assert decode_image(data, None).shape == (*source, 3)


@pytest.mark.parametrize("kind", ["jpeg", "png-gray", "png-alpha"])
@pytest.mark.parametrize("size", [(64, 64), None])
def test_decode_image_gives_rgb_pixels_whatever_the_image_holds(
    kind: str, size: tuple[int, int] | None
) -> None:
    """RGB order from a colour JPEG, a grey PNG and one with alpha, at full size (a PNG
    exactly as Pillow reads it) and at the teacher's (reduced, then resized)."""
    import io

    import numpy as np
    from PIL import Image

    from cloud_service.verifier import decode_image

    if kind == "jpeg":
        data = _smooth_jpeg(208, 208)
    else:
        rng = np.random.default_rng(3)
        mode, channels = ("L", ()) if kind == "png-gray" else ("RGBA", (4,))
        pixels = rng.integers(0, 255, (208, 208, *channels), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels, mode).save(buffer, format="PNG")
        data = buffer.getvalue()
    with Image.open(io.BytesIO(data)) as image:
        rgb = image.convert("RGB")
        want = np.asarray(rgb if size is None else rgb.resize(size[::-1], Image.Resampling.BOX))
    diff = np.abs(decode_image(data, size).astype(int) - want.astype(int))
    if size is None:
        assert diff.max() <= (2 if kind == "jpeg" else 0)
    else:  # noise PNGs differ most between two area filters; a photo far less
        assert diff.mean() < (4 if kind == "jpeg" else 12)


def test_decode_image_refuses_a_truncated_jpeg_and_garbage() -> None:
    from cloud_service.verifier import decode_image
    from shared.errors import ImageError

    data = _smooth_jpeg(64, 64)
    with pytest.raises(ImageError, match="truncated"):
        decode_image(data[: len(data) // 2], (64, 64))
    with pytest.raises(ImageError):
        decode_image(b"\xff\xd8 not really a jpeg", (64, 64))


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_stop_from_several_threads_at_once_stops_once(
    make_settings: Callable[..., CloudSettings], broker: Any, topics: Topics, database_url: str
) -> None:
    """The shape of a stop racing a stop (a signal handler and the owner's ``finally``):
    every caller returns, none raises, and the MQTT thread is gone."""
    with running_worker(make_settings, broker, topics, database_url) as worker:
        assert worker.ready
        barrier = threading.Barrier(4)
        errors: list[BaseException] = []

        def stop() -> None:
            barrier.wait(30)
            try:
                worker.stop()
            except BaseException as exc:  # the test's finding, reported below
                errors.append(exc)

        stoppers = [threading.Thread(target=stop) for _ in range(4)]
        for thread in stoppers:
            thread.start()
        for thread in stoppers:
            thread.join(60)
    assert errors == [] and not any(thread.is_alive() for thread in stoppers)
    health = worker.health()
    assert health["ready"] is False
    assert health["mqtt"]["alive"] is False  # type: ignore[index]
    assert not any(health["threads"].values())  # type: ignore[attr-defined]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_collectors_threshold_is_the_verifiers_while_it_runs(
    make_settings: Callable[..., CloudSettings], broker: Any, topics: Topics, database_url: str
) -> None:
    own, frozen = gc.get_threshold(), gc.get_freeze_count()
    overrides = {"verifier_gc_young_every": 50_000}
    with running_worker(make_settings, broker, topics, database_url, **overrides):
        assert gc.get_threshold()[0] == 50_000
        assert gc.get_freeze_count() > frozen  # the teacher, the engine, the pools
    assert gc.get_threshold() == own
    assert gc.get_freeze_count() == frozen


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_an_unreachable_broker_fails_the_start_and_leaves_no_thread(
    make_settings: Callable[..., CloudSettings], topics: Topics, database_url: str
) -> None:
    settings = make_settings(
        mqtt_url=f"mqtt://127.0.0.1:{free_port()}",  # nothing listens there
        topic_prefix=topics.prefix,
        database_url=database_url,
        verifier_client_id=f"test-verifier-{uuid.uuid4().hex[:8]}",
    )
    worker = VerifierWorker(settings)
    with pytest.raises(TransportError, match="cannot reach"):
        worker.start()
    health = worker.health()
    assert health["mqtt"]["alive"] is False  # type: ignore[index]
    assert not any(health["threads"].values())  # type: ignore[attr-defined]
    worker.stop()  # stopped already: nothing to do


def test_a_store_retried_through_a_database_outage_writes_its_images_once(
    make_settings: Callable[..., CloudSettings],
    broker: Any,
    topics: Topics,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sqlalchemy.exc import OperationalError

    from cloud_service.db import crud

    store_samples = crud.store_samples
    failures = []

    def down_twice(**kwargs: Any) -> Any:
        if len(failures) < 2:
            failures.append(1)
            raise OperationalError("INSERT", {}, Exception("the database is down"))
        return store_samples(**kwargs)

    monkeypatch.setattr(crud, "store_samples", down_twice)
    fleet, agent = "fleet-a", "cam-1"
    with running_worker(make_settings, broker, topics, database_url) as worker:
        pub = publisher(broker.url, broker.protocol)
        for i in range(10):
            _, envelope = make_envelope(fleet=fleet, agent=agent, image=image_bytes(seed=i))
            pub.publish(topics.samples(fleet, agent), envelope, qos=1)
        assert _wait(lambda: worker.counts["stored"] >= 10)
        pub.loop_stop()
        pub.disconnect()
        with worker.sessions() as session:
            keys = session.scalars(select(Sample.image_key)).all()
        on_disk = {str(p.relative_to(worker.blobs.root)) for p in worker.blobs.root.rglob("*.pack")}  # type: ignore[attr-defined]
    assert len(failures) == 2 and len(keys) == 10
    # Every pack on disk is one a row points at: the retries wrote no second copy.
    assert on_disk == {key.rsplit("/", 1)[0] for key in keys}


def test_redelivered_samples_leave_no_image_bytes_behind(
    make_settings: Callable[..., CloudSettings], broker: Any, topics: Topics, database_url: str
) -> None:
    fleet, agent = "fleet-a", "cam-1"
    with running_worker(make_settings, broker, topics, database_url) as worker:
        pub = publisher(broker.url, broker.protocol)
        envelopes = [
            make_envelope(fleet=fleet, agent=agent, image=image_bytes(seed=i))[1] for i in range(12)
        ]
        for envelope in envelopes:
            pub.publish(topics.samples(fleet, agent), envelope, qos=1)
        assert _wait(lambda: worker.counts["stored"] >= 12)
        # Delivered again (an agent resending after a lost receipt), twice in one go.
        for envelope in envelopes + envelopes[:3]:
            pub.publish(topics.samples(fleet, agent), envelope, qos=1)
        assert _wait(lambda: worker.counts["duplicates"] >= 15)
        pub.loop_stop()
        pub.disconnect()
        with worker.sessions() as session:
            keys = set(session.scalars(select(Sample.image_key)).all())
        root = worker.blobs.root  # type: ignore[attr-defined]
        packs = {str(p.relative_to(root)): p for p in root.rglob("*.pack")}
        images = {key: worker.blobs.get(key) for key in keys}
        assert worker.counts["stored"] == 12 and worker.counts["images_discarded"] == 15
        assert "edgeloop_ingest_images_discarded_total 15.0" in worker.metrics.render().decode()
        writers = root / "packs" / ".writers"  # every batch settled: no pack left marked
        assert [p.name for p in writers.glob("*/*")] == ["lock"]
    assert len(keys) == 12 and len(set(images.values())) == 12
    # Every pack left is one a row points at, and holds no byte but the rows' images:
    # the second copies were deleted (a pack of them alone is gone).
    assert set(packs) == {key.rsplit("/", 1)[0] for key in keys}
    for name, path in packs.items():
        own = sum(len(data) for key, data in images.items() if key.startswith(name + "/"))
        deleted = path.with_name(path.name + ".deleted")
        ranges = deleted.read_text().split() if deleted.exists() else []
        freed = sum(int(r.split("-")[1]) for r in ranges)
        assert own + freed == path.stat().st_size


def test_images_a_dead_verifier_left_unsettled_are_swept_of_what_no_row_points_at(
    make_settings: Callable[..., CloudSettings], broker: Any, topics: Topics, database_url: str
) -> None:
    fleet, agent = "fleet-a", "cam-1"
    with running_worker(make_settings, broker, topics, database_url) as worker:
        pub = publisher(broker.url, broker.protocol)
        envelopes = [make_envelope(fleet=fleet, agent=agent)[1] for _ in range(2)]
        for envelope in envelopes:
            pub.publish(topics.samples(fleet, agent), envelope, qos=1)
        assert _wait(lambda: worker.counts["stored"] >= 2)
        pub.loop_stop()
        pub.disconnect()
        root = worker.blobs.root  # type: ignore[attr-defined]
        # Another verifier process wrote two batches' images and died before either
        # settled: the first batch's rows had committed (one row here stands for
        # them), the second's never did.
        committed, lost = dead_blob_writer(root, [["aaaa", "bb", "cccccc"], ["dd", "ee"]])
        with worker.sessions.begin() as session:
            sample_id = session.scalars(select(Sample.sample_id).limit(1)).one()
            session.execute(
                update(Sample).where(Sample.sample_id == sample_id).values(image_key=committed[1])
            )
        left_alone = worker.recovery.sweep_abandoned_images()  # marked too recently
        swept = worker.recovery.sweep_abandoned_images(older_than_s=0)
        assert left_alone.batches == 0
        assert (swept.batches, swept.bytes_kept, swept.bytes_deleted) == (2, 2, 4 + 6 + 2 + 2)
        assert worker.blobs.get(committed[1]) == b"bb"
        assert not any(worker.blobs.exists(k) for k in [committed[0], committed[2], *lost])
        with worker.sessions() as session:  # the live worker's own images are untouched
            keys = session.scalars(select(Sample.image_key)).all()
        assert all(worker.blobs.exists(key) for key in keys)
        assert "edgeloop_blob_abandoned_batches_total 2.0" in worker.metrics.render().decode()
