"""``edge-agent tune``: the agent's own pipeline timed in each layout, the fastest kept.

How inference spreads over a device's cores decides its frame rate: one batch at a
time on ORT's intra-op threads, one per core, or a batch per core at once, each on
one thread (``inference_threads``), and how many frames make a batch. ORT's speed
alone does not pick it: the agent decodes, routes, answers and forwards around every
batch, and its per-batch work outweighed ORT's gain from smaller batches on the
reference detector. So each candidate runs the whole agent in this process, on the
user's model and frames, the way they reach it: images (a folder) are decoded at
the model's size as uploads are (fed by ``http_decode_threads`` threads); a video file
is read by a camera source, as ``edge-agent run`` reads a camera (a Motion JPEG
clip as its JPEGs). Frames are then batched, inferred, routed with the user's
policy, forwarded samples spooled (in a scratch folder) and receipted as the cloud
would (no verdicts: no teacher runs here). The two paths can favour different
layouts on the same model. The candidates alternate round by round, so a noisy
device slows them alike, and each one's medians are kept.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from edge_agent.imaging import ACCEPTED
from edge_agent.settings import AgentSettings
from shared.errors import ConfigError, EdgeLoopError

__all__ = [
    "Layout",
    "Trial",
    "candidate_layouts",
    "check_clip",
    "default_cores",
    "load_frames",
    "tune",
    "usable_frames",
]

log = logging.getLogger(__name__)

_IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png"}
MAX_FRAMES = 256  # distinct frames cycled through; more only costs memory


@dataclass(frozen=True)
class Layout:
    """How the agent spreads inference over the cores (three of its settings)."""

    intra_op_threads: int  # 0: ORT's default, one per core
    inference_threads: int
    max_batch: int
    pinned: bool = False  # each inference thread on a core of its own

    @property
    def label(self) -> str:
        intra = self.intra_op_threads or "one per core"
        pinned = ", pinned" if self.pinned else ""
        return (
            f"{self.inference_threads} at once{pinned} x {intra} intra-op,"
            f" batches of {self.max_batch}"
        )

    def settings(self) -> dict[str, int | bool]:
        return {
            "intra_op_threads": self.intra_op_threads,
            "inference_threads": self.inference_threads,
            "max_batch": self.max_batch,
            "pin_inference_threads": self.pinned,
        }


@dataclass(frozen=True)
class Trial:
    """One layout's medians over the rounds."""

    layout: Layout
    frames_per_s: float
    cpu_ms_per_frame: float
    p50_ms: float
    p99_ms: float
    forward_rate: float
    errors: int  # frames refused or failed (uploads), or dropped (a camera source)

    def figures(self) -> dict[str, float | int]:
        """The measured figures, rounded for reading (``edge-agent tune --json``)."""
        return {
            "frames_per_s": round(self.frames_per_s, 1),
            "cpu_ms_per_frame": round(self.cpu_ms_per_frame, 4),
            "p50_ms": round(self.p50_ms, 2),
            "p99_ms": round(self.p99_ms, 2),
            "forward_rate": round(self.forward_rate, 4),
            "errors": self.errors,
        }


def candidate_layouts(cores: int, max_batches: Sequence[int]) -> list[Layout]:
    """One batch at a time on every core, and (with several cores) a batch per core on
    one thread each, free to move or each pinned to its core; at each of ``max_batches``."""
    layouts: list[Layout] = []
    for batch in dict.fromkeys(max_batches):
        layouts.append(Layout(0, 1, batch))
        if cores > 1:
            layouts.append(Layout(1, cores, batch))
            layouts.append(Layout(1, cores, batch, pinned=True))
    return layouts


def load_frames(path: Path, limit: int = MAX_FRAMES) -> list[bytes]:
    """The images of a folder to tune on, as uploads (its subfolders too: a folder of
    labelled images works as it is)."""
    if not path.is_dir():
        raise ConfigError(f"{path} is not a folder of images")
    files = sorted(
        p for p in path.rglob("*") if p.suffix.lower() in _IMAGE_SUFFIXES and p.is_file()
    )
    if not files:
        raise ConfigError(f"no images in {path}: tune reads {ACCEPTED} files (.jpg, .png)")
    return [p.read_bytes() for p in files[:limit]]


def check_clip(path: Path) -> Path:
    """``path`` when it is a video file OpenCV reads a frame of; else ConfigError."""
    if not path.is_file():
        raise ConfigError(f"{path} is neither a folder of images nor a video file")
    import cv2

    capture = cv2.VideoCapture(str(path))
    try:
        ok = capture.isOpened() and capture.read()[0]
    finally:
        capture.release()
    if not ok:
        raise ConfigError(f"no frames could be read from {path}: give a video OpenCV reads")
    return path


class _Receipts:
    """The tuned agent's Publisher: every forwarded sample receipted, as the verifier
    does (a receipt every 50 ms, at most 100 ids each), and nothing sent anywhere."""

    connected = True
    backlog = 0
    FLUSH_S = 0.05
    MAX_IDS = 100

    def __init__(self, receipts_topic: str) -> None:
        self._topic = receipts_topic
        self._on_message: Callable[[str, bytes], None] | None = None
        self._ids: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tune-receipts", daemon=True)

    def set_handlers(
        self, *, on_message: Callable[[str, bytes], None], on_connect: Callable[[], None]
    ) -> None:
        self._on_message = on_message

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        if not topic.endswith("/samples"):
            return
        from shared.envelope import peek_sample_id  # this stand-in's cost is not the agent's

        sample_id = peek_sample_id(payload)
        with self._lock:
            self._ids.append(sample_id)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        from shared.messages import Receipt, encode_message

        while not self._stop.wait(self.FLUSH_S):
            with self._lock:
                ids, self._ids = self._ids, []
            for at in range(0, len(ids), self.MAX_IDS):
                receipt = Receipt(sample_ids=ids[at : at + self.MAX_IDS], stored_at=_now())
                if self._on_message is not None:
                    self._on_message(self._topic, encode_message(receipt))


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class _Window:
    frames: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    forwarded: int = 0
    errors: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0

    def close(self) -> _Window:
        if self.latencies_ms:
            self.p50_ms = float(np.percentile(self.latencies_ms, 50))
            self.p99_ms = float(np.percentile(self.latencies_ms, 99))
            self.latencies_ms = []
        return self


def _tuned_settings(settings: AgentSettings, layout: Layout, scratch: Path) -> AgentSettings:
    """The user's settings with ``layout``, a scratch data folder and no sources."""
    from edge_agent.updates import active_model_path

    return settings.model_copy(
        update={
            **layout.settings(),
            "data_dir": scratch,
            "model_path": active_model_path(settings),
            "spool_path": None,
            "cameras": [],
            "folders": [],
            "webhook_url": None,
            "http_max_fps": None,
        }
    )


def _window(
    settings: AgentSettings, frames: Sequence[bytes], warmup_s: float, seconds: float
) -> _Window:
    """Start an agent with ``settings``, feed it ``frames`` for ``warmup_s`` and then
    ``seconds``, and count what it answered in the second part."""
    from edge_agent.agent import Agent
    from edge_agent.intake import FrameResult

    publisher = _Receipts(settings.topics.receipts(settings.fleet, settings.agent_id))
    in_flight = threading.Semaphore((settings.inference_threads + 1) * settings.max_batch)
    stop = threading.Event()
    counting = threading.Event()
    lock = threading.Lock()
    window = _Window()
    order = itertools.cycle(range(len(frames)))

    def reply(result: FrameResult | None, error: BaseException | None) -> None:
        in_flight.release()
        if not counting.is_set():
            return
        with lock:
            if result is None:
                window.errors += 1
                return
            window.frames += 1
            window.latencies_ms.append(result.latency_ms)
            window.forwarded += result.forwarded

    def feed(agent: Agent) -> None:
        while not stop.is_set():
            if not in_flight.acquire(timeout=0.1):
                continue
            body = frames[next(order)]
            try:
                agent.answer_upload(body, reply, source="tune")
            except (EdgeLoopError, queue.Full) as exc:  # counted; the others go on
                reply(None, exc)

    with Agent(settings, publisher=publisher, start_sources=False) as agent:
        feeders = [
            threading.Thread(target=feed, args=(agent,), name=f"tune-feed-{i}", daemon=True)
            for i in range(settings.http_decode_threads)
        ]
        for feeder in feeders:
            feeder.start()
        time.sleep(warmup_s)
        cpu, start = time.process_time(), time.perf_counter()
        counting.set()
        time.sleep(seconds)
        counting.clear()
        window.seconds = time.perf_counter() - start
        window.cpu_s = time.process_time() - cpu
        stop.set()
        for feeder in feeders:
            feeder.join(10)
    return window.close()


def _clip_window(settings: AgentSettings, clip: Path, warmup_s: float, seconds: float) -> _Window:
    """Start an agent with a camera source on ``clip`` (started again at its end), wait
    ``warmup_s``, and count what it answered in the next ``seconds``."""
    from edge_agent.agent import Agent
    from edge_agent.settings import CameraSource

    camera = CameraSource(name="tune", uri=str(clip), max_fps=100_000.0)
    with_camera = settings.model_copy(update={"cameras": [camera]})
    publisher = _Receipts(settings.topics.receipts(settings.fleet, settings.agent_id))
    with Agent(with_camera, publisher=publisher) as agent:
        telemetry = agent.telemetry
        time.sleep(warmup_s)
        frames, forwarded = telemetry.frames_total, telemetry.forwarded_total
        dropped = telemetry.dropped_total
        cpu, start = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        window = _Window(
            frames=telemetry.frames_total - frames,
            seconds=time.perf_counter() - start,
            cpu_s=time.process_time() - cpu,
            forwarded=telemetry.forwarded_total - forwarded,
            errors=telemetry.dropped_total - dropped,
        )
        snapshot = telemetry.snapshot()  # the newest answers' latencies
    window.p50_ms = snapshot["latency_p50_ms"] or 0.0
    window.p99_ms = snapshot["latency_p99_ms"] or 0.0
    return window


def tune(
    settings: AgentSettings,
    frames: Sequence[bytes] | Path,
    *,
    layouts: Sequence[Layout],
    seconds: float = 3.0,
    rounds: int = 3,
    progress: Callable[[int, Layout, float], None] | None = None,
) -> list[Trial]:
    """Each of ``layouts`` timed in ``rounds`` windows of ``seconds`` (the order
    alternating round by round), fastest first. ``frames``: encoded images, sent as
    uploads, or a video file, read by a camera source."""
    if isinstance(frames, Path):
        clip = check_clip(frames)

        def run_window(tuned: AgentSettings, warmup_s: float) -> _Window:
            return _clip_window(tuned, clip, warmup_s, seconds)
    else:
        images = usable_frames(settings, frames)

        def run_window(tuned: AgentSettings, warmup_s: float) -> _Window:
            return _window(tuned, images, warmup_s, seconds)

    if not layouts:
        raise ConfigError("tune needs at least one layout")
    windows: dict[Layout, list[_Window]] = {layout: [] for layout in layouts}
    warmup_s = max(0.5, seconds / 4)
    with tempfile.TemporaryDirectory(prefix="edgeloop-tune-") as tmp:
        for round_no in range(rounds):
            ordered = list(layouts) if round_no % 2 == 0 else list(layouts)[::-1]
            for i, layout in enumerate(ordered):
                scratch = Path(tmp) / f"r{round_no}-{i}"
                scratch.mkdir()
                tuned = _tuned_settings(settings, layout, scratch)
                window = run_window(tuned, warmup_s)
                windows[layout].append(window)
                if progress is not None:
                    progress(round_no, layout, window.frames / max(window.seconds, 1e-9))
    trials = [_trial(layout, ws) for layout, ws in windows.items()]
    return sorted(trials, key=lambda t: -t.frames_per_s)


def usable_frames(settings: AgentSettings, frames: Sequence[bytes]) -> list[bytes]:
    """The frames the agent accepts (as an upload is checked); ConfigError when none is."""
    from edge_agent.imaging import ImageRejected, decode_image

    usable: list[bytes] = []
    refused: dict[str, int] = {}
    for body in frames:
        try:
            decode_image(body, max_bytes=settings.max_image_bytes, max_pixels=settings.max_pixels)
        except ImageRejected as exc:
            refused[exc.message] = refused.get(exc.message, 0) + 1
            continue
        usable.append(body)
    if refused:
        log.warning("%d frames the agent refuses are left out: %s", sum(refused.values()), refused)
    if not usable:
        raise ConfigError(f"none of the {len(frames)} frames is accepted; send {ACCEPTED}")
    return usable


def _trial(layout: Layout, windows: list[_Window]) -> Trial:
    def median(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    answered = [w for w in windows if w.frames]
    return Trial(
        layout=layout,
        frames_per_s=median([w.frames / max(w.seconds, 1e-9) for w in windows]),
        cpu_ms_per_frame=median([w.cpu_s / w.frames * 1e3 for w in answered]),
        p50_ms=median([w.p50_ms for w in answered]),
        p99_ms=median([w.p99_ms for w in answered]),
        forward_rate=median([w.forwarded / w.frames for w in windows if w.frames]),
        errors=sum(w.errors for w in windows),
    )


def default_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
