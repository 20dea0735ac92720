"""Uploads on the hot path: the shared decode, the HTTP source's rate limit, concurrency."""

from __future__ import annotations

import concurrent.futures
import io
import threading
import time
from collections.abc import Callable, Iterator

import cv2
import httpx
import numpy as np
import pytest
from PIL import Image

from edge_agent.agent import Agent
from edge_agent.batcher import WorkerPool
from edge_agent.imaging import (
    ImageRejected,
    decode_for_model,
    decode_image,
    model_tensor,
    prepare_bgr,
    resize_for_model,
)
from edge_agent.settings import AgentSettings
from edge_agent.sources.http import ApiServer, create_app
from edge_agent.testing import MemoryPublisher
from shared.images import ImageInfo

LIMITS = {"max_bytes": 10_000_000, "max_pixels": 100_000_000}


def _photo(width: int, height: int, fmt: str = "JPEG", mode: str = "RGB") -> bytes:
    """A smooth image (a gradient), so a reduced JPEG decode stays close to a full one."""
    ys, xs = np.mgrid[0:height, 0:width]
    pixels = np.stack([xs * 255 // width, ys * 255 // height, (xs + ys) % 256], -1)
    image = Image.fromarray(pixels.astype(np.uint8)).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, quality=95)
    return buffer.getvalue()


@pytest.mark.parametrize(("fmt", "mode"), [("JPEG", "RGB"), ("PNG", "RGB"), ("PNG", "L")])
def test_an_upload_decoded_into_its_batch_slot_is_the_frame_decoded_alone(
    fmt: str, mode: str
) -> None:
    data = _photo(320, 240, fmt, mode)
    info = decode_for_model(data, (64, 64), **LIMITS).info
    alone = model_tensor(data, info, (64, 64))
    batch = np.zeros((3, 64, 64, 3), np.uint8)
    written = model_tensor(data, info, (64, 64), batch[1])
    assert np.shares_memory(written, batch)
    assert np.array_equal(batch[1], alone)
    assert not batch[0].any() and not batch[2].any()  # its own slot only
    # At the model's size already: copied into the slot as decoded.
    same_size = _photo(64, 64, fmt, mode)
    model_tensor(same_size, ImageInfo(info.format, 64, 64), (64, 64), batch[2])
    assert np.array_equal(batch[2], decode_for_model(same_size, (64, 64), **LIMITS).tensor)


@pytest.mark.parametrize(("fmt", "mode"), [("JPEG", "RGB"), ("PNG", "RGB"), ("PNG", "L")])
def test_decode_for_model_matches_a_full_decode_and_resize(fmt: str, mode: str) -> None:
    data = _photo(640, 480, fmt, mode)
    frame = decode_for_model(data, (64, 64), **LIMITS)
    assert frame.tensor.shape == (64, 64, 3)
    assert frame.tensor.dtype == np.uint8
    assert frame.info.width == 640 and frame.encoded is data
    full = resize_for_model(decode_image(data, **LIMITS).rgb, (64, 64))
    # RGB order, same picture: only the JPEG decoder's scaling differs.
    diff = np.abs(frame.tensor.astype(int) - full.astype(int))
    assert diff.mean() < 2.0, diff.mean()


@pytest.mark.parametrize("shape", [(240, 320), (480, 640), (241, 321), (64, 64), (30, 40)])
def test_frame_preparation_gives_the_pixels_of_opencvs_own_calls(shape: tuple[int, int]) -> None:
    # The outputs are allocated before each OpenCV call (so OpenCV need not allocate
    # them mid-call): the same pixels as the calls that allocate, in new arrays.
    bgr = np.random.default_rng(3).integers(0, 256, (*shape, 3), dtype=np.uint8)
    expected = bgr
    height, width = shape
    while height >= 4 * 64 and width >= 4 * 64 and height % 2 == 0 and width % 2 == 0:
        height, width = height // 2, width // 2
        expected = cv2.resize(expected, (width, height), interpolation=cv2.INTER_AREA)
    if (height, width) != (64, 64):
        shrinking = height > 64 or width > 64
        interpolation = cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR
        expected = cv2.resize(expected, (64, 64), interpolation=interpolation)
    tensor = prepare_bgr(bgr, (64, 64))
    assert np.array_equal(tensor, cv2.cvtColor(expected, cv2.COLOR_BGR2RGB))
    assert tensor.flags["C_CONTIGUOUS"] and not np.shares_memory(tensor, bgr)
    assert np.array_equal(resize_for_model(bgr, (64, 64)), expected)


def test_decode_for_model_refuses_with_the_precise_reason() -> None:
    jpeg = _photo(64, 64)
    with pytest.raises(ImageRejected) as truncated:
        decode_for_model(jpeg[: len(jpeg) // 2], (32, 32), **LIMITS)
    assert truncated.value.reason == "truncated"
    with pytest.raises(ImageRejected) as too_many:
        decode_for_model(_photo(400, 300), (32, 32), max_bytes=10**7, max_pixels=100_000)
    assert too_many.value.status == 413
    assert too_many.value.reason == "too_many_pixels"


def test_rate_limit_answers_429_with_retry_after(
    make_settings: Callable[..., AgentSettings], engine: object, make_image: Callable[..., bytes]
) -> None:
    settings = make_settings(http_max_fps=0.5)
    with (
        Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent,  # type: ignore[arg-type]
        ApiServer(create_app(agent)) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        first = client.post(
            "/v1/frames", content=make_image(), headers={"Content-Type": "image/jpeg"}
        )
        raw = client.post(
            "/v1/frames", content=make_image(), headers={"Content-Type": "image/jpeg"}
        )
        multipart = client.post("/v1/frames", files={"file": ("f.jpg", make_image(), "image/jpeg")})
        refused = agent.telemetry.registry.get_sample_value(
            "edgeloop_agent_bad_input_total", {"source": "http", "reason": "rate_limited"}
        )
        frames = agent.status()["frames_total"]
    assert first.status_code == 200
    for response in (raw, multipart):
        assert response.status_code == 429
        assert 1 <= int(response.headers["Retry-After"]) <= 2
        body = response.json()
        assert body["reason"] == "rate_limited"
        assert "limit of 0.5 frames/s" in body["detail"]
        assert "retry in" in body["detail"]
    assert refused == 2
    assert frames == 1  # refused uploads never reach the model


@pytest.mark.parametrize("inference_threads", [1, 2])  # decoded on decode threads, or inline
def test_concurrent_uploads_are_batched_and_each_gets_its_own_answer(
    make_settings: Callable[..., AgentSettings], engine: object, inference_threads: int
) -> None:
    settings = make_settings(
        max_batch=8,
        max_wait_ms=20.0,
        route_max_prob_below=None,
        inference_threads=inference_threads,
    )
    # Each upload a flat colour: the answer must be the one for its own frame.
    colours = [(i * 30 % 256, 255 - i * 20 % 256, i * 50 % 256) for i in range(24)]
    uploads = []
    for colour in colours:
        buffer = io.BytesIO()
        Image.new("RGB", (48, 48), colour).save(buffer, format="PNG")
        uploads.append(buffer.getvalue())
    with (
        Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent,  # type: ignore[arg-type]
        ApiServer(create_app(agent)) as server,
        httpx.Client(base_url=server.url, limits=httpx.Limits(max_connections=12)) as client,
    ):

        def post(data: bytes) -> list[float]:
            response = client.post(
                "/v1/frames", content=data, headers={"Content-Type": "image/png"}
            )
            assert response.status_code == 200, response.text
            assert response.headers["content-type"] == "application/json"
            return list(response.json()["scores"])

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(post, uploads))
        batches = agent.batcher.batches
        expected = [agent.process_upload(data, source="check").scores for data in uploads]
    assert batches < len(uploads)  # several frames shared a batch
    for got, want in zip(answers, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_bad_uploads_decoded_inline_are_refused_alone(
    make_settings: Callable[..., AgentSettings], engine: object
) -> None:
    # Two inference threads: uploads are checked on the event loop and queued undecoded,
    # each decoded by the thread that takes its batch. A bad one fails alone, with its
    # reason: refused by the check (no image data), or by the decode (cut short).
    settings = make_settings(max_batch=4, max_wait_ms=20.0, inference_threads=2)
    good = [_photo(48, 48) for _ in range(3)]
    photo = _photo(48, 48)
    no_data = photo[:200] + bytes(len(photo) - 200)  # a sound header, then zeros
    cut_short = photo[: len(photo) // 2]
    with (
        Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent,  # type: ignore[arg-type]
        ApiServer(create_app(agent)) as server,
        httpx.Client(base_url=server.url, limits=httpx.Limits(max_connections=5)) as client,
    ):
        assert agent.decodes_uploads_inline

        def post(data: bytes) -> httpx.Response:
            return client.post("/v1/frames", content=data, headers={"Content-Type": "image/jpeg"})

        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            answers = list(pool.map(post, [*good, no_data, cut_short]))
        with pytest.raises(ImageRejected) as decoded_first:  # as the decode threads refuse it
            agent.decode_for_model(cut_short)
        reasons = ["not_image", decoded_first.value.reason]
        bad_input = agent.telemetry.bad_input
        refused = [bad_input.labels("http", r)._value.get() for r in reasons]
        names = {t.name for t in threading.enumerate()}
    assert [a.status_code for a in answers] == [200, 200, 200, 400, 400]
    assert [a.json()["reason"] for a in answers[3:]] == reasons
    assert all("image/jpeg" in a.json()["accepted"] for a in answers[3:])
    assert all(a.json()["scores"] for a in answers[:3])
    assert refused == [1, 1]
    assert "http-decode-0" in names  # still there, for images whose decode is isolated


def test_chunked_uploads_are_read_and_bounded(
    make_settings: Callable[..., AgentSettings], engine: object, make_image: Callable[..., bytes]
) -> None:
    settings = make_settings(max_image_bytes=4096)
    image = make_image(64, 48)
    assert len(image) < 4096

    def chunks(data: bytes, size: int = 512) -> Iterator[bytes]:
        for i in range(0, len(data), size):
            yield data[i : i + size]

    with (
        Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent,  # type: ignore[arg-type]
        ApiServer(create_app(agent)) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        headers = {"Content-Type": "image/jpeg"}
        ok = client.post("/v1/frames", content=chunks(image), headers=headers)
        huge = client.post("/v1/frames", content=chunks(b"\xff" * 200_000), headers=headers)
    assert ok.status_code == 200, ok.text
    assert ok.json()["scores"]
    assert huge.status_code == 413
    assert huge.json()["reason"] == "too_large"


def test_worker_pool_runs_jobs_survives_failures_and_drains_on_shutdown() -> None:
    pool = WorkerPool(2, name="test-pool")
    done: list[tuple[int, str]] = []
    lock = threading.Lock()

    def job(i: int) -> None:
        if i == 3:
            raise ValueError("a failing job")
        time.sleep(0.001)
        with lock:
            done.append((i, threading.current_thread().name))

    for i in range(20):
        pool.submit(job, i)
    pool.shutdown(wait=True)
    assert sorted(i for i, _ in done) == [i for i in range(20) if i != 3]
    assert {name for _, name in done} <= {"test-pool-0", "test-pool-1"}
    with pytest.raises(RuntimeError):
        pool.submit(job, 99)


class _HeldEngine:
    """Delegates to the real engine once released: uploads outlive infer_timeout_s."""

    def __init__(self, engine: object) -> None:
        self._engine = engine
        self.release = threading.Event()
        self.finished = threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)

    def run(self, frames: np.ndarray) -> np.ndarray:
        assert self.release.wait(60), "the test never released the engine"
        try:
            return self._engine.run(frames)  # type: ignore[attr-defined, no-any-return]
        finally:
            self.finished.set()


def test_an_upload_with_no_answer_in_time_gets_503_and_later_ones_still_get_answers(
    make_settings: Callable[..., AgentSettings], engine: object, make_image: Callable[..., bytes]
) -> None:
    settings = make_settings(infer_timeout_s=0.2)
    held = _HeldEngine(engine)
    headers = {"Content-Type": "image/jpeg"}
    with (
        Agent(settings, engine=held, publisher=MemoryPublisher()) as agent,  # type: ignore[arg-type]
        ApiServer(create_app(agent)) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        late = client.post("/v1/frames", content=make_image(), headers=headers)
        # Answered at the timeout while inference is still held, not when it ends.
        inference_ended_first = held.finished.is_set()
        held.release.set()
        assert held.finished.wait(60)  # the late frame's batch ends
        ok = client.post("/v1/frames", content=make_image(), headers=headers)
    assert late.status_code == 503
    assert late.json()["reason"] == "timeout"
    assert not inference_ended_first
    assert ok.status_code == 200, ok.text


def test_answers_of_one_batch_wake_the_event_loop_once(
    make_settings: Callable[..., AgentSettings], engine: object, make_image: Callable[..., bytes]
) -> None:
    import edge_agent.sources.uploads as uploads

    drains = 0
    drain = uploads._Outbox._drain

    def counted(self: uploads._Outbox) -> None:
        nonlocal drains
        drains += 1
        drain(self)

    settings = make_settings(max_batch=8, max_wait_ms=200.0, route_max_prob_below=None)
    headers = {"Content-Type": "image/jpeg"}
    with (
        Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent,  # type: ignore[arg-type]
        ApiServer(create_app(agent)) as server,
        httpx.Client(base_url=server.url, limits=httpx.Limits(max_connections=8)) as client,
    ):
        uploads._Outbox._drain = counted  # type: ignore[method-assign]
        try:
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                codes = list(
                    pool.map(
                        lambda i: (
                            client.post(
                                "/v1/frames", content=make_image(seed=i), headers=headers
                            ).status_code
                        ),
                        range(8),
                    )
                )
        finally:
            uploads._Outbox._drain = drain  # type: ignore[method-assign]
        batches = agent.batcher.batches
    assert codes == [200] * 8
    assert batches < 8  # the uploads shared batches
    assert drains < 8  # and their answers shared wake-ups of the event loop
