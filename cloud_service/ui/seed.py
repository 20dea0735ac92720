"""Made-up fleet data for the review UI: agents, samples with verdicts, a model, a rollout.

For demos, the UI's browser tests and its benchmark (bulk inserts: 100,000 samples
take seconds on PostgreSQL). Images are a few generated PNGs shared by key.

``seed_detection`` adds a detector's fleet: conveyor-belt frames with digits on them,
the edge's and the teacher's boxes differing in every way the review page shows
(missed, extra, wrong class, loose localisation) and agreeing on some frames.
"""

from __future__ import annotations

import io
import random
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

from cloud_service.blobs import BlobStore
from cloud_service.db.models import (
    Agent,
    ModelVersion,
    Rollout,
    RolloutEvent,
    Sample,
    Verdict,
)

__all__ = ["CLASSES", "DETECTION_CLASSES", "DETECTION_FRAMES", "seed", "seed_detection"]

CLASSES = ["person", "bicycle", "car", "dog", "cat", "truck", "bird", "bus"]
REASONS = ["low_confidence", "margin", "entropy", "audit"]
VERSIONS = ["s-1", "s-2"]


def _images(blobs: BlobStore, count: int) -> list[str]:
    from PIL import Image, ImageDraw

    keys = []
    rng = random.Random(7)
    for i in range(count):
        image = Image.new("RGB", (96, 96), tuple(rng.randrange(40, 220) for _ in range(3)))
        draw = ImageDraw.Draw(image)
        for _ in range(6):
            x, y = rng.randrange(0, 80), rng.randrange(0, 80)
            colour = tuple(rng.randrange(0, 255) for _ in range(3))
            draw.ellipse((x, y, x + rng.randrange(8, 40), y + rng.randrange(8, 40)), fill=colour)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        key = f"seed/img-{i:03d}.png"
        blobs.put(key, buffer.getvalue())
        keys.append(key)
    return keys


def _scores(rng: random.Random, top: int, confidence: float) -> list[float]:
    rest = [rng.random() for _ in CLASSES]
    rest[top] = 0.0
    total = sum(rest) or 1.0
    scores = [(1 - confidence) * r / total for r in rest]
    scores[top] = confidence
    return [round(s, 5) for s in scores]


def seed(
    *,
    session: Session,
    blobs: BlobStore,
    samples: int = 200,
    agents: int = 4,
    flagged_share: float = 0.6,
    hours: float = 48.0,
    images: int = 24,
    seed_value: int = 1,
    chunk: int = 5000,
    now: datetime | None = None,
) -> dict[str, Any]:
    """Insert made-up data; returns the counts and the flagged sample ids (newest first)."""
    rng = random.Random(seed_value)
    now = now or datetime.now(UTC)
    keys = _images(blobs, images)
    agent_ids = [f"cam-{i + 1}" for i in range(agents)]
    for i, agent_id in enumerate(agent_ids):
        online = i % 4 != 3
        session.add(
            Agent(
                agent_id=agent_id,
                fleet="fleet-a" if i % 2 == 0 else "fleet-b",
                state="online" if online else "offline",
                last_seen_at=now - timedelta(seconds=5 if online else 3600),
                model_version=VERSIONS[i % 2],
                telemetry={
                    "provider": ["TensorrtExecutionProvider", "CPUExecutionProvider"][i % 2],
                    "frames_per_s": round(25 + 5 * rng.random(), 1),
                    "latency_p50_ms": round(3 + rng.random() * 4, 2),
                    "latency_p99_ms": round(9 + rng.random() * 8, 2),
                    "forward_rate": round(0.02 + 0.08 * rng.random(), 4),
                    "spool_depth": rng.randrange(0, 40),
                },
            )
        )
    for version in VERSIONS:
        session.add(
            ModelVersion(
                name="student",
                version=version,
                format="int8",
                sha256="0" * 64,
                size_bytes=1_200_000,
                artifact_key=f"models/student-{version}.onnx",
                manifest={"labels": CLASSES},
                announcement=b"{}",
                key_id="seed",
                metrics={"accuracy": 0.91 if version == "s-1" else 0.93, "agreement": 0.88},
                parent_version=None if version == "s-1" else "s-1",
                source="seed" if version == "s-1" else "distill job 1",
                state="serving" if version == "s-1" else "registered",
            )
        )
    session.flush()
    run = Rollout(
        fleet="fleet-a",
        model_name="student",
        version="s-2",
        baseline_version="s-1",
        cohort=agent_ids[:1],
        percent=25.0,
        criteria={"min_samples": 50},
        state="running",
        started_at=now - timedelta(hours=2),
        window_ends_at=now + timedelta(hours=22),
    )
    session.add(run)
    session.flush()
    session.add(RolloutEvent(rollout_id=run.id, at=run.started_at, kind="created", detail={}))
    sample_rows: list[dict[str, Any]] = []
    verdict_rows: list[dict[str, Any]] = []
    flagged: list[tuple[datetime, str]] = []
    span = hours * 3600.0
    for i in range(samples):
        captured = now - timedelta(seconds=span * (i + 0.5) / samples)
        sample_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        edge = rng.randrange(len(CLASSES))
        edge_conf = round(0.2 + 0.6 * rng.random(), 4)
        version = VERSIONS[(i // 3) % 2]
        teacher = edge if rng.random() < 0.7 else rng.randrange(len(CLASSES))
        teacher_conf = round(0.4 + 0.6 * rng.random(), 4)
        status = "flagged" if rng.random() < flagged_share else "verified"
        agent_index = i % agents
        sample_rows.append(
            {
                "sample_id": sample_id,
                "fleet": "fleet-a" if agent_index % 2 == 0 else "fleet-b",
                "agent_id": agent_ids[agent_index],
                "captured_at": captured,
                "received_at": captured + timedelta(milliseconds=40),
                "model_name": "student",
                "model_version": version,
                "edge_scores": _scores(rng, edge, edge_conf),
                "edge_predicted": edge,
                "edge_confidence": edge_conf,
                "route_reason": REASONS[i % len(REASONS)],
                "priority": 5,
                "image_key": keys[i % len(keys)],
                "image_format": "png",
                "image_width": 96,
                "image_height": 96,
                "image_bytes": 1000,
                "meta": {},
                "status": status,
                "verified_at": captured + timedelta(milliseconds=120),
            }
        )
        verdict_rows.append(
            {
                "sample_id": sample_id,
                "teacher_model": "teacher",
                "teacher_version": "t-1",
                "scores": _scores(rng, teacher, teacher_conf),
                "label": teacher,
                "confidence": teacher_conf,
                "agrees_with_edge": teacher == edge,
                "review": status == "flagged",
                "review_reasons": ["disagreement"] if teacher != edge else ["teacher_unsure"],
                "verified_at": captured + timedelta(milliseconds=120),
                "latency_s": round(0.05 + 0.1 * rng.random(), 4),
            }
        )
        if status == "flagged":
            flagged.append((captured, sample_id))
        if len(sample_rows) >= chunk:
            _flush(session, sample_rows, verdict_rows)
    _flush(session, sample_rows, verdict_rows)
    flagged.sort(reverse=True)
    return {
        "samples": samples,
        "flagged": [sample_id for _, sample_id in flagged],
        "agents": agent_ids,
        "rollout_id": run.id,
    }


def _flush(session: Session, samples: list[dict[str, Any]], verdicts: list[dict[str, Any]]) -> None:
    if samples:
        session.execute(insert(Sample), samples)
        session.execute(insert(Verdict), verdicts)
    samples.clear()
    verdicts.clear()


# --- detection ----------------------------------------------------------------------

DETECTION_CLASSES = [str(d) for d in range(10)]  # the conveyor belt's digits
DetBox = tuple[float, float, float, float, float, int]

# Per frame: (the teacher's boxes, the edge's boxes), x1, y1, x2, y2, score, class; each
# list is sorted by score, as answers are. The first frame differs in every way.
DETECTION_FRAMES: list[tuple[list[DetBox], list[DetBox]]] = [
    (
        [
            (0.10, 0.10, 0.30, 0.35, 0.97, 3),
            (0.50, 0.15, 0.70, 0.40, 0.93, 7),
            (0.20, 0.60, 0.40, 0.85, 0.90, 1),
            (0.65, 0.60, 0.85, 0.88, 0.86, 5),
        ],
        [
            (0.11, 0.11, 0.31, 0.35, 0.81, 3),  # matched
            (0.50, 0.16, 0.69, 0.41, 0.62, 2),  # wrong class (teacher: 7)
            (0.28, 0.66, 0.50, 0.92, 0.48, 1),  # loose: a localisation error
            (0.80, 0.04, 0.95, 0.20, 0.41, 9),  # extra; the teacher's 5 is missed
        ],
    ),
    (
        [(0.15, 0.20, 0.35, 0.50, 0.95, 4), (0.60, 0.40, 0.82, 0.72, 0.88, 8)],
        [(0.16, 0.20, 0.35, 0.49, 0.45, 4), (0.60, 0.41, 0.81, 0.72, 0.40, 8)],
    ),
    ([(0.40, 0.30, 0.62, 0.62, 0.91, 6)], []),
    ([], [(0.30, 0.30, 0.50, 0.55, 0.44, 0), (0.70, 0.10, 0.88, 0.35, 0.38, 2)]),
    (
        [(0.05, 0.55, 0.25, 0.85, 0.96, 9), (0.45, 0.05, 0.65, 0.35, 0.92, 0)],
        [(0.05, 0.55, 0.25, 0.85, 0.70, 7), (0.45, 0.05, 0.65, 0.35, 0.66, 0)],
    ),
]


def _belt(boxes: list[DetBox], size: int, rng: random.Random) -> bytes:
    """A belt seen from above with the digits the teacher boxed drawn in their boxes."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (size, size), (96, 100, 104))
    draw = ImageDraw.Draw(image)
    for y in range(0, size, 16):  # the belt's ribs
        draw.line((0, y, size, y), fill=(86, 90, 94), width=3)
    for _ in range(3):  # clutter that is not an object
        x, y = rng.randrange(0, size - 30), rng.randrange(0, size - 30)
        draw.ellipse((x, y, x + 14, y + 14), fill=(150, 140, 120))
    for x1, y1, x2, y2, _, cls in boxes:
        box = (x1 * size, y1 * size, x2 * size, y2 * size)
        draw.rectangle(box, fill=(226, 222, 210))
        font = ImageFont.load_default(size=int((y2 - y1) * size * 0.8))
        centre = ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)
        draw.text(centre, str(cls), fill=(30, 30, 40), font=font, anchor="mm")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def seed_detection(
    *,
    session: Session,
    blobs: BlobStore,
    fleet: str = "fleet-d",
    agent_id: str = "belt-1",
    size: int = 320,
    now: datetime | None = None,
    seed_value: int = 3,
) -> dict[str, Any]:
    """Insert a detector (its manifest names the digits), one agent and a flagged
    sample per ``DETECTION_FRAMES`` entry; returns their ids, newest first."""
    from shared.tasks.detection import match

    rng = random.Random(seed_value)
    now = now or datetime.now(UTC)
    session.add(
        Agent(
            agent_id=agent_id,
            fleet=fleet,
            state="online",
            last_seen_at=now - timedelta(seconds=5),
            model_version="d-1",
            telemetry={},
        )
    )
    session.add(
        ModelVersion(
            name="detector",
            version="d-1",
            format="int8",
            sha256="1" * 64,
            size_bytes=900_000,
            artifact_key="models/detector-d-1.onnx",
            manifest={"labels": DETECTION_CLASSES, "task": "detection"},
            announcement=b"{}",
            key_id="seed",
            metrics={"map50": 0.71},
            source="seed",
            state="serving",
        )
    )
    samples: list[dict[str, Any]] = []
    verdicts: list[dict[str, Any]] = []
    ids: list[str] = []
    for i, (teacher, edge) in enumerate(DETECTION_FRAMES):
        sample_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        captured = now - timedelta(minutes=10 * (i + 1))
        key = f"seed/belt-{seed_value}-{i:03d}.png"
        image = _belt(teacher, size, rng)
        blobs.put(key, image)
        differences = match(edge, teacher).differences
        samples.append(
            {
                "sample_id": sample_id,
                "fleet": fleet,
                "agent_id": agent_id,
                "captured_at": captured,
                "received_at": captured + timedelta(milliseconds=40),
                "model_name": "detector",
                "model_version": "d-1",
                "edge_scores": [b[4] for b in edge],
                "edge_predicted": edge[0][5] if edge else 0,
                "edge_confidence": _mean_score(edge),
                "edge_boxes": [list(b) for b in edge],
                "route_reason": "mean_score",
                "priority": 5,
                "image_key": key,
                "image_format": "png",
                "image_width": size,
                "image_height": size,
                "image_bytes": len(image),
                "meta": {},
                "status": "flagged",
                "verified_at": captured + timedelta(milliseconds=150),
            }
        )
        verdicts.append(
            {
                "sample_id": sample_id,
                "teacher_model": "teacher-detector",
                "teacher_version": "t-1",
                "scores": [b[4] for b in teacher],
                "label": teacher[0][5] if teacher else 0,
                "confidence": _mean_score(teacher),
                "boxes": [list(b) for b in teacher],
                "agrees_with_edge": not differences,
                "review": True,
                "review_reasons": ["disagreement", *differences] if differences else ["audit"],
                "verified_at": captured + timedelta(milliseconds=150),
                "latency_s": 0.08,
            }
        )
        ids.append(sample_id)
    _flush(session, samples, verdicts)
    return {"detection": ids, "agent": agent_id, "fleet": fleet}


def _mean_score(boxes: list[DetBox]) -> float:
    return round(sum(b[4] for b in boxes) / len(boxes), 4) if boxes else 1.0
