"""The forward path: a forwarded answer means a spooled sample; batches; direct publish."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import cv2
import numpy as np
import pytest

from edge_agent.agent import Agent, FrameResult
from edge_agent.engine import OrtEngine
from edge_agent.imaging import resize_for_model
from edge_agent.settings import AgentSettings
from edge_agent.testing import MemoryPublisher
from shared.envelope import decode_envelope


def frames(n: int, size: tuple[int, int] = (40, 40)) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 255, (*size, 3), dtype=np.uint8) for _ in range(n)]


# Inference threads on a CPU route their own batches and hand agent-post only the
# forwarded frames; one inference thread on a GPU hands each batch over to be routed.
@pytest.mark.parametrize("inference_threads", [1, 2])
def test_a_forwarded_answer_means_the_sample_is_spooled(
    make_settings: Callable[..., AgentSettings],
    engine: object,
    until: Callable[..., bool],
    inference_threads: int,
) -> None:
    publisher = MemoryPublisher(connected=False)
    settings = make_settings(
        route_max_prob_below=1.01,
        max_batch=8,
        max_wait_ms=5.0,
        inference_threads=inference_threads,
    )
    with Agent(settings, engine=engine, publisher=publisher) as agent:  # type: ignore[arg-type]
        spooled_at_answer: dict[str, bool] = {}

        def check(future: Future[FrameResult]) -> None:
            result = future.result()
            spooled_at_answer[result.sample_id] = result.sample_id in agent.spool.ids()

        futures = [agent.submit(frame, source="test") for frame in frames(32)]
        for future in futures:
            future.add_done_callback(check)
        results = [f.result(10) for f in futures]
        assert all(r.forwarded for r in results)
        assert until(lambda: len(spooled_at_answer) == 32)  # callbacks run after result()
        assert all(spooled_at_answer[r.sample_id] for r in results)
        assert agent.spool.depth == 32
        writer = agent.spool_writer
        assert writer.samples == 32
        assert writer.commits < 32  # gathered into micro-batches, one transaction each


def test_several_inference_threads_spool_their_own_batches_forwarded_frames(
    make_settings: Callable[..., AgentSettings], engine: object
) -> None:
    # Each batch's forwarded samples are committed and answered on the inference thread
    # that routed them, one transaction a batch: no hand-over to another thread.
    publisher = MemoryPublisher(connected=False)
    settings = make_settings(route_max_prob_below=1.01, max_batch=8, inference_threads=2)
    with Agent(settings, engine=engine, publisher=publisher) as agent:  # type: ignore[arg-type]
        answered_on: list[str] = []
        results: list[FrameResult] = []
        all_answered = threading.Event()

        def reply(result: FrameResult | None, error: BaseException | None) -> None:
            assert result is not None, error
            answered_on.append(threading.current_thread().name)
            results.append(result)
            if len(results) == 24:
                all_answered.set()

        for frame in frames(24):
            agent.answer_bgr(frame, reply, source="test")
        assert all_answered.wait(10)
        assert all(r.forwarded for r in results)
        assert {r.sample_id for r in results} <= set(agent.spool.ids())
        writer = agent.spool_writer
        assert writer.samples == 24
        assert writer.commits == agent.batcher.batches  # one transaction per batch
    assert answered_on and all(name.startswith("inference-loop") for name in answered_on)


@pytest.mark.parametrize("inference_threads", [1, 2])
def test_fresh_samples_are_published_once_and_receipted(
    make_settings: Callable[..., AgentSettings],
    engine: object,
    until: Callable[..., bool],
    inference_threads: int,
) -> None:
    publisher = MemoryPublisher(auto_receipt=True)
    settings = make_settings(route_max_prob_below=1.01, inference_threads=inference_threads)
    with Agent(settings, engine=engine, publisher=publisher) as agent:  # type: ignore[arg-type]
        # The pump found the spool empty.
        assert until(lambda: not agent.forwarding.uplink_backlogged)
        futures = [agent.submit(frame, source="test") for frame in frames(24)]
        ids = [f.result(10).sample_id for f in futures]
        assert until(lambda: agent.spool.depth == 0)
        sent = [decode_envelope(p).header.sample_id for p in publisher.sent()]
        assert sorted(sent) == sorted(ids)  # each once: not read back and sent again
        assert agent.spool.stats().acked == 24
        registry = agent.telemetry.registry
        assert until(lambda: registry.get_sample_value("edgeloop_agent_receipted_total") == 24)


def test_samples_stored_while_the_link_is_down_go_out_on_reconnect(
    make_settings: Callable[..., AgentSettings], engine: object, until: Callable[..., bool]
) -> None:
    publisher = MemoryPublisher(connected=False)
    settings = make_settings(route_max_prob_below=1.01)
    with Agent(settings, engine=engine, publisher=publisher) as agent:  # type: ignore[arg-type]
        ids = [agent.process(frame, source="test").sample_id for frame in frames(6)]
        assert publisher.sent() == []
        publisher.auto_receipt = True
        publisher.connect()
        assert until(lambda: agent.spool.depth == 0)
        more = [agent.process(frame, source="test").sample_id for frame in frames(3)]
        assert until(lambda: agent.spool.depth == 0)
        sent = [decode_envelope(p).header.sample_id for p in publisher.sent()]
        assert sorted(sent) == sorted(ids + more)


@pytest.mark.parametrize("size", [(48, 64), (20, 30), (32, 32), (240, 320)])
def test_resizing_before_the_colour_conversion_gives_the_same_pixels(
    size: tuple[int, int],
) -> None:
    bgr = np.random.default_rng(3).integers(0, 255, (*size, 3), dtype=np.uint8)
    for hw in ((32, 32), (160, 160)):
        converted_first = resize_for_model(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), hw)
        resized_first = cv2.cvtColor(resize_for_model(bgr, hw), cv2.COLOR_BGR2RGB)
        assert np.array_equal(converted_first, resized_first)


@pytest.mark.parametrize("size", [(240, 320), (480, 640), (720, 1280), (1080, 1920), (721, 1281)])
def test_shrinking_a_camera_frame_stays_close_to_one_area_resize(size: tuple[int, int]) -> None:
    rng = np.random.default_rng(5)
    height, width = size
    small = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8)
    frame = cv2.resize(small, (width, height), interpolation=cv2.INTER_CUBIC)
    for hw in ((64, 64), (160, 160), (48, 96)):
        shrunk = resize_for_model(frame, hw)
        assert shrunk.shape == (*hw, 3) and shrunk.dtype == np.uint8
        exact = cv2.resize(frame.astype(np.float32), (hw[1], hw[0]), interpolation=cv2.INTER_AREA)
        # A box filter all the same: a few grey levels from the exact one on this
        # high-detail frame, at most.
        assert np.abs(shrunk - exact).mean() < 3.5


def test_a_frame_under_four_times_the_model_is_one_area_resize() -> None:
    frame = np.random.default_rng(6).integers(0, 256, (240, 320, 3), dtype=np.uint8)
    expected = cv2.resize(frame, (64, 64), interpolation=cv2.INTER_AREA)
    assert np.array_equal(resize_for_model(frame, (64, 64)), expected)


def test_a_bgr_frame_gets_the_same_answer_and_upload_as_its_rgb(
    make_settings: Callable[..., AgentSettings], engine: object
) -> None:
    publisher = MemoryPublisher(connected=False)
    settings = make_settings(route_max_prob_below=1.01, upload_recompress=True)
    with Agent(settings, engine=engine, publisher=publisher) as agent:  # type: ignore[arg-type]
        bgr = frames(1, (48, 64))[0]
        by_rgb = agent.process(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), source="test")
        by_bgr = agent.submit_bgr(bgr, source="test").result(10)
        assert by_bgr.scores == by_rgb.scores
        assert by_bgr.forwarded and by_rgb.forwarded
        payloads = {s.sample_id: s.payload for s in agent.spool.due(now=1e12, resend_after_s=1)}
        images = [decode_envelope(payloads[r.sample_id]).image for r in (by_rgb, by_bgr)]
        assert images[0] == images[1]


def test_a_batch_of_confident_and_forwarded_frames_routed_on_its_inference_thread(
    make_settings: Callable[..., AgentSettings], engine: object, until: Callable[..., bool]
) -> None:
    """With two inference threads a batch is routed where it was inferred; its forwarded
    frames go to agent-post, and every frame of it counts as routed once spooled."""
    settings = make_settings(audit_share=0.5, max_batch=8, inference_threads=2)
    publisher = MemoryPublisher(connected=False)
    with Agent(settings, engine=engine, publisher=publisher) as agent:  # type: ignore[arg-type]
        futures = [agent.submit(frame, source="test") for frame in frames(64)]
        results = [f.result(10) for f in futures]
        forwarded = {r.sample_id for r in results if r.forwarded}
        assert 0 < len(forwarded) < 64  # both kinds in the same batches
        assert forwarded == set(agent.spool.ids())
        assert until(lambda: agent.forwarding._routing == 0)


class _OnGpu:
    """The test student, reporting a GPU provider."""

    provider = "cuda"

    def __init__(self, engine: OrtEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)


@pytest.mark.parametrize(("on_gpu", "routed_on"), [(False, "inference-loop"), (True, "agent-post")])
def test_one_inference_thread_routes_its_batches_itself_on_a_cpu_and_hands_them_over_on_a_gpu(
    make_settings: Callable[..., AgentSettings], engine: OrtEngine, on_gpu: bool, routed_on: str
) -> None:
    settings = make_settings(
        max_batch=8, inference_threads=1, audit_share=0.0, route_max_prob_below=0.0
    )
    answered_on: list[str] = []
    all_answered = threading.Event()

    def reply(result: FrameResult | None, error: BaseException | None) -> None:
        assert error is None and result is not None and not result.forwarded
        answered_on.append(threading.current_thread().name)
        if len(answered_on) == 16:
            all_answered.set()

    student = _OnGpu(engine) if on_gpu else engine
    publisher = MemoryPublisher(connected=False)
    with Agent(settings, engine=student, publisher=publisher) as agent:  # type: ignore[arg-type]
        for frame in frames(16):
            agent.answer_bgr(frame, reply, source="test")
        assert all_answered.wait(30)
    assert {name.rstrip("-0123456789") for name in answered_on} == {routed_on}
