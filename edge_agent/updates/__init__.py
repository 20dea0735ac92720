"""Model updates on the agent: verify, download, check, load in the background, swap.

    updater = ModelUpdater(settings, publish=link.publish, current=lambda: agent.engine,
                           swap=agent.swap_engine, engine_factory=build)
    updater.start(); updater.on_announcement(topic, payload)  # from the MQTT link

The agent follows one retained announcement: its own (``{fleet}/{agent}/models``,
canaries and pins) when there is one, else the fleet's (``{fleet}/models``); an
empty retained message on its own topic withdraws the override. Announcements are
handled on the ``model-updater`` thread, so the MQTT thread never waits on a
download, and inference never waits on a model load.

An update is installed only when every check passes, in this order: the signature
over the manifest as received (the fleet key the agent was enrolled with), the
compatibility of the manifest (opset, runtime version, input spec), the artifact's
size and sha256 (download resumed with HTTP Range after a break), the model loading
in ONNX Runtime with the same input size as the serving one, and the golden inputs
reproducing their outputs within the manifest's tolerance. Before any of it, the
announcement must be fresh: its signed ``sequence`` above the highest this agent
accepted on that topic (fleet or own; the same sequence only for the same bytes),
its ``expires_at`` not past, and its ``fleet``/``agent`` this agent and topic. An
announcement without a sequence (a cloud older than this agent) is refused in
production and accepted with a warning in development. A stale one is refused with
``stale``/``expired``/``wrong_audience``/``unsequenced`` and never remembered as
refused, so a newer announcement of the same version still installs. Then the batcher swaps
engines between two batches. Each step is published on ``model-status``
(downloaded, verified, active, rejected with ``"<reason>: <detail>"``, rolled-back);
a refusal leaves the serving engine as it was.

The parts: :mod:`~edge_agent.updates.checks` (signature, freshness, compatibility),
:mod:`~edge_agent.updates.artifacts` (download, size and hash, load, golden inputs;
the API token's origin rule), :mod:`~edge_agent.updates.state` (the models on disk
and ``state.json``) and :mod:`~edge_agent.updates.updater` (the thread, activation,
rollback).
"""

from __future__ import annotations

from edge_agent.updates.artifacts import token_for
from edge_agent.updates.checks import Scope, UpdateRefused
from edge_agent.updates.state import (
    InstalledModel,
    ModelState,
    active_model_path,
    offline_rollback,
)
from edge_agent.updates.updater import ModelUpdater
from shared.onnx_support import max_supported_opset, runtime_version

__all__ = [
    "InstalledModel",
    "ModelState",
    "ModelUpdater",
    "Scope",
    "UpdateRefused",
    "active_model_path",
    "max_supported_opset",
    "offline_rollback",
    "runtime_version",
    "token_for",
]
