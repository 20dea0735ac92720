"""Camera and folder sources: a looping video file, newest-frame-only, reconnects, folders."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings, CameraSource, FolderSource
from edge_agent.sources.camera import CameraReader, read_frame
from edge_agent.testing import MemoryPublisher


def write_video(path: Path, frames: int = 10, *, fourcc: str = "MJPG") -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), 10.0, (64, 48))
    rng = np.random.default_rng(0)
    for _ in range(frames):
        writer.write(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))
    writer.release()
    return path


class SlowEngine:
    """Wraps the real engine, taking ``delay`` seconds per batch (inference falling behind)."""

    def __init__(self, inner: object, delay: float) -> None:
        self.inner = inner
        self.delay = delay
        self.name, self.version = "slow", "1"
        self.labels = inner.labels  # type: ignore[attr-defined]
        self.input_hw = inner.input_hw  # type: ignore[attr-defined]
        self.provider = "cpu"

    def run(self, frames: np.ndarray) -> np.ndarray:
        time.sleep(self.delay)
        return self.inner.run(frames)  # type: ignore[attr-defined,no-any-return]


class FastCapture:
    """A live camera double: frames as fast as they are read; fails after ``fail_after``."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.reads = 0
        self.fail_after = fail_after

    def isOpened(self) -> bool:
        return True

    def read(self, image: np.ndarray | None = None) -> tuple[bool, np.ndarray | None]:
        self.reads += 1
        if self.fail_after is not None and self.reads > self.fail_after:
            return False, None
        time.sleep(0.001)
        if image is None or image.shape != (48, 64, 3):
            image = np.empty((48, 64, 3), dtype=np.uint8)
        image[:] = self.reads % 255
        return True, image

    def release(self) -> None:
        pass


def test_read_frame_decodes_into_a_new_array_like_the_last(tmp_path: Path) -> None:
    video = str(write_video(tmp_path / "clip.avi", frames=4))
    plain, reused = cv2.VideoCapture(video), cv2.VideoCapture(video)
    try:
        last: np.ndarray | None = None
        kept = []
        for _ in range(4):
            ok, expected = plain.read()
            ok_reused, frame = read_frame(reused, last)
            assert ok and ok_reused and frame is not None
            assert np.array_equal(frame, expected)
            # Each frame is an array of its own: frames handed to the agent stay intact.
            assert last is None or not np.shares_memory(frame, last)
            kept.append(frame.copy())
            last = frame
        assert not np.array_equal(kept[0], kept[-1])
        # A last frame of another size: OpenCV allocates one of the stream's size.
        reused.set(cv2.CAP_PROP_POS_FRAMES, 0)
        ok, frame = read_frame(reused, np.zeros((8, 8, 3), np.uint8))
        assert ok and frame is not None and np.array_equal(frame, kept[0])
    finally:
        plain.release()
        reused.release()


def test_video_file_in_a_loop(
    tmp_path: Path,
    make_settings: Callable[..., AgentSettings],
    engine: object,
    until: Callable[..., bool],
) -> None:
    video = write_video(tmp_path / "clip.avi", frames=5)
    settings = make_settings(cameras=[CameraSource(name="file-cam", uri=str(video), max_fps=200.0)])
    with Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent:  # type: ignore[arg-type]
        assert until(lambda: agent.telemetry.frames_total >= 12, timeout=15)  # looped past 5
        status = agent.status()["sources"][0]
    assert status["state"] == "running"
    assert status["dropped"] == 0  # a file waits for room instead of dropping


def test_live_source_keeps_the_newest_frame_and_counts_drops(
    make_settings: Callable[..., AgentSettings], engine: object, until: Callable[..., bool]
) -> None:
    settings = make_settings(max_batch=2)
    capture = FastCapture()
    with Agent(
        settings,
        engine=SlowEngine(engine, 0.05),
        publisher=MemoryPublisher(),  # type: ignore[arg-type]
        start_sources=False,
    ) as agent:
        reader = CameraReader(
            CameraSource(name="live", uri="rtsp://camera/stream", max_fps=1000.0),
            agent,
            opener=lambda uri: capture,
            live=True,
        ).start()

        def dropped_and_answered() -> bool:
            now = reader.status()
            return now["dropped"] > 10 and now["answered"] > 0

        assert until(dropped_and_answered, timeout=60)
        reader.stop()
        status = reader.status()
    assert status["dropped"] > 10
    assert status["answered"] > 0
    # Nothing queued up: every frame was either answered, dropped, or in flight at the end.
    assert status["frames"] - status["answered"] - status["dropped"] <= 2 + 1
    assert agent.batcher.pending == 0


def test_frames_are_prepared_off_the_reading_thread_in_the_order_read(
    make_settings: Callable[..., AgentSettings], engine: object, until: Callable[..., bool]
) -> None:
    settings = make_settings()
    capture = FastCapture(fail_after=40)
    with Agent(
        settings,
        engine=engine,  # type: ignore[arg-type]
        publisher=MemoryPublisher(),
        start_sources=False,
    ) as agent:
        prepared: list[tuple[int, str]] = []
        answer_bgr = agent.answer_bgr

        def recording(bgr: np.ndarray, reply: Any, **kwargs: object) -> None:
            prepared.append((int(bgr[0, 0, 0]), threading.current_thread().name))
            answer_bgr(bgr, reply, **kwargs)  # type: ignore[arg-type]

        agent.answer_bgr = recording  # type: ignore[method-assign]
        reader = CameraReader(
            CameraSource(name="cam", uri="video.avi", max_fps=1000.0, loop=False),
            agent,
            opener=lambda uri: capture,
            live=False,
        ).start()
        assert until(lambda: reader.answered >= 40, timeout=15)
        reader.stop()
    assert [value for value, _ in prepared] == list(range(1, 41))
    assert {thread for _, thread in prepared} == {"camera-cam-prepare-0"}


def test_disconnected_camera_is_retried_and_shows_in_status(
    make_settings: Callable[..., AgentSettings], engine: object, until: Callable[..., bool]
) -> None:
    opened: list[int] = []

    def opener(uri: str) -> FastCapture:
        opened.append(1)
        return FastCapture(fail_after=3)

    with Agent(
        settings := make_settings(),
        engine=engine,
        publisher=MemoryPublisher(),  # type: ignore[arg-type]
        start_sources=False,
    ) as agent:
        reader = CameraReader(
            CameraSource(
                name="flaky",
                uri="rtsp://x",
                max_fps=1000.0,
                reconnect_min_s=0.05,
                reconnect_max_s=0.2,
            ),
            agent,
            opener=opener,
            live=True,
        ).start()
        assert until(lambda: len(opened) >= 3, timeout=10)
        reader.stop()
    assert reader.reconnects >= 2
    assert reader.last_error is not None and "stopped delivering" in reader.last_error
    assert settings.agent_id == "agent-1"


def test_unopenable_camera(
    make_settings: Callable[..., AgentSettings], engine: object, until: Callable[..., bool]
) -> None:
    settings = make_settings(
        cameras=[CameraSource(name="gone", uri="/nonexistent/video.avi", reconnect_min_s=0.05)]
    )
    with Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent:  # type: ignore[arg-type]
        assert until(lambda: agent.status()["sources"][0]["state"] == "reconnecting", timeout=10)
        assert "cannot open" in agent.status()["sources"][0]["last_error"]


def test_watched_folder(
    tmp_path: Path,
    make_settings: Callable[..., AgentSettings],
    engine: object,
    make_image: Callable[..., bytes],
    until: Callable[..., bool],
) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "a.jpg").write_bytes(make_image())
    (inbox / "b.png").write_bytes(make_image(fmt="PNG"))
    (inbox / "broken.jpg").write_bytes(b"\xff\xd8\xff garbage")
    (inbox / "notes.txt").write_text("ignored")
    settings = make_settings(
        folders=[FolderSource(name="inbox", path=inbox, poll_s=0.05, max_fps=100.0)]
    )
    with Agent(settings, engine=engine, publisher=MemoryPublisher()):  # type: ignore[arg-type]
        assert until(lambda: (inbox / "done" / "b.png").exists(), timeout=10)
        assert until(lambda: (inbox / "failed" / "broken.jpg").exists(), timeout=10)
        assert until(lambda: (inbox / "done" / "a.jpg.json").exists(), timeout=10)
    result = json.loads((inbox / "done" / "a.jpg.json").read_text())
    assert result["label"].startswith("class-")
    assert "JPEG or PNG" in json.loads((inbox / "failed" / "broken.jpg.json").read_text())["error"]
    assert (inbox / "notes.txt").exists()


@pytest.mark.parametrize("names", [["a", "a"]])
def test_source_names_must_be_unique(
    names: list[str], make_settings: Callable[..., AgentSettings], tmp_path: Path
) -> None:
    from shared.errors import ConfigError

    with pytest.raises((ConfigError, ValueError)):
        make_settings(cameras=[CameraSource(name=n, uri="0") for n in names])
    assert threading.active_count() >= 1


class TwoAtOnceEngine:
    """Wraps the real engine; each batch waits until another one runs beside it."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.name, self.version = "pair", "1"
        self.labels = inner.labels  # type: ignore[attr-defined]
        self.input_hw = inner.input_hw  # type: ignore[attr-defined]
        self.provider = "cpu"
        self.pair = threading.Barrier(2)
        self.paired = threading.Event()

    def run(self, frames: np.ndarray) -> np.ndarray:
        if not self.paired.is_set():
            self.pair.wait(timeout=30)  # raises BrokenBarrierError if no second batch came
            self.paired.set()
        return self.inner.run(frames)  # type: ignore[attr-defined,no-any-return]


def test_a_video_file_feeds_every_inference_thread_a_batch(
    tmp_path: Path,
    make_settings: Callable[..., AgentSettings],
    engine: object,
    until: Callable[..., bool],
) -> None:
    video = write_video(tmp_path / "clip.avi", frames=5)
    settings = make_settings(
        max_batch=4,
        inference_threads=2,
        cameras=[CameraSource(name="file-cam", uri=str(video), max_fps=10_000.0)],
    )
    paired = TwoAtOnceEngine(engine)
    with Agent(settings, engine=paired, publisher=MemoryPublisher()) as agent:  # type: ignore[arg-type]
        # Two batches were in the engine together, and the reader kept going after.
        assert until(lambda: agent.telemetry.frames_total >= 24, timeout=15)
        reader = agent._sources[0]
        status = agent.status()["sources"][0]
    assert paired.paired.is_set()
    # A batch per inference thread, and two more read ahead.
    assert reader.max_inflight == 16  # type: ignore[attr-defined]
    assert status["dropped"] == 0 and status["last_error"] is None


def _video_jpegs(video: Path) -> list[bytes]:
    """The JPEGs a Motion JPEG file holds, as its capture hands them out."""
    from edge_agent.sources.camera import jpeg_packets, read_jpeg

    capture = cv2.VideoCapture(str(video))
    try:
        assert jpeg_packets(capture)
        packets = []
        while (packet := read_jpeg(capture)) is not None:
            packets.append(packet)
        return packets
    finally:
        capture.release()


def _sample_images(publisher: MemoryPublisher) -> list[bytes]:
    from shared.envelope import EnvelopeLimits, decode_envelope

    return [
        decode_envelope(payload, EnvelopeLimits()).image
        for topic, payload, _qos, _retain in list(publisher.messages)
        if topic.endswith("/samples")
    ]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_motion_jpeg_file_is_read_as_its_jpegs_and_forwarded_as_they_came(
    threads: int,
    tmp_path: Path,
    make_settings: Callable[..., AgentSettings],
    engine: object,
    until: Callable[..., bool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from edge_agent import intake

    video = write_video(tmp_path / "clip.avi", frames=5)
    jpegs = _video_jpegs(video)
    assert len(jpegs) == 5 and all(j.startswith(b"\xff\xd8") for j in jpegs)
    # Who decodes into the batch: with several inference threads, each its own batch's
    # JPEGs, queued by the reader as they came; with one, the preparation thread, ahead.
    decoders: set[str] = set()
    model_tensor = intake.model_tensor

    def recording(*args: Any) -> np.ndarray:
        decoders.add(threading.current_thread().name)
        return model_tensor(*args)

    monkeypatch.setattr(intake, "model_tensor", recording)
    publisher = MemoryPublisher()
    settings = make_settings(
        audit_share=1.0,  # every frame forwarded
        inference_threads=threads,
        cameras=[CameraSource(name="mjpeg-cam", uri=str(video), max_fps=200.0)],
    )
    with Agent(settings, engine=engine, publisher=publisher) as agent:  # type: ignore[arg-type]
        assert until(lambda: len(_sample_images(publisher)) >= 6, timeout=15)  # looped
        status = agent.status()["sources"][0]
    assert status["jpeg"] is True and status["last_error"] is None
    assert status["answered"] >= 6 and status["dropped"] == 0
    # Each forwarded frame is one of the camera's JPEGs, byte for byte: no re-encode.
    assert all(image in jpegs for image in _sample_images(publisher))
    if threads == 1:
        assert decoders == set()
    else:
        assert decoders and all(name.startswith("inference-loop") for name in decoders)


def test_a_jpeg_read_from_the_stream_gives_the_model_the_picture_of_the_decoded_frame(
    tmp_path: Path,
) -> None:
    """The model's input from a camera's JPEG (libjpeg, at the model's scale) and from
    the frame FFmpeg decodes: the same picture, up to the two decoders' rounding."""
    from edge_agent.imaging import decode_for_model, prepare_bgr

    path = tmp_path / "clip.avi"
    y, x = np.mgrid[0:240, 0:320]
    smooth = np.stack([x * 255 // 320, y * 255 // 240, (x + y) % 256], -1).astype(np.uint8)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (320, 240))
    writer.write(smooth)
    writer.release()
    (jpeg,) = _video_jpegs(path)
    capture = cv2.VideoCapture(str(path))
    ok, bgr = capture.read()
    capture.release()
    assert ok
    for hw in ((64, 64), (224, 224)):  # DCT-scaled, and full-size decodes
        from_jpeg = decode_for_model(jpeg, hw, max_bytes=10**7, max_pixels=10**8).tensor
        from_frame = prepare_bgr(bgr, hw)
        assert from_jpeg.shape == from_frame.shape == (*hw, 3)
        assert np.abs(from_jpeg.astype(int) - from_frame.astype(int)).mean() < 2


def test_a_stream_of_another_codec_is_read_decoded(
    tmp_path: Path,
    make_settings: Callable[..., AgentSettings],
    engine: object,
    until: Callable[..., bool],
) -> None:
    path = write_video(tmp_path / "clip.mp4", frames=5, fourcc="mp4v")
    settings = make_settings(cameras=[CameraSource(name="mp4-cam", uri=str(path), max_fps=200.0)])
    with Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent:  # type: ignore[arg-type]
        assert until(lambda: agent.telemetry.frames_total >= 6, timeout=15)
        status = agent.status()["sources"][0]
    assert status["jpeg"] is False and status["last_error"] is None


class JpegStreamWithoutTables(FastCapture):
    """A capture that says Motion JPEG and hands out packets that do not decode alone (as
    an MJPEG stream without its Huffman tables does); opened again, it reads decoded."""

    opened = 0

    def __init__(self) -> None:
        super().__init__()
        type(self).opened += 1
        self.packets = type(self).opened == 1

    def get(self, prop: int) -> float:
        return float(int.from_bytes(b"MJPG", "little")) if prop == cv2.CAP_PROP_FOURCC else 0.0

    def getBackendName(self) -> str:
        return "FFMPEG"

    def set(self, prop: int, value: float) -> bool:
        return prop == cv2.CAP_PROP_FORMAT and self.packets

    def read(self, image: np.ndarray | None = None) -> tuple[bool, np.ndarray | None]:
        if self.packets:  # SOI, then no tables: no decoder makes a picture of it
            return True, np.frombuffer(
                b"\xff\xd8\xff\xda\x00\x02" + bytes(64) + b"\xff\xd9", np.uint8
            )
        return super().read(image)


def test_a_jpeg_stream_that_does_not_decode_alone_is_read_decoded(
    make_settings: Callable[..., AgentSettings], engine: object, until: Callable[..., bool]
) -> None:
    JpegStreamWithoutTables.opened = 0
    settings = make_settings(cameras=[CameraSource(name="cam", uri="rtsp://camera/stream")])
    agent = Agent(settings, engine=engine, publisher=MemoryPublisher())  # type: ignore[arg-type]
    reader = CameraReader(
        settings.cameras[0], agent, opener=lambda uri: JpegStreamWithoutTables(), live=True
    )
    with agent:
        reader.start()
        try:
            assert until(lambda: reader.answered >= 3, timeout=15)
        finally:
            reader.stop()
    status = reader.status()
    assert JpegStreamWithoutTables.opened == 2 and status["jpeg"] is False
    assert status["reconnects"] == 0 and status["last_error"] is None
