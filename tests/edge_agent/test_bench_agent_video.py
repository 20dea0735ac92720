"""The agent benchmark's video rounds: the raw loops and the agent see the same clip."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import agent as bench_agent
from edge_agent.testing import make_tiny_detector, make_tiny_student
from tests.edge_agent.conftest import wait_for


def _eventually(predicate: Callable[[], bool]) -> bool:
    """Poll until ``predicate`` holds; 60 s is a safety net, not a speed bound."""
    return wait_for(predicate, timeout=60)


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("clip")
    return bench_agent._video(folder / "clip.avi", bench_agent._frames(8))


def test_the_raw_video_loops_run_the_same_frames_pipelined_and_one_step_at_a_time(
    tmp_path: Path, clip: Path
) -> None:
    model = make_tiny_student(tmp_path / "student.onnx")
    loops = bench_agent._raw_video_loops(model, clip, 20)  # past the clip's end: it loops
    assert set(loops) == {"raw_video", "raw_video_serial"}
    for loop in loops.values():
        loop()
        loop()  # a second pass reopens the clip


def test_video_rounds_report_the_agent_against_each_raw_loop(tmp_path: Path, clip: Path) -> None:
    model = make_tiny_student(tmp_path / "student.onnx")
    figures = bench_agent._video_rounds(model, clip, 16, repeats=2, window_s=0.3)
    assert figures["video_fps"] > 0
    assert figures["raw_video_fps"] > 0
    assert figures["raw_video_serial_fps"] > 0
    assert figures["video_vs_raw_video"] > 0
    assert figures["video_vs_raw_video_serial"] > 0
    assert figures["video_dropped"] == 0  # a file source waits for room, it never drops
    # Once more with nothing forwarded, and the agent's CPU by thread.
    assert figures["video_unforwarded_fps"] > 0
    assert figures["video_unforwarded_vs_raw_video"] > 0
    # And forwarding every frame: the agent's CPU per forwarded sample.
    assert figures["video_forward_all_rate"] == 1.0
    assert "video_forward_cpu_ms_per_sample" in figures
    assert figures["video_cpu_us_camera-video"] > 0
    assert figures["video_cpu_us_inference-loop"] > 0
    assert all(f"video_cpu_us_{name}" in figures for name, _ in bench_agent.AGENT_THREADS)


def test_the_per_thread_table_names_threads_the_agent_runs(tmp_path: Path, clip: Path) -> None:
    """A thread renamed in the agent would read 0 in the bench's table: the names must
    be the ones a running agent (camera source, stand-in cloud) has."""

    from edge_agent.agent import Agent
    from edge_agent.settings import AgentSettings, CameraSource

    settings = AgentSettings(
        data_dir=tmp_path,
        model_path=make_tiny_student(tmp_path / "student.onnx"),
        fleet="bench",
        agent_id="bench-video",
        route_max_prob_below=1.01,  # forward every frame: every thread has work
        cameras=[CameraSource(name="video", uri=str(clip), max_fps=200.0)],
    )
    cloud = bench_agent._StandInCloud(settings.topics, settings.fleet, settings.agent_id)
    named = {name for name, _ in bench_agent.AGENT_THREADS} - {"native"}

    def running() -> set[str]:
        return {t.name.rstrip("0123456789").rstrip("-") for t in threading.enumerate()}

    with Agent(settings, publisher=cloud):
        assert _eventually(lambda: named <= running()), named - running()


def test_thread_cpu_counts_a_busy_thread_under_its_name_without_its_number() -> None:
    import threading

    done = threading.Event()

    def spin() -> None:
        while not done.is_set():
            pass

    worker = threading.Thread(target=spin, name="bench-probe-7", daemon=True)
    worker.start()
    try:
        assert _eventually(lambda: bench_agent._thread_cpu().get("bench-probe", 0.0) > 0.05)
        cpu = bench_agent._thread_cpu()
    finally:
        done.set()
        worker.join()
    assert "MainThread" in cpu and "bench-probe-7" not in cpu
    assert cpu["bench-probe"] > 0.05  # seconds of CPU the spinning thread used


def test_the_stand_in_cloud_receipts_and_answers_every_forwarded_sample(tmp_path: Path) -> None:
    """The agent bench's stand-in for the verifier: the agent gets a receipt and a
    verdict for each sample it forwards, and pays for handling both."""
    import numpy as np

    from edge_agent.agent import Agent
    from edge_agent.settings import AgentSettings

    settings = AgentSettings(
        data_dir=tmp_path,
        model_path=make_tiny_student(tmp_path / "student.onnx"),
        fleet="bench",
        agent_id="bench-video",
        route_max_prob_below=1.01,  # forward every frame
    )
    cloud = bench_agent._StandInCloud(settings.topics, settings.fleet, settings.agent_id)
    frame = np.zeros((64, 64, 3), np.uint8)
    with Agent(settings, publisher=cloud, start_sources=False) as agent:
        ids = [agent.process(frame, source="test").sample_id for _ in range(5)]
        assert _eventually(
            lambda: (
                not agent.spool.depth
                and all(agent.sample(i).get("verdict") is not None for i in ids)
            )  # type: ignore[union-attr]
        )
        assert agent.spool.depth == 0  # every sample receipted
        verdicts = [agent.sample(i)["verdict"] for i in ids]  # type: ignore[index]
        assert [v["sample_id"] for v in verdicts] == ids
        assert {v["agent"] for v in verdicts} == {"bench-video"}
    assert cloud.answers.samples == 5


def test_frame_preparation_is_timed_for_each_camera_size() -> None:
    rows = bench_agent.frame_preparation(repeats=1)
    assert [row[0] for row in rows] == ["320x240", "640x480", "1280x720", "1920x1080"]
    for _size, agent_us, one_resize_us, speed_up, difference in rows:
        assert agent_us > 0 and one_resize_us > 0 and speed_up > 0
        assert difference < 3.5  # grey levels, on average


def test_the_stand_in_cloud_answers_a_detectors_samples_with_box_verdicts(tmp_path: Path) -> None:
    import numpy as np

    from edge_agent.agent import Agent
    from edge_agent.settings import AgentSettings

    settings = AgentSettings(
        data_dir=tmp_path,
        model_path=make_tiny_detector(tmp_path / "detector.onnx"),
        fleet="bench",
        agent_id="bench-video",
        **bench_agent.ROUTING["all"],
    )
    cloud = bench_agent._StandInCloud(
        settings.topics, settings.fleet, settings.agent_id, detection=True
    )
    frame = np.zeros((64, 64, 3), np.uint8)
    with Agent(settings, publisher=cloud, start_sources=False) as agent:
        ids = [agent.process(frame, source="test").sample_id for _ in range(3)]
        assert _eventually(
            lambda: all(agent.sample(i).get("verdict") is not None for i in ids)  # type: ignore[union-attr]
        )
        verdicts = [agent.sample(i)["verdict"] for i in ids]  # type: ignore[index]
    assert all(v["boxes"] == [] for v in verdicts)


def test_routing_off_forwards_nothing_for_either_task(tmp_path: Path) -> None:
    import numpy as np

    from edge_agent.agent import Agent
    from edge_agent.settings import AgentSettings

    for model in (
        make_tiny_student(tmp_path / "student.onnx"),
        make_tiny_detector(tmp_path / "detector.onnx"),
    ):
        settings = AgentSettings(
            data_dir=tmp_path / model.stem,
            model_path=model,
            fleet="bench",
            agent_id="bench-video",
            **bench_agent.ROUTING["off"],
        )
        cloud = bench_agent._StandInCloud(settings.topics, settings.fleet, settings.agent_id)
        frame = np.zeros((64, 64, 3), np.uint8)
        with Agent(settings, publisher=cloud, start_sources=False) as agent:
            results = [agent.process(frame, source="test") for _ in range(20)]
        assert not any(r.forwarded for r in results)
        assert cloud.answers.samples == 0
