"""What a distillation job needs from its surroundings, and the blob keys it uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session

from cloud_service import registry
from cloud_service.announce import Announcer
from cloud_service.blobs import BlobStore
from distill.scenario import ScenarioConfig
from shared.manifest import FleetSigningKey
from shared.topics import Topics

__all__ = ["PipelineServices", "blob_to_file", "checkpoint_key"]


@dataclass
class PipelineServices:
    """What the job needs from its surroundings (the worker process builds these once)."""

    sessions: Callable[[], Session]  # a sessionmaker: ``with services.sessions.begin()``
    blobs: BlobStore
    work_dir: Path
    signing_key: FleetSigningKey | None = None
    announcer: Announcer | None = None
    topics: Topics | None = None
    # Fallbacks when the fleet serves nothing registered yet: the reference models.
    base_checkpoint: Path | None = None
    serving_model: Path | None = None
    teacher_model: Path | None = None
    scenario: ScenarioConfig | None = None  # the reference scenario when None
    console_progress: Callable[[int, str, float], None] | None = None


def blob_to_file(blobs: BlobStore, key: str, path: Path) -> Path:
    """A local file of the blob: the store's own when it has one, else a copy at ``path``."""
    local = registry.artifact_path(blobs, key)
    if local is not None and local.is_file():
        return local
    path.write_bytes(blobs.get(key))
    return path


def checkpoint_key(job_id: int) -> str:
    """Where a job keeps its student's checkpoint (the next round warm-starts from it)."""
    return f"distill/jobs/{job_id}/student.pt"
