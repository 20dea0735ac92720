"""A teacher detector behind the verifier: boxes compared, differences flagged, stored."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from sqlalchemy import select

from cloud_service.db.models import Sample, Verdict
from cloud_service.settings import CloudSettings
from edge_agent.testing import make_tiny_detector
from shared.envelope import encode_envelope
from shared.messages import SampleHeader, decode_verdicts
from shared.topics import Topics
from tests.cloud_service.conftest import SIZE, make_header, publisher
from tests.cloud_service.test_worker import _wait, running_worker

pytestmark = [pytest.mark.mqtt, pytest.mark.sql]

BOXES = [(0.1, 0.1, 0.4, 0.5, 1), (0.5, 0.2, 0.9, 0.7, 2)]


def gray_jpeg(level: int) -> bytes:
    """A frame the tiny teacher detector scores ``level / 255`` on each of its boxes."""
    buffer = io.BytesIO()
    Image.fromarray(np.full((SIZE, SIZE, 3), level, np.uint8)).save(buffer, format="JPEG")
    return buffer.getvalue()


def detection_envelope(fleet: str, agent: str, boxes: list[list[float]]) -> tuple[str, bytes]:
    image = gray_jpeg(204)
    base = make_header(image, fleet=fleet, agent=agent)
    scores = [b[4] for b in boxes]
    header = SampleHeader(
        **{
            **base.model_dump(),
            "scores": scores,
            "predicted": int(boxes[0][5]) if boxes else 0,
            "confidence": float(np.mean(scores)) if boxes else 1.0,
            "boxes": boxes,
            "route_reason": "mean_score",
        }
    )
    return header.sample_id, encode_envelope(header, image)


def test_the_verdict_carries_the_teachers_boxes_and_names_what_differs(
    make_settings: Callable[..., CloudSettings],
    broker: Any,
    topics: Topics,
    database_url: str,
    collector_factory: Any,
    tmp_path: Path,
) -> None:
    teacher = make_tiny_detector(tmp_path / "teacher.onnx", size=SIZE, boxes=BOXES)
    fleet, agent = "fleet-a", "cam-1"
    collector = collector_factory(broker.url, [topics.verdicts(fleet, agent)], broker.protocol)
    same = [[*BOXES[0][:4], 0.7, 1], [*BOXES[1][:4], 0.6, 2]]
    only_first = [[*BOXES[0][:4], 0.45, 1]]
    with running_worker(
        make_settings, broker, topics, database_url, teacher_model=teacher
    ) as worker:
        assert worker.verdicts.task.name == "detection"
        pub = publisher(broker.url, broker.protocol)
        agreeing, agreeing_env = detection_envelope(fleet, agent, same)
        missing, missing_env = detection_envelope(fleet, agent, only_first)
        for envelope in (agreeing_env, missing_env):
            pub.publish(topics.samples(fleet, agent), envelope, qos=1).wait_for_publish(5)
        assert _wait(lambda: worker.counts["verdicts"] >= 2), dict(worker.counts)
        assert collector.wait_for(
            lambda: (
                sum(
                    len(decode_verdicts(p))
                    for t, p in collector.messages
                    if t.endswith("/verdicts")
                )
                >= 2
            )
        )
        with worker.sessions() as session:
            stored = {s.sample_id: s for s in session.scalars(select(Sample))}
            rows = {v.sample_id: v for v in session.scalars(select(Verdict))}
            assert stored[missing].edge_boxes == [pytest.approx(only_first[0])]
            assert rows[missing].boxes is not None and len(rows[missing].boxes) == 2
        pub.loop_stop()
        pub.disconnect()
    verdicts = {
        v.sample_id: v for v in (v for _, p in collector.messages for v in decode_verdicts(p))
    }
    ok, flagged = verdicts[agreeing], verdicts[missing]
    assert ok.agrees_with_edge and not ok.review
    assert ok.boxes is not None and [b[5] for b in ok.boxes] == [1, 2]
    assert ok.boxes[0][4] == pytest.approx(0.8, abs=0.01)
    assert not flagged.agrees_with_edge and flagged.review
    assert "disagreement" in flagged.review_reasons and "missed" in flagged.review_reasons
