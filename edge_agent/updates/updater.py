"""The model updater: follows the retained announcements, installs, swaps, rolls back.

Announcements are handled on the ``model-updater`` thread, so the MQTT thread never
waits on a download, and inference never waits on a model load. Each step is
published on ``model-status`` (downloaded, verified, active, rejected with
``"<reason>: <detail>"``, rolled-back); a refusal leaves the serving engine as it
was. The package docstring (:mod:`edge_agent.updates`) gives the whole sequence.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from edge_agent.settings import AgentSettings
from edge_agent.updates.artifacts import ArtifactFetcher, Engine, load_and_check
from edge_agent.updates.checks import (
    Scope,
    UpdateRefused,
    announced_names,
    check_compatible,
    check_fresh,
    verify_announcement,
)
from edge_agent.updates.state import (
    InstalledModel,
    ModelState,
    file_sha256,
    models_dir,
    state_path,
)
from shared.errors import EdgeLoopError, ModelError
from shared.lifecycle import Workers
from shared.manifest import ModelManifest
from shared.messages import ModelStatus, encode_message

__all__ = ["ModelUpdater"]

log = logging.getLogger(__name__)


class ModelUpdater:
    """Follows the retained announcements and installs what they name (see module doc)."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        publish: Callable[[str, bytes], None],
        current: Callable[[], Engine],
        swap: Callable[[Any], None],
        engine_factory: Callable[[Path], Any],
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.settings = settings
        self._publish = publish
        self._current = current
        self._swap = swap
        self._engine_factory = engine_factory
        self._clock = clock
        self._wall_clock = wall_clock
        topics = settings.topics
        self.topic_fleet = topics.fleet_models(settings.fleet)
        self.topic_agent = topics.agent_models(settings.fleet, settings.agent_id)
        self.topic_status = topics.model_status(settings.fleet, settings.agent_id)
        self.root = models_dir(settings)
        self.versions_dir = self.root / "versions"
        self.state_path = state_path(settings)
        self.state = ModelState.load(self.state_path)
        self._fleet_raw: bytes | None = None
        self._agent_raw: bytes | None = None
        self._handled: bytes | None = None  # the announcement last acted on
        self._retry_at: float | None = None
        self._refused: set[tuple[str, str, str]] = set()  # (name, version, sha256), for good
        self._lock = threading.Lock()  # announcements in, state
        self._install_lock = threading.Lock()  # one install or rollback at a time
        self._wake = threading.Event()
        self._workers = Workers("model")
        self._fetcher = ArtifactFetcher(
            settings, root=self.root, wait=self._workers.wait, transport=transport
        )
        self.last_result: dict[str, Any] | None = None
        self.installs = 0
        self.refusals = 0

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> ModelUpdater:
        engine = self._current()
        if self.state.active is None:
            # The configured model counts as the first installed one, so a rollback
            # after the first update has somewhere to go.
            self.state.active = InstalledModel(
                name=engine.name,
                version=engine.version,
                path=str(getattr(engine, "path", self.settings.resolved_model_path)),
            )
        elif (engine.name, engine.version) != (self.state.active.name, self.state.active.version):
            log.warning(
                "serving %s %s, but state.json names %s %s; following the engine",
                engine.name,
                engine.version,
                self.state.active.name,
                self.state.active.version,
            )
            self.state.active = InstalledModel(
                name=engine.name,
                version=engine.version,
                path=str(getattr(engine, "path", self.settings.resolved_model_path)),
            )
        self._workers.spawn("updater", self._run)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._workers.stopping.set()
        self._wake.set()
        self._workers.stop(timeout)

    def health(self) -> dict[str, object]:
        """The updater thread's state."""
        return dict(self._workers.health())

    # --- announcements in (MQTT thread: never blocks) --------------------------------

    def handles(self, topic: str) -> bool:
        return topic in (self.topic_fleet, self.topic_agent)

    def on_announcement(self, topic: str, payload: bytes) -> None:
        with self._lock:
            if topic == self.topic_agent:
                self._agent_raw = bytes(payload) or None  # empty: override withdrawn
            elif topic == self.topic_fleet:
                self._fleet_raw = bytes(payload) or None
            else:
                return
        self._wake.set()

    def wanted(self) -> bytes | None:
        return self._wanted()[1]

    def _wanted(self) -> tuple[Scope, bytes | None]:
        with self._lock:
            if self._agent_raw is not None:
                return "agent", self._agent_raw
            return "fleet", self._fleet_raw

    # --- the updater thread ----------------------------------------------------------

    def _run(self) -> None:
        # Linux nice values are per thread: downloads, hashing, session builds and golden
        # runs here yield the cores to inference, which must not slow down during a swap.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.settings.updater_nice)
        while not self._workers.stopping.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            scope, raw = self._wanted()
            if raw is None:
                continue
            waiting = self._retry_at is None or self._clock() < self._retry_at
            if raw == self._handled and waiting:
                continue  # acted on already; a transient failure retries after update_retry_s
            self._retry_at = None
            self._handled = raw
            try:
                self.apply(raw, scope=scope)
            except Exception:  # the updater must survive anything a model throws at it
                log.exception("model update failed unexpectedly")

    def apply(self, raw: bytes, *, scope: Scope | None = None) -> dict[str, Any]:
        """Act on one announcement (blocking); returns what happened.

        ``scope`` is the topic it came on; by default, the agent's own when the
        manifest names an agent, else the fleet's.
        """
        with self._install_lock:
            result = self._apply(raw, scope)
        self.last_result = result
        return result

    def _apply(self, raw: bytes, scope: Scope | None) -> dict[str, Any]:
        name, version = announced_names(raw)
        sha: str | None = None
        try:
            manifest = verify_announcement(self.settings, raw)
            name, version = manifest.name, manifest.version
            active = self.state.active
            current = active is not None and (active.name, active.version) == (name, version)
            try:
                self._check_fresh(manifest, raw, scope or ("agent" if manifest.agent else "fleet"))
            except UpdateRefused as exc:
                # An old or expired announcement of what this agent already serves installs
                # nothing; reporting it as refused would mark the serving version refused.
                if current and exc.reason in ("expired", "stale"):
                    return {"result": "current", "version": version}
                raise
            sha = manifest.sha256
            if current:
                return {"result": "current", "version": version}
            if [name, version] in self.state.declined:
                log.info("%s %s was rolled back here; not installing it again", name, version)
                return {"result": "declined", "version": version}
            if (name, version, manifest.sha256) in self._refused:
                return {"result": "refused-before", "version": version}
            serving = self._current()
            check_compatible(
                self.settings, manifest, serving.input_hw, getattr(serving, "task", None)
            )
            path = self._fetcher.fetch(manifest)
            self._status(name, version, "downloaded")
            engine = load_and_check(
                manifest, path, engine_factory=self._engine_factory, current=self._current
            )
            self._status(name, version, "verified")
            self._activate(manifest, path, engine)
            self._status(name, version, "active")
            self.installs += 1
            return {"result": "active", "version": version}
        except UpdateRefused as exc:
            self.refusals += 1
            if exc.transient:
                self._retry_at = self._clock() + self.settings.update_retry_s
                self._wake.set()
            elif sha is not None:
                # Only signed announcements are remembered as refused: a forged one
                # with the same name must not block the genuine announcement.
                self._refused.add((name, version, sha))
            detail = f"{exc.reason}: {exc.message}"
            log.warning("refused model %s %s: %s", name, version, detail)
            self._status(name or "unknown", version or "unknown", "rejected", detail)
            return {
                "result": "rejected",
                "version": version,
                "reason": exc.reason,
                "detail": detail,
            }

    def _check_fresh(self, manifest: ModelManifest, raw: bytes, scope: Scope) -> None:
        """Refuse a replayed, expired or misdirected announcement; remember the accepted one."""
        seen = self.state.sequences.get(scope) or {}
        record = check_fresh(self.settings, manifest, raw, scope, seen=seen, now=self._wall_clock())
        if record is not None:
            self.state.sequences[scope] = record
            self.state.save(self.state_path)

    # --- activation, rollback, retention ------------------------------------------------

    def _activate(self, manifest: ModelManifest, path: Path, engine: Any) -> None:
        self._swap(engine)  # the next batch runs on it; the batch in flight ends on the old
        previous = self.state.active
        if previous is not None:
            self.state.history = [
                h
                for h in self.state.history
                if (h.name, h.version) != (manifest.name, manifest.version)
            ]
            self.state.history.append(previous)
        self.state.active = InstalledModel(
            name=manifest.name, version=manifest.version, path=str(path), sha256=manifest.sha256
        )
        self.state.declined = [
            d for d in self.state.declined if d != [manifest.name, manifest.version]
        ]
        self._prune()
        self.state.save(self.state_path)
        log.info("model %s %s active", manifest.name, manifest.version)

    def _prune(self) -> None:
        keep = max(0, self.settings.models_keep - 1)
        dropped = self.state.history[:-keep] if keep else list(self.state.history)
        self.state.history = self.state.history[-keep:] if keep else []
        kept = {str(Path(h.path)) for h in self.state.history}
        if self.state.active is not None:
            kept.add(str(Path(self.state.active.path)))
        for old in dropped:
            old_path = Path(old.path)
            # Only files this updater wrote; the configured model is the operator's.
            if old_path.parent == self.versions_dir and str(old_path) not in kept:
                old_path.unlink(missing_ok=True)

    def rollback(self) -> dict[str, Any]:
        """Serve the previous version again; the one rolled back from is not reinstalled."""
        with self._install_lock:
            active = self.state.active
            if active is None or not self.state.history:
                raise ModelError("no earlier model version is kept on this agent")
            previous = self.state.history[-1]
            path = Path(previous.path)
            if not path.is_file():
                raise ModelError(f"the previous version's file {path} is gone")
            if previous.sha256 and file_sha256(path) != previous.sha256:
                raise ModelError(f"the previous version's file {path} no longer matches its sha256")
            engine = self._engine_factory(path)
            self._swap(engine)
            self.state.history = self.state.history[:-1]
            self.state.declined.append([active.name, active.version])
            self.state.active = previous
            self.state.save(self.state_path)
            detail = f"rolled back from {active.version} to {previous.version}"
            self._status(previous.name, previous.version, "rolled-back", detail)
            log.warning("model %s", detail)
            return {"result": "rolled-back", "from": active.version, "version": previous.version}

    def status(self) -> dict[str, Any]:
        return {
            "active": asdict(self.state.active) if self.state.active else None,
            "history": [h.version for h in self.state.history],
            "declined": self.state.declined,
            "last": self.last_result,
            "installs": self.installs,
            "refusals": self.refusals,
        }

    def _status(self, name: str, version: str, state: str, reason: str | None = None) -> None:
        message = ModelStatus(
            fleet=self.settings.fleet,
            agent=self.settings.agent_id,
            model_name=name[:64],
            model_version=version[:64],
            state=state,
            reason=reason[:1024] if reason else None,
            at=datetime.now(UTC),
        )
        try:
            self._publish(self.topic_status, encode_message(message))
        except EdgeLoopError as exc:
            log.warning("could not publish model status: %s", exc)
