"""A student the gate passed: its checkpoint kept for the next warm start, its INT8 model
registered (lineage: job, snapshot, parent version; the metrics), and delivered to the
fleet: promoted (retained, signed announcement) or rolled out to a canary share.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cloud_service import registry
from cloud_service.jobs.params import JobParams
from cloud_service.jobs.services import PipelineServices, checkpoint_key
from cloud_service.jobs.snapshot import ServingModel
from cloud_service.rollout import create_rollout
from shared.errors import ModelError
from shared.manifest import FleetSigningKey

__all__ = ["Delivery", "Release", "deliver", "flat_metrics", "signing_key", "store_checkpoint"]


@dataclass(frozen=True)
class Release:
    """What is registered: the INT8 file, its version and where it came from."""

    job_id: int
    snapshot_id: int
    artifact: Path
    version: str
    metrics: dict[str, float]
    parent: ServingModel | None


@dataclass(frozen=True)
class Delivery:
    """Log lines for what was registered and how it reached the fleet."""

    registered: str
    delivered: str


def signing_key(services: PipelineServices) -> FleetSigningKey:
    """The key the registry signs with; ModelError when the worker has none."""
    if services.signing_key is None:
        raise ModelError("the worker has no fleet signing key; cannot register")
    return services.signing_key


def store_checkpoint(services: PipelineServices, job_id: int, checkpoint: Path) -> str:
    """Keep the student's checkpoint in the blob store; its key."""
    key = checkpoint_key(job_id)
    services.blobs.put(key, checkpoint.read_bytes())
    return key


def flat_metrics(evaluation: dict[str, dict[str, float]]) -> dict[str, float]:
    """``MODEL_DATASET`` accuracies on the holdout and the reference set (the registry's)."""
    return {
        f"{m}_{d}": float(v)
        for m, by_data in evaluation.items()
        for d, v in by_data.items()
        if d in ("holdout", "reference")
    }


def deliver(services: PipelineServices, p: JobParams, release: Release) -> Delivery:
    """Register the release under the serving model's name (else ``model_name``) and
    deliver it as ``p.delivery`` says, in one transaction."""
    key = signing_key(services)
    parent = release.parent
    with services.sessions() as session, session.begin():
        record = registry.register_model(
            session=session,
            blobs=services.blobs,
            key=key,
            artifact=release.artifact,
            name=parent.name if parent is not None else p.model_name,
            version=release.version,
            format="int8",
            metrics=release.metrics,
            parent_version=None if parent is None else parent.version,
            source=f"distill-job:{release.job_id}/snapshot:{release.snapshot_id}",
        )
        registered = f"registered {record.name} {record.version} (parent {record.parent_version})"
        delivered = "none"
        if p.delivery != "none" and services.announcer is not None and services.topics:
            if p.delivery == "promote":
                registry.promote(
                    session=session,
                    announcer=services.announcer,
                    topics=services.topics,
                    fleet=p.fleet,
                    name=record.name,
                    version=record.version,
                    key=key,
                )
                delivered = "promoted"
            else:
                rollout = create_rollout(
                    session=session,
                    announcer=services.announcer,
                    topics=services.topics,
                    fleet=p.fleet,
                    name=record.name,
                    version=record.version,
                    key=key,
                    percent=p.canary_percent,
                )
                delivered = f"canary rollout {rollout.id}"
    return Delivery(registered, delivered)
