"""What the API process holds for its lifetime: settings, database, blobs, teacher, key."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from cloud_service.announce import Announcer, MqttAnnouncer
from cloud_service.blobs import BlobStore
from cloud_service.metrics import CloudMetrics
from cloud_service.settings import CloudSettings
from cloud_service.verifier import TeacherModel
from shared.errors import ConfigError, EdgeLoopError
from shared.manifest import FleetSigningKey

if TYPE_CHECKING:
    from cloud_service.worker import VerifierWorker

__all__ = ["ApiState", "load_signing_key"]

log = logging.getLogger(__name__)


def load_signing_key(settings: CloudSettings, *, signs: bool = True) -> FleetSigningKey:
    """The fleet signing key, generated on a development machine's first start.

    In production the key must exist (``cloud-service keys init``, or a mounted
    secret): replicas that each made their own would sign with different keys.
    A process that never signs (``signs=False``: the verifier's health app) gets a
    throwaway key instead of creating the fleet's.
    """
    path = settings.resolved_signing_key_file
    if not path.exists() and not signs:
        return FleetSigningKey.generate()
    if not path.exists() and settings.env == "production":
        raise ConfigError(
            f"no fleet signing key at {path}: run `cloud-service keys init` once and mount "
            "the key file (EDGELOOP_SIGNING_KEY_FILE) on every API and distill worker"
        )
    if not path.exists():
        key = FleetSigningKey.generate()
        try:
            key.save(path)
            log.info("generated the fleet signing key %s at %s", key.key_id, path)
        except EdgeLoopError:
            pass  # another process won the race; load what it saved
    return FleetSigningKey.load(path)


@dataclass
class ApiState:
    settings: CloudSettings
    engine: Engine
    sessions: sessionmaker[Session]
    blobs: BlobStore
    metrics: CloudMetrics
    signing_key: FleetSigningKey
    worker: VerifierWorker | None = None
    announcer: Announcer | None = None
    _teacher: TeacherModel | None = None
    _teacher_error: str | None = None
    _teacher_lock: threading.Lock = field(default_factory=threading.Lock)
    _announcer_lock: threading.Lock = field(default_factory=threading.Lock)

    def teacher(self) -> TeacherModel | None:
        """The teacher for the V2 endpoints: the worker's, else loaded once on first use."""
        if self.worker is not None:
            return self.worker.teacher
        with self._teacher_lock:
            if self._teacher is None and self._teacher_error is None:
                s = self.settings
                try:
                    self._teacher = TeacherModel(
                        s.resolved_teacher_model,
                        name=s.teacher_name,
                        version=s.teacher_version,
                        providers=s.ort_providers,
                        intra_op_threads=s.ort_intra_op_threads,
                    )
                except EdgeLoopError as exc:
                    self._teacher_error = exc.message
            return self._teacher

    def get_announcer(self) -> Announcer:
        """The announcer given at start, else an MQTT one connected on first use."""
        with self._announcer_lock:
            if self.announcer is None:
                self.announcer = MqttAnnouncer(
                    self.settings.mqtt, client_id=self.settings.announcer_client_id
                )
            return self.announcer

    @property
    def teacher_error(self) -> str | None:
        return self._teacher_error
