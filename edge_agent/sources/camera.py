"""OpenCV sources: a device index, an RTSP/HTTP stream, or a video file in a loop.

A live source never queues: at most ``max_inflight`` frames are with the agent and
one more waits in a single slot; a newer frame replaces the waiting one and the
replaced frame is counted as dropped. So when inference falls behind, the agent
answers the newest frame and memory stays flat. A video file is not live: its
reader waits for room instead of dropping (reading ahead would only waste decoding).

A source that fails to open or stops delivering is reopened with jittered
exponential backoff; its state (running, reconnecting) shows in status.

Frames go to the agent in BGR, as OpenCV reads them: the agent shrinks a frame to
the model's size before converting it to RGB (the same pixels as converting first,
for less work), and encodes the full BGR frame only when it forwards it. Shrinking
is not cheap (OpenCV's area filter from 320x240 to 64x64 costs a good part of what
reading the frame does: docs/performance.md, agent), so each source hands its frames
to its own preparation thread and goes back to reading at once: reading one frame
overlaps shrinking the one before, in arrival order.

A Motion JPEG stream that OpenCV reads through FFmpeg (an IP camera's RTSP or HTTP
stream, an MJPG video file; ``keep_jpeg``, on by default) is read as the camera's own
JPEG frames instead, each decoded as an upload is, at the model's scale (libjpeg's DCT
scaling), and a forwarded frame goes to the cloud as the camera encoded it, with no
JPEG encode on the agent. Where several inference threads decode their own batches
(``Agent.queue_undecoded``), the reader queues each JPEG as it is, and the
inference thread that takes it decodes it into its batch; otherwise the preparation
thread decodes it. A stream whose first frame is not a whole JPEG that decodes is
read decoded, as any other.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from edge_agent.batcher import WorkerPool
from edge_agent.intake import FrameResult, FrameSink
from edge_agent.settings import CameraSource
from edge_agent.uplink import Backoff
from shared.errors import EdgeLoopError
from shared.lifecycle import Workers

__all__ = ["CameraReader", "jpeg_packets", "open_capture", "read_frame", "read_jpeg", "read_next"]

log = logging.getLogger(__name__)

Frame = np.ndarray | bytes  # BGR pixels, or the bytes of a JPEG as the camera sent it


def open_capture(uri: str) -> cv2.VideoCapture:
    """A VideoCapture for a device index ("0"), a stream URL or a file path."""
    return cv2.VideoCapture(int(uri) if uri.isdigit() else uri)


# Codec tags of Motion JPEG, where every packet of the stream is a whole JPEG image:
# AVI and MOV tags, and the codec's name as OpenCV's FFmpeg backend reports a stream
# without a tag (an HTTP multipart stream, say).
_MJPEG_TAGS = frozenset({b"MJPG", b"mjpg", b"AVRn", b"dmb1", b"jpeg", b"mjpe"})


def jpeg_packets(capture: Any) -> bool:
    """Switch ``capture`` to hand out its stream's packets undecoded when the stream is
    Motion JPEG; whether it did (then each ``read`` gives one JPEG's bytes).

    Only OpenCV's FFmpeg backend hands out packets; it cannot be switched back, so a
    caller whose first packet is not a JPEG it can decode opens the source again.
    """
    try:
        tag = int(capture.get(cv2.CAP_PROP_FOURCC)) & 0xFFFFFFFF
        if tag.to_bytes(4, "little") not in _MJPEG_TAGS or capture.getBackendName() != "FFMPEG":
            return False
        return bool(capture.set(cv2.CAP_PROP_FORMAT, -1))
    except (AttributeError, cv2.error):  # a capture double without these, or no backend
        return False


def read_jpeg(capture: Any) -> bytes | None:
    """The next JPEG of a capture ``jpeg_packets`` switched; None at the stream's end."""
    ok, packet = capture.read()
    if not ok or packet is None or packet.size == 0:
        return None
    return bytes(packet.data)


def _decodes_as_jpeg(data: bytes) -> bool:
    """Whether ``data`` is a whole JPEG that OpenCV decodes (a stream's first packet: some
    Motion JPEG streams leave out the Huffman tables, and then no packet decodes alone)."""
    if not (data.startswith(b"\xff\xd8") and data.rstrip(b"\x00").endswith(b"\xff\xd9")):
        return False
    try:
        return (
            cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_REDUCED_GRAYSCALE_8) is not None
        )
    except cv2.error:
        return False


def read_frame(capture: Any, last: np.ndarray | None) -> tuple[bool, np.ndarray | None]:
    """The capture's next frame, read into a new array shaped like ``last`` (when given).

    OpenCV allocates the frames it returns through numpy, which takes the interpreter
    lock in the middle of the read: with other threads busy, each such read waited
    for the lock once more (a switch interval) before it could finish decoding. Given
    an array of the right shape, OpenCV decodes into it and takes the lock only at the
    end. A frame of another size (the stream changed) is allocated by OpenCV as before.
    """
    if last is None:
        return capture.read()
    return capture.read(np.empty_like(last))


def read_next(capture: Any, last: Frame | None, *, jpeg: bool) -> Frame | None:
    """The capture's next frame, None at the stream's end: a JPEG's bytes from a capture
    ``jpeg_packets`` switched (``jpeg``), else BGR pixels (``read_frame``, into an array
    shaped like ``last``)."""
    if jpeg:
        return read_jpeg(capture)
    ok, frame = read_frame(capture, last if isinstance(last, np.ndarray) else None)
    return frame if ok else None


class CameraReader:
    """Reads one OpenCV source in its own thread and submits frames to the agent."""

    def __init__(
        self,
        config: CameraSource,
        agent: FrameSink,
        *,
        max_inflight: int | None = None,
        opener: Callable[[str], Any] = open_capture,
        live: bool | None = None,
    ) -> None:
        self.config = config
        self.agent = agent
        self.name = config.name
        self._open = opener  # a seam: tests pass a fake capture
        self.is_file = (not live) if live is not None else Path(config.uri).is_file()
        self.max_inflight = max_inflight or max(1, agent.settings.max_batch)
        # A file's reader waiting for room is woken once a batch's worth is answered
        # (answers come a batch at a time), not once per answered frame.
        self._wake_at = self.max_inflight - min(self.max_inflight, agent.settings.max_batch)
        self._lock = threading.Lock()  # guards inflight and the waiting slot
        self._room = threading.Condition(self._lock)
        self._inflight = 0
        self._waiting: Frame | None = None
        # Motion JPEG read as the camera's JPEGs; off for good once a stream's are not.
        self._keep_jpeg = config.keep_jpeg
        self.jpeg = False  # whether the open stream is read as JPEGs
        self._workers = Workers("camera")
        self._stopping = self._workers.stopping
        self._prepare: WorkerPool | None = None
        self.state = "starting"
        self.frames = 0
        self.answered = 0
        self.dropped = 0
        self.reconnects = 0
        self.last_error: str | None = None
        self._backoff = Backoff(config.reconnect_min_s, config.reconnect_max_s)

    def start(self) -> CameraReader:
        self._prepare = WorkerPool(1, name=f"camera-{self.name}-prepare")
        self._workers.spawn(self.name, self._run)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        with self._room:
            self._room.notify_all()
        self._workers.stop(timeout)
        if self._prepare is not None:
            self._prepare.shutdown(wait=True, timeout=timeout)
        self.state = "stopped"

    def health(self) -> dict[str, object]:
        """The reader thread's state."""
        return dict(self._workers.health())

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": "camera",
            "uri": self.config.uri,
            "state": self.state,
            "frames": self.frames,
            "answered": self.answered,
            "dropped": self.dropped,
            "reconnects": self.reconnects,
            "last_error": self.last_error,
            "jpeg": self.jpeg,
        }

    # --- the reader thread ----------------------------------------------------------

    def _run(self) -> None:
        period = 1.0 / self.config.max_fps
        while not self._stopping.is_set():
            capture = self._open(self.config.uri)
            if not capture.isOpened():
                capture.release()
                self._lost(f"cannot open {self.config.uri}")
                continue
            self.jpeg = self._keep_jpeg and jpeg_packets(capture)
            self.state = "running"
            self.agent.telemetry.source_up.labels(self.name).set(1)
            self._backoff.reset()
            next_at = time.monotonic()
            frame: Frame | None = None
            checked = not self.jpeg  # a JPEG stream's first packet is checked once
            try:
                while not self._stopping.is_set():
                    frame = read_next(capture, frame, jpeg=self.jpeg)
                    if frame is None and self.is_file and self.config.loop and self.frames:
                        capture.set(cv2.CAP_PROP_POS_FRAMES, 0)
                        frame = read_next(capture, None, jpeg=self.jpeg)
                    if frame is None:
                        break
                    if not checked:
                        checked = True
                        if not (isinstance(frame, bytes) and _decodes_as_jpeg(frame)):
                            log.info(
                                "camera %s: its JPEG frames do not decode alone;"
                                " reading it decoded",
                                self.name,
                            )
                            self._keep_jpeg = False
                            break
                    now = time.monotonic()
                    if now < next_at:
                        if not self.is_file:
                            continue  # over the source's max rate: skip, not a drop
                        self._stopping.wait(next_at - now)
                    next_at = max(next_at + period, time.monotonic() - period)
                    self.frames += 1
                    self._offer(frame)
            finally:
                capture.release()
            if self.jpeg and not self._keep_jpeg:
                continue  # open it again at once, read decoded
            if not self._stopping.is_set():
                self._lost(f"{self.config.uri} stopped delivering frames")

    def _lost(self, why: str) -> None:
        self.state = "reconnecting"
        self.last_error = why
        self.reconnects += 1
        self.agent.telemetry.source_up.labels(self.name).set(0)
        delay = self._backoff.next_delay()
        log.warning("camera %s: %s; retrying in %.1fs", self.name, why, delay)
        self._stopping.wait(delay)

    def _offer(self, frame: Frame) -> None:
        with self._room:
            if self.is_file:
                while self._inflight >= self.max_inflight and not self._stopping.is_set():
                    self._room.wait(0.5)
            elif self._inflight >= self.max_inflight:
                if self._waiting is not None:
                    self.dropped += 1
                    self.agent.telemetry.record_dropped(self.name)
                self._waiting = frame
                return
            self._inflight += 1
        if not (isinstance(frame, bytes) and self._queue_jpeg(frame)):
            self._submit(frame)

    def _queue_jpeg(self, data: bytes) -> bool:
        """On the reader thread: queue a JPEG for the inference thread that takes it to
        decode, into its slot of the batch, where the agent decodes its uploads so (several
        inference threads) and the image needs no isolated decode. Whether it did (or
        answered the frame with its refusal); False: the preparation thread decodes it.

        One hand-over fewer a frame and no stacking of the batch: the reference
        detector's clip (``python -m bench.ab agent --source video``, 10 rounds against
        the preparation thread decoding) ran at 907 against 886 frames/s, 2.088 against
        2.140 ms of CPU a frame.
        """
        try:
            return self.agent.queue_undecoded(data, self._done_one, source=self.name)
        except (EdgeLoopError, queue.Full) as exc:  # refused, stopping, or the queue full
            self._done_one(None, exc)
            return True

    def _submit(self, frame: Frame) -> None:
        """Hand the frame to the preparation thread (frames come only after ``start``)."""
        assert self._prepare is not None
        try:
            self._prepare.submit(self._submit_now, frame)
        except RuntimeError as exc:  # stopping: the pool is shut down
            self._done_one(None, exc)

    def _submit_now(self, frame: Frame) -> None:
        # On the preparation thread: a JPEG is decoded at the model's size (and kept, to
        # forward as it came); BGR pixels are shrunk and converted; then queued.
        try:
            if isinstance(frame, bytes):
                decoded = self.agent.decode_for_model(frame)
                self.agent.answer_frame(decoded, self._done_one, source=self.name)
            else:
                self.agent.answer_bgr(frame, self._done_one, source=self.name)
        except (EdgeLoopError, RuntimeError, queue.Full) as exc:  # stopping, or queue full
            self._done_one(None, exc)

    def _done_one(self, result: FrameResult | None, error: BaseException | None) -> None:
        if error is None:
            self.answered += 1
        elif not self._stopping.is_set():
            # Frames still in flight when the source stops fail with the agent's stop:
            # not the camera's error, so the last one the camera had stays in status.
            self.last_error = str(error)
        with self._room:
            self._inflight -= 1
            waiting, self._waiting = self._waiting, None
            if waiting is not None and not self._stopping.is_set():
                self._inflight += 1
            if self._inflight <= self._wake_at:
                self._room.notify_all()
        if waiting is not None and not self._stopping.is_set():
            self._submit(waiting)
