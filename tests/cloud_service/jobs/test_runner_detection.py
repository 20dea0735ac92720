"""A distillation job for a fleet of detectors, end to end with the quick detector pair:
teacher boxes and reviewers' boxes in, a gated INT8 detector registered and announced."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from cloud_service.announce import MemoryAnnouncer
from cloud_service.blobs import LocalBlobStore
from cloud_service.db.models import FleetModel, Label, ModelVersion, Sample, Verdict
from cloud_service.db.session import make_engine, make_session_factory, upgrade_database
from cloud_service.jobs import queue as jobs
from cloud_service.jobs.detection import detection_rows
from cloud_service.jobs.runner import PipelineServices
from cloud_service.jobs.tables import DatasetSnapshot
from distill.detector_cache import ReferenceDetectors, reference_scenario
from distill.detector_eval import OnnxDetector
from distill.scene_drift import apply_scene_drift
from distill.scenes import render_scenes
from shared.ids import SampleIdGenerator
from shared.manifest import FleetSigningKey
from shared.messages import ModelAnnouncement, decode_message
from shared.tasks import DETECTION
from shared.topics import Topics
from tests.cloud_service.jobs.conftest import png_bytes, run_one_job, serve_model

FLEET = "belt-1"
NAME = "belt-detector"


def seed_detections(
    sessions: sessionmaker[Session],
    blobs: LocalBlobStore,
    frames: np.ndarray,
    teacher_rows: np.ndarray,
    truth: list[list[list[float]]],
    reviewed: set[int],
) -> list[str]:
    """Frames as verified detection samples with the teacher's boxes, oldest first; the
    frames in ``reviewed`` also carry a reviewer's boxes (the ground truth)."""
    base = datetime.now(UTC) - timedelta(hours=1)
    new_id = SampleIdGenerator(
        clock_ns=lambda: int(base.timestamp() * 1e9), randbits=random.Random(5).getrandbits
    )
    answers = DETECTION.answers(teacher_rows)
    ids = []
    with sessions.begin() as s:
        for i, frame in enumerate(frames):
            sid, at, data = new_id(), base + timedelta(seconds=i), png_bytes(frame)
            key = f"samples/{FLEET}/cam/{sid}.png"
            blobs.put(key, data)
            s.add(
                Sample(
                    sample_id=sid,
                    fleet=FLEET,
                    agent_id="cam",
                    captured_at=at,
                    received_at=at,
                    model_name=NAME,
                    model_version="ref",
                    edge_scores=[],
                    edge_predicted=0,
                    edge_confidence=1.0,
                    edge_boxes=[],
                    route_reason="empty_audit",
                    image_key=key,
                    image_format="png",
                    image_width=frame.shape[1],
                    image_height=frame.shape[0],
                    image_bytes=len(data),
                    status="reviewed" if i in reviewed else "verified",
                    verified_at=at,
                )
            )
            fields = DETECTION.verdict_fields(answers[i])
            s.add(
                Verdict(
                    sample_id=sid,
                    teacher_model="teacher",
                    teacher_version="ref",
                    scores=fields["scores"],
                    label=fields["label"],
                    confidence=fields["confidence"],
                    boxes=fields["boxes"],
                    agrees_with_edge=not answers[i].boxes,
                    verified_at=at,
                )
            )
            ids.append(sid)
        s.flush()  # the samples before the labels that name them
        for i in sorted(reviewed):
            label = int(truth[i][0][5]) if truth[i] else 0
            s.add(Label(sample_id=ids[i], label=label, boxes=truth[i], labeled_by="reviewer"))
    return ids


@pytest.fixture
def setup(tmp_path: Path, quick_detectors: ReferenceDetectors) -> Iterator[dict[str, Any]]:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade_database(url)
    engine = make_engine(url)
    sessions = make_session_factory(engine)
    blobs = LocalBlobStore(tmp_path / "blobs", fsync=False)
    key, announcer = FleetSigningKey.generate(), MemoryAnnouncer()
    topics = Topics(prefix="edgeloop-test/detection-job/v1")
    serve_model(
        sessions,
        artifact=quick_detectors.student_int8_onnx,
        name=NAME,
        fleet=FLEET,
        blobs=blobs,
        key=key,
        announcer=announcer,
        topics=topics,
    )
    # The quick stream on a new belt (background drift), boxed by the teacher; every
    # fourth frame reviewed.
    scenario = reference_scenario(quick_detectors.frame_size)
    live = apply_scene_drift(render_scenes("stream", scenario), "background:1", seed=3)
    teacher_rows = OnnxDetector(quick_detectors.teacher_onnx, threads=2).detections(live.frames)
    size = float(scenario.frame_size)
    truth = [
        [[*(float(v) / size for v in box), 1.0, int(c)] for box, c in zip(b, cls, strict=True)]
        for b, cls in zip(live.boxes, live.classes, strict=True)
    ]
    ids = seed_detections(
        sessions, blobs, live.frames, teacher_rows, truth, set(range(0, len(live), 4))
    )
    services = PipelineServices(
        sessions=sessions,
        blobs=blobs,
        work_dir=tmp_path,
        signing_key=key,
        announcer=announcer,
        topics=topics,
        base_checkpoint=quick_detectors.student_pt,
    )
    yield {
        "sessions": sessions,
        "services": services,
        "announcer": announcer,
        "ids": ids,
        "classes": tuple(quick_detectors.class_names),
    }
    engine.dispose()


PARAMS: dict[str, Any] = {
    "fleet": FLEET,
    "threads": 2,
    "quick": True,
    "min_samples": 20,
    "drift_eval": "background:1",
    "drift_eval_frames": 40,
}
# Gate bounds any model meets: this test is about the path, tests/distill the gate.
OPEN_GATE = {"min_gain": -1.0, "max_reference_drop": 1.0, "int8_tolerance": 1.0}


def test_the_snapshot_reads_teacher_boxes_and_the_newest_reviewers_boxes(
    setup: dict[str, Any],
) -> None:
    with setup["sessions"]() as s:
        rows = detection_rows(s, FLEET, 1000)
    assert len(rows) == len(setup["ids"])
    assert rows[0].sample_id == setup["ids"][-1]  # newest first
    reviewed = {r.sample_id for r in rows if r.human is not None}
    assert reviewed == set(setup["ids"][::4])
    assert all(len(box) == 6 for r in rows for box in r.teacher)


def test_a_detection_job_trains_gates_registers_and_announces_a_detector(
    setup: dict[str, Any],
) -> None:
    sessions = setup["sessions"]
    job_id = run_one_job(setup, {**PARAMS, **OPEN_GATE})
    with sessions() as s:
        job = jobs.get_job(session=s, job_id=job_id)
        assert job.state == "succeeded", job.error
        m = job.metrics
        assert m["task"] == "detection" and m["gate"]["metric"] == "map50", m["gate"]
        ev = m["evaluation"]
        assert set(ev) == {"new_fp32", "new_int8", "serving"}
        assert set(ev["new_int8"]) == {"holdout", "reference", "drift:background:1"}
        assert m["sizes"]["reference"] == 40
        assert m["dataset"]["human_labels"] == len(setup["ids"][::4])
        assert "the reference scenario" in m["reference"]["source"]
        version = job.result_version
        record = s.scalars(select(ModelVersion).where(ModelVersion.version == version)).one()
        assert record.name == NAME and record.parent_version == "ref"
        assert record.format == "int8" and record.source.startswith(f"distill-job:{job_id}/")
        snap = s.get(DatasetSnapshot, job.snapshot_id)
        assert snap is not None and snap.holdout_ids and snap.train_ids
        assert not set(snap.holdout_ids) & set(snap.train_ids)
        assert set(snap.holdout_ids) | set(snap.train_ids) == set(setup["ids"])
        fleet = s.get(FleetModel, FLEET)
        assert fleet is not None and fleet.version == version
        assert setup["services"].blobs.exists(m["checkpoint_key"])
    topic = Topics(prefix="edgeloop-test/detection-job/v1").fleet_models(FLEET)
    raw = setup["announcer"].retained[topic]  # a 160 px golden frame: as agents take it
    announced = decode_message(raw, ModelAnnouncement, max_bytes=1 << 20).manifest
    assert announced.version == version and announced.task == "detection"
    assert announced.output_name == "detections"
    assert tuple(announced.labels) == setup["classes"]


def test_the_detector_gate_refuses_and_nothing_is_registered(setup: dict[str, Any]) -> None:
    sessions = setup["sessions"]
    job_id = run_one_job(setup, {**PARAMS, "min_gain": 0.9, "drift_eval": ""})
    with sessions() as s:
        job = jobs.get_job(session=s, job_id=job_id)
        assert job.state == "succeeded", job.error
        assert job.result_version is None
        assert not job.metrics["gate"]["passed"]
        assert any("no better on recent data" in r for r in job.metrics["gate"]["reasons"])
        versions = s.scalars(select(ModelVersion.version)).all()
        assert versions == ["ref"]


def test_a_users_coco_folder_is_the_jobs_replay_and_reference(
    setup: dict[str, Any], tmp_path: Path
) -> None:
    from distill.detection_formats import write_coco

    scenes = render_scenes("validation", reference_scenario(160)).subset(np.arange(30))
    write_coco(scenes, tmp_path / "belt-labels")
    params = {**PARAMS, **OPEN_GATE, "data_dir": str(tmp_path / "belt-labels"), "delivery": "none"}
    job_id = run_one_job(setup, params)
    with setup["sessions"]() as s:
        job = jobs.get_job(session=s, job_id=job_id)
        assert job.state == "succeeded", job.error
        m = job.metrics
    assert m["reference"]["source"] == f"data_dir {tmp_path / 'belt-labels'}"
    assert m["sizes"]["reference"] == 9  # 30% of the folder's 30 frames; the rest replays
    assert set(m["evaluation"]["new_int8"]) == {"holdout", "reference", "drift:background:1"}
