"""The agent benchmark's HTTP side: the load generator and the bare server it is
measured against (the HTTP layer alone)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest

from bench import agent as bench_agent
from edge_agent.sources.http import ApiServer
from edge_agent.tuning import upload_request


def test_the_bare_server_reads_each_body_and_answers_an_answer_sized_json() -> None:
    answer = bench_agent._bare_answer()
    assert set(json.loads(answer)) >= {"label", "scores", "confidence", "forwarded"}
    body = bench_agent._frames(1)[0]
    with ApiServer(bench_agent.bare_app(answer)) as server:
        response = httpx.post(
            server.url + "/v1/frames", content=body, headers={"content-type": "image/jpeg"}
        )
    assert response.status_code == 200
    assert response.content == answer


def test_the_bare_server_takes_uploads_by_the_agents_raw_route() -> None:
    answer = bench_agent._bare_answer()
    route = bench_agent.BareRoute(answer)
    body = bench_agent._frames(1)[0]
    with ApiServer(bench_agent.bare_app(b'{"app": true}'), raw_route=route) as server:
        response = httpx.post(
            server.url + "/v1/frames", content=body, headers={"content-type": "image/jpeg"}
        )
    assert response.status_code == 200
    assert response.content == answer  # the route's, not the app's


def test_a_burst_sends_every_request_over_keep_alive_connections_and_times_each() -> None:
    frames = bench_agent._frames(3)
    with ApiServer(bench_agent.bare_app(b'{"ok": true}')) as server:
        requests = [upload_request(server.port, frames[i % 3]) for i in range(20)]
        socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
        try:
            latencies, errors = bench_agent._burst(socks, requests)
        finally:
            for sock in socks:
                sock.close()
    assert len(latencies) == 20
    assert errors == 0
    assert all(latency > 0 for latency in latencies)


def test_ready_asks_a_local_service_for_readyz() -> None:
    from bench.common import ready
    from shared.broker import free_port

    assert not ready(free_port())  # nothing listens there
    with ApiServer(bench_agent.bare_app(b"{}")) as server:
        assert ready(server.port)


def test_a_detector_is_measured_on_scenes_of_its_scenario_at_its_input_size() -> None:
    frames, shown = bench_agent._frames_for("detection", 64, 3)
    assert len(frames) == 3 and "64x64 scenes" in shown
    image = cv2.imdecode(np.frombuffer(frames[0], np.uint8), cv2.IMREAD_COLOR)
    assert image.shape == (64, 64, 3)
    frames, shown = bench_agent._frames_for("classification", 224, 2)
    assert len(frames) == 2 and "320x240" in shown


def test_the_agent_runs_in_the_layout_tune_picks_unless_one_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edge_agent.testing import make_tiny_student

    model = make_tiny_student(tmp_path / "student.onnx", size=32)
    frames = bench_agent._frames(4, 64, 48)
    layout, fps = bench_agent.agent_layout(model, frames, seconds=0.5, rounds=1)
    assert layout in bench_agent.LAYOUTS
    assert set(fps) == {each.label for each in bench_agent.LAYOUTS}
    assert fps[layout.label] == max(fps.values()) > 0

    clip = bench_agent._video(tmp_path / "clip.avi", frames)
    on_clip, clip_fps = bench_agent.agent_layout(model, clip, seconds=0.5, rounds=1)
    assert clip_fps[on_clip.label] == max(clip_fps.values()) > 0

    monkeypatch.setenv("BENCH_LAYOUT", "1,3")
    assert bench_agent.agent_layout(model, frames, seconds=0.5) == (bench_agent.Layout(1, 3), {})
