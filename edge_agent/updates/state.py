"""The models an agent keeps on disk, and ``state.json``: the active one, the earlier ones.

On disk (``{data_dir}/models``): ``versions/{name}-{version}.onnx`` (the active one
and the previous ``models_keep - 1``), ``partial/{sha256}.part`` (downloads in
progress) and ``state.json`` (active version, history, and the highest announcement
sequence accepted per topic), so a restart serves the version that was active,
``rollback`` has the previous one at hand, and an announcement replayed after a
restart is still refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.settings import AgentSettings
from shared.errors import ModelError

__all__ = [
    "InstalledModel",
    "ModelState",
    "active_model_path",
    "file_sha256",
    "models_dir",
    "offline_rollback",
    "state_path",
]

log = logging.getLogger(__name__)


@dataclass
class InstalledModel:
    name: str
    version: str
    path: str
    sha256: str | None = None


@dataclass
class ModelState:
    """What ``state.json`` holds: the active model, earlier ones (oldest first), declined."""

    active: InstalledModel | None = None
    history: list[InstalledModel] = field(default_factory=list)
    declined: list[list[str]] = field(default_factory=list)  # [name, version] rolled back from
    # Per topic ("fleet", "agent"): the highest announcement sequence accepted and the
    # sha256 of its signed manifest (the same sequence is accepted again only for it).
    sequences: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> ModelState:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            log.error(
                "model state %s unreadable (%s); starting from the configured model", path, exc
            )
            return cls()
        active = data.get("active")
        return cls(
            active=InstalledModel(**active) if active else None,
            history=[InstalledModel(**h) for h in data.get("history", [])],
            declined=[list(d) for d in data.get("declined", [])],
            sequences={
                str(k): dict(v)
                for k, v in (data.get("sequences") or {}).items()
                if isinstance(v, dict)
            },
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        data = {
            "active": asdict(self.active) if self.active else None,
            "history": [asdict(h) for h in self.history],
            "declined": self.declined[-20:],
            "sequences": self.sequences,
        }
        with tmp.open("w") as handle:
            json.dump(data, handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)


def models_dir(settings: AgentSettings) -> Path:
    """Where this agent keeps its model versions, partial downloads and ``state.json``."""
    return settings.data_dir / "models"


def state_path(settings: AgentSettings) -> Path:
    return models_dir(settings) / "state.json"


def active_model_path(settings: AgentSettings) -> Path:
    """The model to load at start: the last one activated by an update, else the configured."""
    state = ModelState.load(state_path(settings))
    if state.active is not None and Path(state.active.path).is_file():
        return Path(state.active.path)
    return settings.resolved_model_path


def offline_rollback(settings: AgentSettings) -> InstalledModel:
    """Point ``state.json`` at the previous version (for an agent that is not running)."""
    path = state_path(settings)
    state = ModelState.load(path)
    if state.active is None or not state.history:
        raise ModelError("no earlier model version is kept on this agent")
    previous = state.history[-1]
    if not Path(previous.path).is_file():
        raise ModelError(f"the previous version's file {previous.path} is gone")
    state.declined.append([state.active.name, state.active.version])
    state.history, state.active = state.history[:-1], previous
    state.save(path)
    return previous


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes."""
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
