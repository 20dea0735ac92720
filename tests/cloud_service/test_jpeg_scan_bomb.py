"""A JPEG scan bomb at cloud ingest: dead-lettered with its reason, never decoded or stored."""

from __future__ import annotations

from cloud_service.ingest import DeadLetterRow, IngestSample, classify
from shared.envelope import EnvelopeLimits
from shared.images import MAX_JPEG_SCANS
from shared.topics import Topics
from tests.cloud_service.conftest import make_envelope
from tests.shared.jpeg_bomb import progressive_jpeg, scan_bomb

TOPICS = Topics()


def _classify(image: bytes) -> object:
    _header, payload = make_envelope(image=image, size=64)
    return classify(
        TOPICS.samples("fleet-a", "cam-1"),
        payload,
        topics=TOPICS,
        limits=EnvelopeLimits(),
        input_size=(32, 32),
    )


def test_scan_bomb_is_dead_lettered_with_its_reason() -> None:
    outcome = _classify(scan_bomb(MAX_JPEG_SCANS * 4))
    assert isinstance(outcome, DeadLetterRow)
    assert outcome.reason == "jpeg_too_many_scans"
    assert (outcome.fleet, outcome.agent_id) == ("fleet-a", "cam-1")


def test_normal_progressive_sample_after_a_bomb_is_ingested() -> None:
    assert isinstance(_classify(scan_bomb(MAX_JPEG_SCANS + 1)), DeadLetterRow)
    outcome = _classify(progressive_jpeg())
    assert isinstance(outcome, IngestSample)
    assert outcome.pixels.shape == (32, 32, 3)
