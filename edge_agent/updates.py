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

On disk (``{data_dir}/models``): ``versions/{name}-{version}.onnx`` (the active one
and the previous ``models_keep - 1``), ``partial/{sha256}.part`` (downloads in
progress) and ``state.json`` (active version, history, and the highest announcement sequence
accepted per topic), so a restart serves the version that was active, ``rollback``
has the previous one at hand, and an announcement replayed after a restart is
still refused.

The agent's API token goes only to the cloud it enrolled with (the scheme, host and
port of ``cloud_url``) and only over https (http only for a loopback cloud in
development); an artifact named on another origin is fetched without it, which is
safe because the signed manifest fixes its size and sha256.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import httpx
import numpy as np

from edge_agent.settings import AgentSettings
from shared.errors import EdgeLoopError, MessageError, ModelError, SignatureError
from shared.manifest import (
    ModelManifest,
    agent_refusal,
    verify_manifest_bytes,
    version_tuple,
)
from shared.messages import ModelAnnouncement, ModelStatus, decode_message, encode_message

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

log = logging.getLogger(__name__)

# Highest ai.onnx opset each onnxruntime release runs (its compatibility table);
# releases newer than the table run at least the last entry.
_RUNTIME_OPSET = [
    ((1, 13), 17),
    ((1, 14), 18),
    ((1, 16), 19),
    ((1, 17), 20),
    ((1, 18), 21),
    ((1, 20), 22),
    ((1, 22), 23),
]
_CHUNK = 1 << 16
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
Scope = Literal["fleet", "agent"]


def runtime_version() -> str:
    import onnxruntime

    return str(onnxruntime.__version__)


def max_supported_opset(version: str | None = None) -> int:
    """The highest ai.onnx opset the installed (or given) onnxruntime runs."""
    have = version_tuple(version or runtime_version())[:2]
    supported = 0
    for release, opset in _RUNTIME_OPSET:
        if have >= release:
            supported = opset
    return supported


class UpdateRefused(EdgeLoopError):
    """An update failed a check; ``reason`` is the slug published on model-status."""

    def __init__(self, reason: str, message: str, *, transient: bool = False) -> None:
        super().__init__(message, reason=reason)
        self.transient = transient


class Engine(Protocol):
    name: str
    version: str
    input_hw: tuple[int, int]

    def run(self, frames: np.ndarray) -> np.ndarray: ...


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


def _models_dir(settings: AgentSettings) -> Path:
    return settings.data_dir / "models"


def _state_path(settings: AgentSettings) -> Path:
    return _models_dir(settings) / "state.json"


def active_model_path(settings: AgentSettings) -> Path:
    """The model to load at start: the last one activated by an update, else the configured."""
    state = ModelState.load(_state_path(settings))
    if state.active is not None and Path(state.active.path).is_file():
        return Path(state.active.path)
    return settings.resolved_model_path


def offline_rollback(settings: AgentSettings) -> InstalledModel:
    """Point ``state.json`` at the previous version (for an agent that is not running)."""
    path = _state_path(settings)
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


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


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
        self._transport = transport
        self._clock = clock
        self._wall_clock = wall_clock
        topics = settings.topics
        self.topic_fleet = topics.fleet_models(settings.fleet)
        self.topic_agent = topics.agent_models(settings.fleet, settings.agent_id)
        self.topic_status = topics.model_status(settings.fleet, settings.agent_id)
        self.root = _models_dir(settings)
        self.versions_dir = self.root / "versions"
        self.partial_dir = self.root / "partial"
        self.state_path = _state_path(settings)
        self.state = ModelState.load(self.state_path)
        self._fleet_raw: bytes | None = None
        self._agent_raw: bytes | None = None
        self._handled: bytes | None = None  # the announcement last acted on
        self._retry_at: float | None = None
        self._refused: set[tuple[str, str, str]] = set()  # (name, version, sha256), for good
        self._lock = threading.Lock()  # announcements in, state
        self._install_lock = threading.Lock()  # one install or rollback at a time
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
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
        self._thread = threading.Thread(target=self._run, name="model-updater", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

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
        while not self._stopping.is_set():
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
        name, version = _names(raw)
        sha: str | None = None
        try:
            manifest = self._verify(raw)
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
            self._check_compatible(manifest)
            path = self._fetch(manifest)
            self._status(name, version, "downloaded")
            engine = self._load_and_check(manifest, path)
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

    # --- the checks ----------------------------------------------------------------------

    def _verify(self, raw: bytes) -> ModelManifest:
        key = self.settings.fleet_public_key
        if not key:
            raise UpdateRefused("no_fleet_key", "this agent has no fleet public key (enroll it)")
        try:
            return verify_manifest_bytes(raw, key, max_bytes=self.settings.max_announcement_bytes)
        except SignatureError as exc:
            raise UpdateRefused("bad_signature", exc.message) from exc
        except MessageError as exc:
            raise UpdateRefused("malformed", exc.message) from exc
        except EdgeLoopError as exc:  # a malformed fleet key is our configuration
            raise UpdateRefused("no_fleet_key", exc.message) from exc

    def _check_fresh(self, manifest: ModelManifest, raw: bytes, scope: Scope) -> None:
        """Refuse a replayed, expired or misdirected announcement; remember the accepted one."""
        settings = self.settings
        if manifest.fleet is not None and manifest.fleet != settings.fleet:
            raise UpdateRefused(
                "wrong_audience",
                f"announcement is for fleet {manifest.fleet}, this agent is in {settings.fleet}",
            )
        if scope == "agent" and manifest.agent is not None and manifest.agent != settings.agent_id:
            raise UpdateRefused(
                "wrong_audience", f"announcement is for agent {manifest.agent}, not this agent"
            )
        if scope == "agent" and manifest.agent is None and manifest.sequence is not None:
            raise UpdateRefused(
                "wrong_audience", "a fleet announcement came on this agent's own topic"
            )
        if scope == "fleet" and manifest.agent is not None:
            raise UpdateRefused(
                "wrong_audience",
                f"a per-agent announcement (for {manifest.agent}) came on the fleet topic",
            )
        if manifest.expires_at is not None and manifest.expires_at <= self._wall_clock():
            raise UpdateRefused(
                "expired", f"announcement expired at {manifest.expires_at.isoformat()}"
            )
        if manifest.sequence is None:
            if settings.env == "production":
                raise UpdateRefused(
                    "unsequenced",
                    "announcement has no sequence (a cloud older than this agent);"
                    " upgrade the cloud",
                )
            log.warning(
                "announcement of %s %s has no sequence (an older cloud): accepted in development",
                manifest.name,
                manifest.version,
            )
            return
        digest = hashlib.sha256(_signed_part(raw)).hexdigest()
        seen = self.state.sequences.get(scope) or {}
        highest = seen.get("sequence")
        if isinstance(highest, int):
            if manifest.sequence < highest or (
                manifest.sequence == highest and seen.get("digest") != digest
            ):
                raise UpdateRefused(
                    "stale",
                    f"announcement sequence {manifest.sequence} is not newer than"
                    f" {highest}, the highest accepted on the {scope} topic (a replay?)",
                )
            if manifest.sequence == highest:
                return  # the same announcement again (a broker redelivery)
        self.state.sequences[scope] = {"sequence": manifest.sequence, "digest": digest}
        self.state.save(self.state_path)

    def _check_compatible(self, manifest: ModelManifest) -> None:
        # The same check the registry runs on this agent's heartbeat before it announces.
        refusal = agent_refusal(
            manifest,
            input_hw=self._current().input_hw,
            max_opset=self.settings.max_model_opset or max_supported_opset(),
            runtime_version=runtime_version(),
        )
        if refusal is not None:
            raise UpdateRefused(*refusal)

    def _artifact_url(self, manifest: ModelManifest) -> str:
        if manifest.url.startswith(("http://", "https://")):
            return manifest.url
        if not self.settings.cloud_url:
            raise UpdateRefused(
                "no_cloud_url", "the announcement's URL is relative and cloud_url is unset"
            )
        return self.settings.cloud_url.rstrip("/") + manifest.url

    def _fetch(self, manifest: ModelManifest) -> Path:
        """The verified artifact on disk: kept from before, or downloaded (resumed) now."""
        target = self.versions_dir / f"{manifest.name}-{manifest.version}.onnx"
        if target.is_file() and _sha256(target) == manifest.sha256:
            return target
        part = self.partial_dir / f"{manifest.sha256}.part"
        try:
            self.partial_dir.mkdir(parents=True, exist_ok=True)
            self._download(manifest, part)
            size = part.stat().st_size
            if size != manifest.size_bytes:
                part.unlink(missing_ok=True)
                raise UpdateRefused(
                    "size_mismatch",
                    f"artifact has {size} bytes, the manifest says {manifest.size_bytes}",
                )
            digest = _sha256(part)
            if digest != manifest.sha256:
                part.unlink(missing_ok=True)
                raise UpdateRefused(
                    "hash_mismatch",
                    f"artifact sha256 is {digest[:16]}..., the manifest"
                    f" says {manifest.sha256[:16]}...",
                )
            self.versions_dir.mkdir(parents=True, exist_ok=True)
            os.replace(part, target)
        except OSError as exc:
            part.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise UpdateRefused(
                    "disk_full",
                    f"no space left under {self.root} for {manifest.size_bytes} bytes",
                    transient=True,
                ) from exc
            raise UpdateRefused(
                "io_error", f"cannot store the artifact: {exc}", transient=True
            ) from exc
        return target

    def _write(self, handle: Any, chunk: bytes) -> None:
        handle.write(chunk)  # a seam: tests make it fail with ENOSPC

    def _download(self, manifest: ModelManifest, part: Path) -> None:
        url = self._artifact_url(manifest)
        token = token_for(self.settings, url)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        size = manifest.size_bytes
        stalled = 0
        with httpx.Client(
            transport=self._transport, timeout=self.settings.download_timeout_s
        ) as client:
            for _attempt in range(self.settings.download_attempts):
                have = part.stat().st_size if part.exists() else 0
                if have > size:
                    part.unlink()
                    have = 0
                if have == size:
                    return
                request_headers = dict(headers)
                if have:
                    request_headers["Range"] = f"bytes={have}-"
                try:
                    with client.stream("GET", url, headers=request_headers) as response:
                        if response.status_code == 416:
                            raise UpdateRefused(
                                "truncated",
                                f"the artifact ends at {have} of {size} bytes on the server",
                            )
                        if response.status_code in (401, 403):
                            why = (
                                "the cloud refused this agent's token"
                                if token
                                else "the token is sent only to the enrolled cloud over https"
                            )
                            raise UpdateRefused(
                                "unauthorized",
                                f"GET {url} answered {response.status_code} ({why})",
                                transient=True,
                            )
                        if response.status_code not in (200, 206):
                            raise UpdateRefused(
                                "download_failed",
                                f"GET {url} answered {response.status_code}",
                                transient=True,
                            )
                        mode = "ab" if response.status_code == 206 and have else "wb"
                        written = have if mode == "ab" else 0
                        with part.open(mode) as handle:
                            for chunk in response.iter_bytes(_CHUNK):
                                written += len(chunk)
                                if written > size:
                                    raise UpdateRefused(
                                        "size_mismatch",
                                        f"the server sent more than the {size} bytes announced",
                                    )
                                self._write(handle, chunk)
                            handle.flush()
                            os.fsync(handle.fileno())
                except UpdateRefused as exc:
                    if not exc.transient:
                        part.unlink(missing_ok=True)
                    raise
                except httpx.HTTPError as exc:
                    log.info("download of %s broke (%s); resuming", url, exc)
                now = part.stat().st_size if part.exists() else 0
                if now == size:
                    return
                stalled = stalled + 1 if now <= have else 0
                if stalled >= 2:
                    break
                self._stopping.wait(min(2.0, 0.1 * 2**_attempt))
        have = part.stat().st_size if part.exists() else 0
        raise UpdateRefused(
            "truncated", f"download stopped at {have} of {size} bytes", transient=have < size
        )

    def _load_and_check(self, manifest: ModelManifest, path: Path) -> Any:
        try:
            engine = self._engine_factory(path)
        except EdgeLoopError as exc:
            raise UpdateRefused("load_failed", exc.message) from exc
        # The signed manifest names the version: samples are tagged with the registry's
        # name and version even when the artifact's own metadata says otherwise.
        engine.name, engine.version = manifest.name, manifest.version
        current = self._current()
        if tuple(engine.input_hw) != tuple(current.input_hw):
            raise UpdateRefused(
                "incompatible_input",
                f"model takes {engine.input_hw} frames; the serving one {current.input_hw}",
            )
        for index, case in enumerate(manifest.golden):
            frames = np.frombuffer(case.input_bytes(), dtype=np.uint8).reshape(case.shape)
            try:
                scores = np.asarray(engine.run(frames), dtype=np.float64)
            except EdgeLoopError as exc:
                raise UpdateRefused("golden_failed", f"golden[{index}] did not run: {exc}") from exc
            expected = np.asarray(case.expected, dtype=np.float64)
            if scores.shape != expected.shape:
                raise UpdateRefused(
                    "golden_mismatch",
                    f"golden[{index}] gave shape {list(scores.shape)},"
                    f" expected {list(expected.shape)}",
                )
            worst = float(np.max(np.abs(scores - expected)))
            if not worst <= case.atol:
                raise UpdateRefused(
                    "golden_mismatch",
                    f"golden[{index}] differs by {worst:.3g}, more than atol {case.atol:g}",
                )
        return engine

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
            if previous.sha256 and _sha256(path) != previous.sha256:
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


def token_for(settings: AgentSettings, url: str) -> str | None:
    """The API token if ``url`` is on the enrolled cloud's origin over TLS, else None."""
    if settings.api_token is None or not settings.cloud_url:
        return None
    target, cloud = _origin(url), _origin(settings.cloud_url)
    if target is None or target != cloud:
        return None  # another host: the sha256 in the signed manifest guards the bytes
    scheme, host, _port = target
    if scheme != "https" and not (host in _LOOPBACK and settings.env == "development"):
        return None  # never a credential in plaintext off this machine
    return settings.api_token.get_secret_value()


def _origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an http(s) URL, the port made explicit; None otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        return None
    return scheme, parts.hostname.lower(), port or (443 if scheme == "https" else 80)


def _signed_part(raw: bytes) -> bytes:
    """The manifest object of an announcement as received (what its signature covers)."""
    try:
        return decode_message(raw, ModelAnnouncement, max_bytes=1 << 22).signed_bytes()
    except (MessageError, ValueError):
        return raw


def _names(raw: bytes) -> tuple[str, str]:
    """Name and version of an announcement before it is trusted (for refusal reports)."""
    try:
        manifest = decode_message(raw, ModelAnnouncement, max_bytes=1 << 22).manifest
        return manifest.name, manifest.version
    except (MessageError, ValueError):
        return "", ""
