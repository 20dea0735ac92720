"""Forwarded frames to the cloud: sample envelopes, the disk spool, the uplink pump, receipts.

A forwarded frame becomes a sample envelope (its image as received or re-encoded,
the edge's scores and route) and goes to the spool a micro-batch at a time, in one
transaction (``spool-writer``, or the inference thread that routed them when several
infer); the batch is published right after it commits
while the link keeps up. ``uplink-pump`` publishes what is due in the spool (samples
stored while the link was down or backed up, resends) and applies receipts that
arrived while samples were being published. ``docs/architecture.md`` ("Delivery is
end to end") describes the contract with the cloud.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from edge_agent.engine import Engine
from edge_agent.imaging import DecodedImage, encode_for_upload
from edge_agent.routing import Decision
from edge_agent.settings import AgentSettings
from edge_agent.spool import NewSample, Spool
from edge_agent.spool_writer import SpoolWriter
from edge_agent.telemetry import Telemetry
from edge_agent.uplink import Publisher
from shared.envelope import encode_envelope
from shared.errors import EdgeLoopError
from shared.images import ImageInfo
from shared.lifecycle import Workers
from shared.messages import Receipt, SampleHeader

__all__ = ["Forwarding"]

log = logging.getLogger(__name__)

# Above this many messages waiting in the link's outbox, new samples wait in the spool.
_LINK_BACKLOG = 200
_PUMP_BATCH = 100


class Forwarding:
    """The forward path from an encoded sample to a receipted one (see module doc)."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        publisher: Publisher,
        telemetry: Telemetry,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.publisher = publisher
        self.telemetry = telemetry
        self.clock = clock
        self.topic_samples = settings.topics.samples(settings.fleet, settings.agent_id)
        self._limits = settings.envelope_limits
        self.spool_errors = 0
        self._workers = Workers("uplink")
        self._spooled = threading.Event()  # wakes the uplink pump
        # Frames handed to routing that may still forward a sample: the spool writer
        # waits for them before it commits a batch.
        self._routing = 0
        self._routing_lock = threading.Lock()
        # Receipts that arrive while samples are being published are held and applied
        # with the next spool transaction (a writer batch or the pump's sent-mark).
        self._receipts_lock = threading.Lock()
        self._publishing = 0
        self._held_receipts: list[str] = []
        # True until the pump has found the spool drained since the last (re)connect:
        # until then new samples queue behind the backlog instead of jumping it.
        self.uplink_backlogged = True
        self._check_due = True  # something may be due that nobody published yet

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> Forwarding:
        """Open the spool and start ``spool-writer`` and ``uplink-pump``."""
        s = self.settings
        self.spool = Spool(
            s.resolved_spool_path, max_bytes=s.spool_max_bytes, max_samples=s.spool_max_samples
        )
        # Forwarded samples gather while their batch's other frames are still being
        # routed, for at most as long as the micro-batcher waits to fill a batch.
        self.spool_writer = SpoolWriter(
            self.spool,
            clock=self.clock,
            window_s=s.max_wait_ms / 1000.0,
            max_batch=2 * max(1, s.max_batch),
            uplink=_FreshSamples(self),
            expecting=lambda: self._routing > 0,
        ).start()
        self._workers.spawn("pump", self._pump)
        return self

    def stop(self) -> None:
        """Store (and answer) what the writer still holds, then stop the pump."""
        self._workers.stopping.set()
        self._spooled.set()
        self.spool_writer.stop()
        self._workers.stop(5.0)

    def close(self) -> None:
        """Close the spool (once nothing publishes or receipts any more)."""
        self.spool.close()

    def health(self) -> dict[str, object]:
        return dict(self._workers.health())

    # --- frames being routed -------------------------------------------------------------

    def expect(self, count: int) -> None:
        """``count`` frames are being routed; their samples may come."""
        with self._routing_lock:
            self._routing += count

    def routed(self, count: int) -> None:
        """``count`` frames are routed; when none is left, the writer commits its batch."""
        with self._routing_lock:
            self._routing -= count
            last = self._routing == 0
        if last:
            self.spool_writer.nudge()  # its batch is complete: commit now

    # --- samples -------------------------------------------------------------------------

    def encode_sample(
        self,
        sample_id: str,
        decision: Decision,
        answer: Mapping[str, Any],
        engine: Engine,
        frame: np.ndarray | None,
        bgr: bool,
        encoded: bytes | None,
        info: ImageInfo | None,
        captured_at: datetime,
        source: str,
        *,
        decode: Callable[[bytes], DecodedImage],
    ) -> NewSample | None:
        """The spool entry for a forwarded frame; None (counted) when it cannot be made.

        ``answer`` is the student's answer as its task writes it into a sample header
        (``Task.sample_fields``). ``decode`` gives the full frame of an upload that was
        decoded at the model's size only, when it must be re-encoded.
        """
        s = self.settings
        try:
            if (
                frame is None
                and encoded is not None
                and info is not None
                and not s.upload_recompress
                and max(info.width, info.height) <= s.upload_max_side
            ):
                image, image_info = encoded, info  # an upload forwarded as received
            else:
                if frame is None:
                    # Decoded at the model's size only: decode the full frame to re-encode it.
                    assert encoded is not None
                    frame, bgr = decode(encoded).rgb, False
                image, image_info = encode_for_upload(
                    frame,
                    original=encoded,
                    original_info=info,
                    max_side=s.upload_max_side,
                    quality=s.upload_jpeg_quality,
                    recompress=s.upload_recompress,
                    bgr=bgr,
                )
            payload = self.envelope(
                sample_id=sample_id,
                image=image,
                image_info=image_info,
                captured_at=captured_at,
                model_name=engine.name,
                model_version=engine.version,
                answer=answer,
                route_reason=decision.reason,
                priority=decision.priority,
                source=source,
            )
        except EdgeLoopError as exc:
            # The frame is still answered; the failure is counted and shown in status.
            self.spool_errors += 1
            log.warning("could not spool sample %s: %s", sample_id, exc)
            return None
        return NewSample(
            sample_id, payload, priority=decision.priority, audit=decision.reason == "audit"
        )

    def envelope(
        self,
        *,
        sample_id: str,
        image: bytes,
        image_info: ImageInfo,
        captured_at: datetime,
        model_name: str,
        model_version: str,
        answer: Mapping[str, Any],
        route_reason: str | None,
        priority: int,
        source: str,
    ) -> bytes:
        """The sample envelope this agent uploads for an image (raises ContractError).

        ``answer`` is the student's answer as its task writes it into a sample header
        (``Task.sample_fields``).
        """
        s = self.settings
        header = SampleHeader(
            sample_id=sample_id,
            fleet=s.fleet,
            agent=s.agent_id,
            captured_at=captured_at,
            model_name=model_name,
            model_version=model_version,
            **answer,
            route_reason=route_reason,
            priority=priority,
            image_format=image_info.format,
            image_width=image_info.width,
            image_height=image_info.height,
            image_bytes=len(image),
            meta={"source": source},
        )
        return encode_envelope(header, image, self._limits)

    def store(
        self, samples: Sequence[tuple[NewSample, Callable[[bool], None]]], *, here: bool = False
    ) -> None:
        """Spool each ``(sample, done)``; ``done(stored)`` runs once it is committed (or
        failed, counted). ``here``: in one transaction on this thread, as the spool
        writer would store them, else gathered by the writer with other threads' samples."""
        entries = [(sample, self._stored_callback(sample, done)) for sample, done in samples]
        if here:
            self.spool_writer.store_now(entries)
            return
        for sample, stored in entries:
            self.spool_writer.submit(sample, stored)

    def _stored_callback(
        self, sample: NewSample, done: Callable[[bool], None]
    ) -> Callable[[bool, BaseException | None], None]:
        def stored(ok: bool, error: BaseException | None) -> None:
            if error is not None:
                # The frame is still answered; the failure is counted and shown.
                self.spool_errors += 1
                log.warning("could not spool sample %s: %s", sample.sample_id, error)
            done(ok)

        return stored

    # --- the link --------------------------------------------------------------------------

    def on_connect(self) -> None:
        """Send again whatever was in flight when the link dropped (the cloud stores by
        sample_id, so a repeat is stored once)."""
        self.spool.reset_sent()
        self.uplink_backlogged = True
        self._check_due = True
        self._spooled.set()

    def on_receipt(self, receipt: Receipt) -> None:
        """Delete the receipted samples (with the next spool write while publishing)."""
        with self._receipts_lock:
            if self._publishing:  # applied with the next spool write, moments away
                self._held_receipts.extend(receipt.sample_ids)
                return
        removed = self.spool.ack(receipt.sample_ids)
        self.telemetry.receipted.inc(removed)

    def begin_fresh(self) -> tuple[bool, list[str]]:
        """Before a writer batch commits: publish it directly? and the receipts to apply."""
        link = self.publisher
        direct = not self.uplink_backlogged and link.connected and link.backlog < _LINK_BACKLOG
        with self._receipts_lock:
            if direct:
                self._publishing += 1
            acked, self._held_receipts = self._held_receipts, []
        return direct, acked

    def end_fresh(
        self, published: bool, samples: list[NewSample], acked: list[str], removed: int | None
    ) -> None:
        """After a writer batch: publish it (committed, stored as sent) or leave it to the pump."""
        wake = False
        try:
            if published:
                for sample in samples:
                    self.publisher.publish(self.topic_samples, sample.payload, qos=1)
            elif samples:
                self._check_due = True
                wake = True
        finally:
            with self._receipts_lock:
                if removed is None:
                    self._held_receipts.extend(acked)  # the write failed: apply them later
                if published:
                    self._publishing -= 1
                wake = wake or bool(self._held_receipts)
        if removed is not None and acked:
            self.telemetry.receipted.inc(removed)
        if wake:
            self._spooled.set()

    def _pump(self) -> None:
        resend = self.settings.resend_after_s
        stopping = self._workers.stopping
        checked = 0.0
        while not stopping.is_set():
            if self._spooled.wait(0.25):  # also wakes for resends after the timeout
                # Gather what else is spooled meanwhile: one read and one sent-mark for the
                # lot instead of a transaction pair per sample, for a few ms of delay.
                stopping.wait(self.settings.uplink_coalesce_ms / 1000.0)
            self._spooled.clear()
            # Read the spool when something unpublished was stored, after a reconnect, and
            # at least every 0.25 s for resends; a wake-up for receipts alone does not.
            check_due = self._check_due or time.monotonic() - checked >= 0.25
            self._check_due = False
            while not stopping.is_set():
                connected = self.publisher.connected
                if connected and check_due and self.publisher.backlog >= _LINK_BACKLOG:
                    time.sleep(0.01)  # let the io thread drain its outbox first
                    continue
                due = []
                receipted: list[str] = []
                try:
                    if connected and check_due:
                        checked = time.monotonic()
                        due = self.spool.due(
                            now=self.clock(), resend_after_s=resend, limit=_PUMP_BATCH
                        )
                    with self._receipts_lock:
                        self._publishing += 1
                    try:
                        for item in due:
                            self.publisher.publish(self.topic_samples, item.payload, qos=1)
                    finally:
                        with self._receipts_lock:
                            self._publishing -= 1
                            receipted, self._held_receipts = self._held_receipts, []
                    if due or receipted:
                        removed = self.spool.settle(
                            sent=[i.sample_id for i in due], acked=receipted, now=self.clock()
                        )
                        if receipted:
                            self.telemetry.receipted.inc(removed)
                except EdgeLoopError:
                    with self._receipts_lock:
                        self._held_receipts.extend(receipted)
                    log.exception("uplink pump failed; retrying")
                    break
                if len(due) < _PUMP_BATCH:
                    if connected and check_due:
                        self.uplink_backlogged = False
                    break


class _FreshSamples:
    """The spool writer's way to the link: a batch is published as soon as it commits."""

    def __init__(self, forwarding: Forwarding) -> None:
        self._forwarding = forwarding

    def begin(self) -> tuple[bool, list[str]]:
        return self._forwarding.begin_fresh()

    def end(
        self, published: bool, samples: list[NewSample], acked: list[str], removed: int | None
    ) -> None:
        self._forwarding.end_fresh(published, samples, acked, removed)
