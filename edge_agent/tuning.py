"""``edge-agent tune``: the agent's own pipeline timed in each layout, the fastest kept.

How inference spreads over a device's cores decides its frame rate: one batch at a
time on ORT's intra-op threads, one per core, or a batch per core at once, each on
one thread (``inference_threads``), and how many frames make a batch. ORT's speed
alone does not pick it: the agent decodes, routes, answers and forwards around every
batch, and its per-batch work outweighed ORT's gain from smaller batches on the
reference detector. So each candidate runs the whole agent in this process, on the
user's model and frames, the way they reach it: images (a folder) are POSTed to the
agent's own HTTP API by clients in a process of their own, over keep-alive
connections (a batch's worth for each batch inferred at once, and one queued), as
uploads arrive (threads that serve HTTP change which layout wins: the reference
detector's inference threads gained from being pinned behind HTTP and not with frames
fed in process); a video file is read by a camera source, as ``edge-agent run``
reads a camera (a Motion JPEG clip as its JPEGs). Frames are then batched, inferred,
routed with the user's policy, forwarded samples spooled (in a scratch folder) and
receipted as the cloud would (no verdicts: no teacher runs here). The two paths can
favour different layouts on the same model. The candidates alternate round by round, so a noisy
device slows them alike, and each one's medians are kept.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from edge_agent.imaging import ACCEPTED
from edge_agent.settings import AgentSettings
from shared.errors import ConfigError

__all__ = [
    "Layout",
    "Trial",
    "candidate_layouts",
    "check_clip",
    "connect",
    "default_cores",
    "load_frames",
    "receive_answer",
    "take_response",
    "tune",
    "upload_request",
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
    forwarded: int = 0
    errors: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0


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


def _window(settings: AgentSettings, load: _UploadLoad, warmup_s: float, seconds: float) -> _Window:
    """Start an agent with ``settings`` and its HTTP API, have ``load`` POST frames to it
    for ``warmup_s`` and then ``seconds``, and count what it answered in the second part."""
    from edge_agent.agent import Agent
    from edge_agent.sources.http import ApiServer, create_app

    publisher = _Receipts(settings.topics.receipts(settings.fleet, settings.agent_id))
    connections = (settings.inference_threads + 1) * settings.max_batch
    with (
        Agent(settings, publisher=publisher, start_sources=False) as agent,
        ApiServer(create_app(agent), port=0) as server,
    ):
        load.start(server.port, connections)
        try:
            time.sleep(warmup_s)
            window = _counted(agent, seconds)
        finally:
            errors = load.stop()
    window.errors = errors
    return window


def _counted(agent: Any, seconds: float) -> _Window:
    """What ``agent`` answered in the next ``seconds``, from its own counters."""
    telemetry = agent.telemetry
    frames, forwarded = telemetry.frames_total, telemetry.forwarded_total
    cpu, start = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    window = _Window(
        frames=telemetry.frames_total - frames,
        seconds=time.perf_counter() - start,
        cpu_s=time.process_time() - cpu,
        forwarded=telemetry.forwarded_total - forwarded,
    )
    snapshot = telemetry.snapshot()  # the newest answers' latencies
    window.p50_ms = snapshot["latency_p50_ms"] or 0.0
    window.p99_ms = snapshot["latency_p99_ms"] or 0.0
    return window


class _UploadLoad:
    """Clients in a process of their own, as an agent's clients are: keep-alive
    connections to the agent's API on this host, each POSTing the next frame as soon
    as the last is answered, while started. ``stop()`` says how many were not answered
    200 (refused or failed)."""

    def __init__(self, frames: Sequence[bytes]) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_post_frames, args=(list(frames), child), name="tune-load", daemon=True
        )

    def __enter__(self) -> _UploadLoad:
        self._process.start()
        if not self._conn.poll(60) or self._conn.recv() != "ready":
            self._process.kill()
            raise ConfigError("the tune's load process did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()

    def start(self, port: int, connections: int) -> None:
        self._conn.send((port, connections))

    def stop(self) -> int:
        self._conn.send("stop")
        if not self._conn.poll(30):
            raise ConfigError("the tune's load process stopped answering")
        errors: int = self._conn.recv()
        return errors


def _post_frames(frames: list[bytes], conn: Any) -> None:
    """The load process: for each ``(port, connections)`` received, POST ``frames`` in
    turn over that many keep-alive connections until told "stop", then send back how
    many answers were not 200; None ends it."""
    import selectors

    conn.send("ready")
    while (command := conn.recv()) is not None:
        if command == "stop":
            conn.send(0)
            continue
        port, connections = command
        requests = [upload_request(port, body) for body in frames]
        selector = selectors.DefaultSelector()
        socks: list[socket.socket] = []
        buffers: dict[socket.socket, bytearray] = {}
        turn = itertools.cycle(requests)
        errors = 0
        for _ in range(connections):
            sock = connect(port)
            sock.sendall(next(turn))
            buffers[sock] = bytearray()
            selector.register(sock, selectors.EVENT_READ, sock)
            socks.append(sock)
        while not conn.poll():
            for key, _ in selector.select(0.05):
                sock = key.data
                answered = receive_answer(sock, buffers[sock])
                if answered is None:
                    continue
                errors += not answered
                sock.sendall(next(turn))
        if conn.recv() is None:  # "stop" (or the end)
            return
        selector.close()
        for sock in socks:
            sock.close()
        conn.send(errors)


def upload_request(port: int, body: bytes) -> bytes:
    """A keep-alive ``POST /v1/frames`` of ``body`` (a JPEG, or a PNG) to this host's
    ``port``, as bytes to send."""
    kind = "image/png" if body.startswith(b"\x89PNG") else "image/jpeg"
    head = (
        f"POST /v1/frames HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("ascii") + body


def connect(port: int) -> socket.socket:
    """A keep-alive connection to the agent's API on this host (no Nagle delay)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def receive_answer(sock: socket.socket, buf: bytearray) -> bool | None:
    """Read what ``sock`` has into ``buf`` and take a whole answer off it
    (``take_response``); ConnectionError when the agent closed the connection."""
    chunk = sock.recv(65536)
    if not chunk:
        raise ConnectionError("the agent closed a keep-alive connection")
    buf += chunk
    return take_response(buf)


def take_response(buf: bytearray) -> bool | None:
    """Take the first whole HTTP/1.1 response off ``buf``: whether it was a 200; None
    (``buf`` untouched) while it is not whole yet."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(buf[:end]).lower()
    at = head.find(b"content-length:")
    length = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
    if len(buf) < end + 4 + length:
        return None
    ok = buf.startswith(b"HTTP/1.1 200")
    del buf[: end + 4 + length]
    return ok


def _clip_window(settings: AgentSettings, clip: Path, warmup_s: float, seconds: float) -> _Window:
    """Start an agent with a camera source on ``clip`` (started again at its end), wait
    ``warmup_s``, and count what it answered in the next ``seconds``."""
    from edge_agent.agent import Agent
    from edge_agent.settings import CameraSource

    camera = CameraSource(name="tune", uri=str(clip), max_fps=100_000.0)
    with_camera = settings.model_copy(update={"cameras": [camera]})
    publisher = _Receipts(settings.topics.receipts(settings.fleet, settings.agent_id))
    with Agent(with_camera, publisher=publisher) as agent:
        time.sleep(warmup_s)
        dropped = agent.telemetry.dropped_total
        window = _counted(agent, seconds)
        window.errors = agent.telemetry.dropped_total - dropped
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
    if not layouts:
        raise ConfigError("tune needs at least one layout")
    load: _UploadLoad | None = None
    if isinstance(frames, Path):
        clip = check_clip(frames)

        def run_window(tuned: AgentSettings, warmup_s: float) -> _Window:
            return _clip_window(tuned, clip, warmup_s, seconds)
    else:
        load = _UploadLoad(usable_frames(settings, frames))

        def run_window(tuned: AgentSettings, warmup_s: float) -> _Window:
            assert load is not None
            return _window(tuned, load, warmup_s, seconds)

    windows: dict[Layout, list[_Window]] = {layout: [] for layout in layouts}
    warmup_s = max(0.5, seconds / 4)
    with (
        tempfile.TemporaryDirectory(prefix="edgeloop-tune-") as tmp,
        load if load is not None else contextlib.nullcontext(),
    ):
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
