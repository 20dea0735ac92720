"""Ingest: turn one MQTT message into something to store, or a dead letter with its reason.

Everything arriving over MQTT is untrusted. ``classify`` never raises for bad
input: it returns an ``IngestSample``, an ``IngestStatus``, an ``IngestModelStatus``
or a ``DeadLetterRow`` whose reason is the ``reason`` slug of the shared error
tree (``shared/errors.py``), plus ``topic_mismatch`` (payload names another
agent or fleet than its topic) and ``wrong_topic`` (a topic the cloud does not
take messages on). The verifier adds ``isolated`` (refused while the agent's
breaker is open) and ``sample_id_conflict`` (no cloud id left for a sample whose
id other agents' samples hold).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import numpy as np
from sqlalchemy.exc import SQLAlchemyError

from cloud_service.blobs import sample_image_key
from cloud_service.verifier import decode_image
from shared.decode_pool import DecodePool
from shared.envelope import EnvelopeLimits, decode_envelope
from shared.errors import ContractError, EdgeLoopError, StoreError
from shared.images import decode_cost
from shared.messages import AgentStatus, ModelStatus, SampleHeader, decode_message
from shared.tasks import Answer, Task
from shared.topics import TopicRef, Topics

__all__ = [
    "AgentBreaker",
    "DeadLetterRow",
    "InboxBudget",
    "IngestModelStatus",
    "IngestSample",
    "IngestStatus",
    "ReceiptBuffer",
    "SampleTask",
    "classify",
    "drain",
    "sample_row",
    "with_retries",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
_RETRY_BACKOFF = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass(frozen=True)
class SampleTask:
    """What the verifier needs to answer one stored sample."""

    sample_id: str
    fleet: str
    agent: str
    captured_at: datetime
    edge: Answer  # the student's answer, as its sample header carried it
    priority: int
    pixels: np.ndarray = field(repr=False)
    # The id the agent gave the sample, where the cloud stores it under another
    # (``crud.colliding_sample_id``); verdicts go back to the agent with this one.
    edge_sample_id: str | None = None

    @property
    def agent_sample_id(self) -> str:
        return self.edge_sample_id or self.sample_id


@dataclass(frozen=True)
class IngestSample:
    header: SampleHeader
    image: bytes = field(repr=False)
    pixels: np.ndarray = field(repr=False)

    @property
    def image_key(self) -> str:
        h = self.header
        return sample_image_key(h.fleet, h.agent, h.sample_id, h.image_format)

    def task(self, answers: Task, cloud_id: str | None = None) -> SampleTask:
        """The teacher's work on this sample; ``cloud_id`` is the id it is stored under.

        ``answers`` is the served task: it reads the student's answer off the header.
        """
        h = self.header
        return SampleTask(
            sample_id=cloud_id or h.sample_id,
            fleet=h.fleet,
            agent=h.agent,
            captured_at=h.captured_at,
            edge=answers.sample_answer(h),
            priority=h.priority,
            pixels=self.pixels,
            edge_sample_id=h.sample_id if cloud_id and cloud_id != h.sample_id else None,
        )


@dataclass(frozen=True)
class IngestStatus:
    status: AgentStatus


@dataclass(frozen=True)
class IngestModelStatus:
    status: ModelStatus


@dataclass(frozen=True)
class DeadLetterRow:
    topic: str
    reason: str
    message: str
    payload: bytes = field(repr=False)
    payload_size: int = 0
    fleet: str | None = None
    agent_id: str | None = None
    sample_id: str | None = None

    def row(self, received_at: datetime) -> dict[str, Any]:
        return {
            "received_at": received_at,
            "topic": self.topic[:1024],
            "reason": self.reason,
            "message": self.message[:4000],
            "payload": self.payload,
            "payload_size": self.payload_size,
            "fleet": self.fleet,
            "agent_id": self.agent_id,
            "sample_id": self.sample_id,
        }


Classified = IngestSample | IngestStatus | IngestModelStatus | DeadLetterRow | None


def _check_source(ref: TopicRef, fleet: str, agent: str) -> None:
    if (ref.fleet, ref.agent) != (fleet, agent):
        raise ContractError(
            f"payload is from {fleet}/{agent} but arrived on the topic of {ref.fleet}/{ref.agent}",
            reason="topic_mismatch",
        )


def classify(
    topic: str,
    payload: bytes,
    *,
    topics: Topics,
    limits: EnvelopeLimits,
    input_size: tuple[int, int] | None,
    keep_bytes: int = 65536,
    decode_pool: DecodePool | None = None,
) -> Classified:
    """What to do with one message (None: nothing, e.g. a cleared retained status)."""
    ref: TopicRef | None = None
    try:
        ref = topics.parse(topic)
        if ref.kind == "samples":
            envelope = decode_envelope(payload, limits)
            header = envelope.header
            _check_source(ref, header.fleet, header.agent)
            info = envelope.info
            # One walk of the markers: a scan bomb is dead-lettered here, never decoded.
            cost = decode_cost(envelope.image, info)
            # Past its budget in the pool: dead-lettered as image_decode_timeout.
            pixels = decode_image(envelope.image, input_size, pool=decode_pool, probed=(info, cost))
            return IngestSample(header=header, image=envelope.image, pixels=pixels)
        if ref.kind == "status":
            if not payload:
                return None  # someone cleared the retained status: nothing to record
            status = decode_message(payload, AgentStatus)
            _check_source(ref, status.fleet, status.agent)
            return IngestStatus(status)
        if ref.kind == "model-status":
            model_status = decode_message(payload, ModelStatus)
            _check_source(ref, model_status.fleet, model_status.agent)
            return IngestModelStatus(model_status)
        raise ContractError(
            f"the cloud takes no messages on {ref.kind!r} topics", reason="wrong_topic"
        )
    except EdgeLoopError as exc:
        return DeadLetterRow(
            topic=topic,
            reason=exc.reason,
            message=exc.message,
            payload=bytes(payload[:keep_bytes]),
            payload_size=len(payload),
            fleet=ref.fleet if ref else None,
            agent_id=ref.agent if ref else None,
        )


def sample_row(sample: IngestSample, received_at: datetime, image_key: str) -> dict[str, Any]:
    """The samples-table row of an accepted sample whose image the blob store keeps
    under ``image_key`` (the key its batch gave it)."""
    h = sample.header
    return {
        "sample_id": h.sample_id,
        "edge_sample_id": h.sample_id,
        "fleet": h.fleet,
        "agent_id": h.agent,
        "captured_at": h.captured_at,
        "received_at": received_at,
        "model_name": h.model_name,
        "model_version": h.model_version,
        "edge_scores": list(h.scores),
        "edge_predicted": h.predicted,
        "edge_confidence": h.confidence,
        "edge_boxes": h.boxes,
        "route_reason": h.route_reason,
        "priority": h.priority,
        "image_key": image_key,
        "image_format": h.image_format,
        "image_width": h.image_width,
        "image_height": h.image_height,
        "image_bytes": h.image_bytes,
        "meta": dict(h.meta),
        "status": "pending",
        "verified_at": None,
    }


class InboxBudget:
    """Messages and payload bytes the verifier holds from arrival to storage, bounded.

    ``acquire`` waits for room (a QoS 1 message: the MQTT thread stops reading, so
    TCP pushes back on the broker); ``try_acquire`` does not (a QoS 0 message is
    dropped instead). One message larger than the byte bound is let in alone, so
    the bound never deadlocks. ``close`` wakes every waiter and refuses from then on.
    """

    def __init__(self, *, max_messages: int, max_bytes: int) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.messages = 0
        self.bytes = 0
        self.peak_messages = 0
        self.peak_bytes = 0
        self.waiting = 0  # threads blocked in acquire right now
        self.waits = 0  # acquires that had to wait
        self._closed = False
        self._cond = threading.Condition(threading.Lock())  # never taken twice by one thread

    def _fits(self, size: int) -> bool:
        if self.messages == 0:
            return True
        return self.messages < self.max_messages and self.bytes + size <= self.max_bytes

    def _take(self, size: int) -> None:
        self.messages += 1
        self.bytes += size
        self.peak_messages = max(self.peak_messages, self.messages)
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def try_acquire(self, size: int) -> bool:
        """Take room for one message of ``size`` bytes if there is some now."""
        with self._cond:
            if self._closed or not self._fits(size):
                return False
            self._take(size)
            return True

    def acquire(self, size: int) -> bool:
        """Wait for room for one message of ``size`` bytes; False once closed."""
        with self._cond:
            if not self._closed and not self._fits(size):
                self.waits += 1
                self.waiting += 1
                try:
                    while not self._closed and not self._fits(size):
                        self._cond.wait()
                finally:
                    self.waiting -= 1
            if self._closed:
                return False
            self._take(size)
            return True

    def release(self, messages: int, size: int) -> None:
        """Give back the room of ``messages`` messages of ``size`` bytes in all."""
        with self._cond:
            self.messages = max(0, self.messages - messages)
            self.bytes = max(0, self.bytes - size)
            if self.waiting:
                self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class ReceiptBuffer:
    """Stored sample ids per agent, flushed every ``flush_s`` or at ``max_ids``."""

    def __init__(self, *, flush_s: float = 0.05, max_ids: int = 100) -> None:
        self.flush_s = flush_s
        self.max_ids = max_ids
        self._pending: dict[tuple[str, str], tuple[float, list[str]]] = {}

    def add(self, fleet: str, agent: str, ids: Iterable[str], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        _first, pending = self._pending.setdefault((fleet, agent), (now, []))
        pending.extend(ids)

    def due(
        self, now: float | None = None, *, everything: bool = False
    ) -> list[tuple[str, str, list[str]]]:
        """Batches to publish now: (fleet, agent, ids), at most ``max_ids`` ids each."""
        now = time.monotonic() if now is None else now
        out: list[tuple[str, str, list[str]]] = []
        for key, (first, ids) in list(self._pending.items()):
            while len(ids) >= self.max_ids:
                out.append((key[0], key[1], ids[: self.max_ids]))
                del ids[: self.max_ids]
            if ids and (everything or now - first >= self.flush_s):
                out.append((key[0], key[1], list(ids)))
                ids.clear()
            if not ids:
                del self._pending[key]
            elif now - first >= self.flush_s:
                self._pending[key] = (now, ids)
        return out

    def next_due(self) -> float | None:
        """Monotonic time the next batch falls due, if any waits."""
        if not self._pending:
            return None
        return min(first for first, _ in self._pending.values()) + self.flush_s


def utcnow() -> datetime:
    return datetime.now(UTC)


class AgentBreaker:
    """A circuit breaker per agent topic on its share of refused messages.

    Over ``window_s``, once an agent's topics carried at least ``min_messages`` and
    more than ``error_rate`` of them were refused, the agent is isolated for
    ``cooldown_s``; after the cool-down it starts again with a clean window. What
    isolation means is the verifier's: it isolates the bad messages, not the agent
    (anyone who can publish on a topic can trip its breaker), so a well-formed
    message from the agent is still taken while refused ones cost less.
    """

    def __init__(
        self,
        *,
        window_s: float = 60.0,
        min_messages: int = 20,
        error_rate: float = 0.5,
        cooldown_s: float = 300.0,
        max_agents: int = 100_000,
    ) -> None:
        self.window_s = window_s
        self.min_messages = min_messages
        self.error_rate = error_rate
        self.cooldown_s = cooldown_s
        self.max_agents = max_agents
        # (fleet, agent) -> (window start, messages, errors)
        self._windows: dict[tuple[str, str], tuple[float, int, int]] = {}
        self._isolated: dict[tuple[str, str], float] = {}  # -> monotonic time it ends

    def isolated_until(self, fleet: str, agent: str, now: float | None = None) -> float | None:
        """When the agent's isolation ends (monotonic), or None if it is let in."""
        now = time.monotonic() if now is None else now
        key = (fleet, agent)
        until = self._isolated.get(key)
        if until is None:
            return None
        if now >= until:
            del self._isolated[key]
            self._windows.pop(key, None)
            return None
        return until

    def record(self, fleet: str, agent: str, *, ok: bool, now: float | None = None) -> bool:
        """Count one message; True when this one opened the breaker."""
        now = time.monotonic() if now is None else now
        key = (fleet, agent)
        start, total, errors = self._windows.get(key, (now, 0, 0))
        if now - start > self.window_s:
            start, total, errors = now, 0, 0
        total += 1
        errors += 0 if ok else 1
        if total >= self.min_messages and errors / total > self.error_rate:
            self._windows.pop(key, None)
            self._isolated[key] = now + self.cooldown_s
            return True
        if key not in self._windows and len(self._windows) >= self.max_agents:
            self._windows.pop(next(iter(self._windows)))  # bound the table
        self._windows[key] = (start, total, errors)
        return False

    def isolated(self, now: float | None = None) -> list[tuple[str, str]]:
        now = time.monotonic() if now is None else now
        return [key for key in list(self._isolated) if self.isolated_until(*key, now=now)]


def drain(inbox: queue.Queue[T], limit: int, wait: float) -> list[T]:
    """Up to ``limit`` items: the first waited for up to ``wait`` s, the rest there already."""
    try:
        items = [inbox.get(timeout=wait)]
    except queue.Empty:
        return []
    while len(items) < limit:
        try:
            items.append(inbox.get_nowait())
        except queue.Empty:
            break
    return items


def with_retries(
    step: Callable[[], object], *, stopping: threading.Event, on_failure: Callable[[], object]
) -> bool:
    """Run ``step`` until it succeeds or ``stopping`` is set; storage outages are waited out."""
    for attempt in range(10_000):
        try:
            step()
            return True
        except (StoreError, SQLAlchemyError, OSError) as exc:
            on_failure()
            delay = _RETRY_BACKOFF[min(attempt, len(_RETRY_BACKOFF) - 1)]
            log.warning("storage failed (%s); retrying in %.1f s", exc, delay)
            if stopping.wait(delay):
                return False
    return False
