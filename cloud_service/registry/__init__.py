"""The model registry: immutable signed versions, what each fleet serves, pins, retention.

    version = register_model(session=s, blobs=b, key=k, artifact=Path("student.onnx"))
    promote(session=s, announcer=a, topics=t, fleet="default", name=..., version=...)

A version is registered once and never changes: its artifact sits in the blob store
under a content-addressed key (``models/{name}/{sha256}.onnx``), and its manifest is
signed with the fleet key at registration (the stored announcement proves the key
accepted it; re-encoding a decoded announcement may not verify).

Serving state: ``fleet_models`` says which version a fleet's retained announcement
names (and the versions before it, for rollback); ``agent_overrides`` holds the
per-agent retained announcements of canary cohorts and pins. Every change here is
also published (retained, QoS 1) through the ``Announcer``; an override withdrawn is
a zero-length retained message, and the agent falls back to the fleet announcement.

What is published is signed afresh for each announcement: the version's manifest
plus its freshness (``sequence``, ``expires_at``, and the fleet and agent it is for),
so an old announcement replayed on the topic is refused by agents (they keep the
highest sequence they accepted). The sequence is ``max(last + 1, now in ms)`` from a
per-fleet row updated atomically (``announcement_sequences``): strictly increasing
across API restarts and replicas (the row update serializes them, and ``last + 1``
wins over a replica whose clock is behind), and still above what agents hold when
the database is restored from a backup or recreated (the wall clock carries it on).

Retention keeps the newest ``keep`` versions of a model plus every version a fleet
serves, an agent is pinned to, or a running rollout uses; the others lose their
artifact (state "deleted"; the row and its lineage stay).

Modules: ``inspection`` (reading an ONNX student, its manifest), ``refusals`` (agents
that would refuse a version), ``versions`` (register, look up, retention),
``announcements`` (promote, rollback, pins, signed announcements), ``installs``
(per-agent install state).
"""

from __future__ import annotations

from cloud_service.registry.announcements import (
    DEFAULT_ANNOUNCEMENT_TTL,
    clear_overrides,
    next_sequence,
    pin,
    promote,
    refresh_announcements,
    rollback,
    serving,
    set_overrides,
    signed_announcement,
    unpin,
)
from cloud_service.registry.inspection import build_manifest, inspect_onnx, min_runtime_for_opset
from cloud_service.registry.installs import AgentInstall, InstallSummary, install_summary
from cloud_service.registry.refusals import AgentRefusal, agent_refusals
from cloud_service.registry.versions import (
    apply_retention,
    artifact_key,
    artifact_path,
    get_version,
    list_versions,
    register_model,
)
from shared.manifest import ModelManifest as ModelManifest

__all__ = [
    "DEFAULT_ANNOUNCEMENT_TTL",
    "AgentInstall",
    "AgentRefusal",
    "InstallSummary",
    "agent_refusals",
    "apply_retention",
    "artifact_key",
    "artifact_path",
    "build_manifest",
    "clear_overrides",
    "get_version",
    "inspect_onnx",
    "install_summary",
    "list_versions",
    "min_runtime_for_opset",
    "next_sequence",
    "pin",
    "promote",
    "refresh_announcements",
    "register_model",
    "rollback",
    "serving",
    "set_overrides",
    "signed_announcement",
    "unpin",
]
