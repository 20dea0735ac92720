"""Made-up fleet data for the review UI: agents, samples with verdicts, a model, a rollout.

For demos, the UI's browser tests and its benchmark (bulk inserts: 100,000 samples
take seconds on PostgreSQL). Images are a few generated PNGs shared by key.
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

__all__ = ["CLASSES", "seed"]

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
