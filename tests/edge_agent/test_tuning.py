"""``edge-agent tune``: the agent's pipeline timed per layout; the fastest saved on request."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import pytest
from typer.testing import CliRunner

from edge_agent.cli import app
from edge_agent.enroll import set_config_values
from edge_agent.settings import AgentSettings
from edge_agent.tuning import (
    Layout,
    candidate_layouts,
    check_clip,
    load_frames,
    take_response,
    tune,
    upload_request,
    usable_frames,
)
from shared.errors import ConfigError
from tests.edge_agent.conftest import image_bytes

runner = CliRunner()


def _frames_folder(root: Path, count: int = 6) -> Path:
    (root / "cats").mkdir(parents=True)
    (root / "dogs").mkdir()
    for i in range(count):
        kind = "cats" if i % 2 else "dogs"
        fmt, suffix = ("PNG", "png") if i == 0 else ("JPEG", "jpg")
        (root / kind / f"{i}.{suffix}").write_bytes(image_bytes(fmt=fmt, seed=i))
    (root / "notes.txt").write_text("not an image")
    return root


def test_candidates_are_one_batch_at_a_time_and_a_batch_per_core_free_or_pinned() -> None:
    assert candidate_layouts(4, [8]) == [
        Layout(0, 1, 8),
        Layout(1, 4, 8),
        Layout(1, 4, 8, pinned=True),
    ]
    assert candidate_layouts(1, [4, 8, 4]) == [Layout(0, 1, 4), Layout(0, 1, 8)]
    assert Layout(1, 4, 8, pinned=True).settings()["pin_inference_threads"] is True


def _clip(path: Path, frames: int = 5) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), 10, (64, 48))
    for i in range(frames):
        writer.write(np.full((48, 64, 3), i * 40, dtype=np.uint8))
    writer.release()
    return path


def test_frames_come_from_a_labelled_folder_or_a_video(tmp_path: Path) -> None:
    folder = _frames_folder(tmp_path / "images")
    frames = load_frames(folder)
    assert len(frames) == 6  # subfolders read, the text file left out
    assert load_frames(folder, limit=2) == frames[:2]
    clip = _clip(tmp_path / "clip.avi")
    assert check_clip(clip) == clip

    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no images"):
        load_frames(tmp_path / "empty")
    with pytest.raises(ConfigError, match="not a folder"):
        load_frames(clip)
    with pytest.raises(ConfigError, match="neither a folder"):
        check_clip(tmp_path / "missing")
    (tmp_path / "bad.avi").write_bytes(b"not a video")
    with pytest.raises(ConfigError, match="no frames could be read"):
        check_clip(tmp_path / "bad.avi")


def test_frames_the_agent_refuses_are_left_out(
    make_settings: Callable[..., AgentSettings],
) -> None:
    settings = make_settings()
    good = image_bytes()
    assert usable_frames(settings, [b"GIF89a...", good]) == [good]
    with pytest.raises(ConfigError, match="none of the 1 frames is accepted"):
        usable_frames(settings, [b"GIF89a..."])


def test_tune_times_each_layout_with_the_whole_agent(
    make_settings: Callable[..., AgentSettings], tmp_path: Path
) -> None:
    # Every frame forwarded: the forward path (spool, receipts) runs in every window.
    settings = make_settings(audit_share=1.0, data_dir=tmp_path / "agent")
    layouts = [Layout(1, 1, 4), Layout(1, 2, 2)]
    seen: list[tuple[int, Layout]] = []
    trials = tune(
        settings,
        [image_bytes(seed=i) for i in range(4)],
        layouts=layouts,
        seconds=0.5,
        rounds=2,
        progress=lambda round_no, layout, fps: seen.append((round_no, layout)),
    )
    # The order alternates round by round, so a noisy host slows each layout alike.
    assert seen == [(0, layouts[0]), (0, layouts[1]), (1, layouts[1]), (1, layouts[0])]
    assert {t.layout for t in trials} == set(layouts)
    assert trials[0].frames_per_s >= trials[1].frames_per_s  # fastest first
    for trial in trials:
        assert trial.frames_per_s > 0
        assert trial.cpu_ms_per_frame > 0
        assert trial.p99_ms >= trial.p50_ms > 0
        assert trial.forward_rate == 1.0
        assert trial.errors == 0
    # The agent's own data folder is untouched: the trials spool in a scratch folder.
    assert not (tmp_path / "agent").exists()


def test_tune_reads_a_video_file_as_a_camera_source_does(
    make_settings: Callable[..., AgentSettings], tmp_path: Path
) -> None:
    settings = make_settings(audit_share=1.0, data_dir=tmp_path / "agent")
    clip = _clip(tmp_path / "clip.avi")
    trials = tune(settings, clip, layouts=[Layout(1, 1, 4)], seconds=0.5, rounds=1)
    (trial,) = trials
    assert trial.frames_per_s > 0  # the five frames read again and again
    assert trial.p99_ms >= trial.p50_ms > 0
    assert trial.forward_rate == 1.0
    assert trial.errors == 0  # a file's reader waits for room: nothing dropped
    assert not (tmp_path / "agent").exists()


def test_set_config_values_keeps_the_rest_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(
        "# my device\n"
        'fleet = "plant-3"\n'
        "max_batch = 16\n"
        "\n"
        "[[cameras]]\n"
        'name = "door"\n'
        'uri = "rtsp://10.0.0.7/stream"\n'
    )
    set_config_values(path, {"max_batch": 4, "inference_threads": 2})
    text = path.read_text()
    assert text.startswith("# my device\n")
    parsed = tomllib.loads(text)
    assert parsed["max_batch"] == 4
    assert parsed["inference_threads"] == 2  # a top-level key, not one of the camera's
    assert parsed["cameras"] == [{"name": "door", "uri": "rtsp://10.0.0.7/stream"}]
    assert parsed["fleet"] == "plant-3"
    assert path.stat().st_mode & 0o777 == 0o600

    fresh = tmp_path / "new" / "agent.toml"
    set_config_values(fresh, {"max_batch": 8})
    assert tomllib.loads(fresh.read_text()) == {"max_batch": 8}

    broken = tmp_path / "broken.toml"
    broken.write_text("max_batch = [\n")
    with pytest.raises(ConfigError, match="not a TOML file"):
        set_config_values(broken, {"max_batch": 8})
    assert broken.read_text() == "max_batch = [\n"  # left as it was


def test_cli_prints_the_fastest_layout_and_writes_it(
    tmp_path: Path, student_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    config = tmp_path / "agent.toml"
    config.write_text(
        f'model_path = "{student_path}"\ndata_dir = "{tmp_path / "data"}"\n'
        'mqtt_url = "mqtt://127.0.0.1:9"\nwarmup_runs = 1\n'
    )
    folder = _frames_folder(tmp_path / "images")
    result = runner.invoke(
        app,
        [
            "tune",
            str(folder),
            "--config",
            str(config),
            "--seconds",
            "0.5",
            "--rounds",
            "1",
            "--batches",
            "2,4",
            "--write",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert {t["max_batch"] for t in report["trials"]} == {2, 4}
    assert all(t["frames_per_s"] > 0 and t["errors"] == 0 for t in report["trials"])
    keys = ("intra_op_threads", "inference_threads", "max_batch", "pin_inference_threads")
    assert report["best"] == {k: report["trials"][0][k] for k in keys}
    assert report["written"] == str(config)
    saved = tomllib.loads(config.read_text())
    assert {k: saved[k] for k in report["best"]} == report["best"]
    assert saved["warmup_runs"] == 1  # the rest kept

    refused = runner.invoke(app, ["tune", str(folder), "--config", str(config), "--batches", "x"])
    assert refused.exit_code == 2
    assert "--batches takes whole numbers" in refused.output
    missing = runner.invoke(app, ["tune", str(tmp_path / "nowhere"), "--config", str(config)])
    assert missing.exit_code == 2
    assert "neither a folder of images nor a video file" in missing.output

    clip = _clip(tmp_path / "clip.avi")
    on_clip = runner.invoke(
        app,
        ["tune", str(clip), "--config", str(config), "--seconds", "0.5", "--rounds", "1"],
    )
    assert on_clip.exit_code == 0, on_clip.output
    assert "clip.avi read as a camera" in on_clip.output
    assert "fastest: intra_op_threads=" in on_clip.output


def test_the_load_client_sends_uploads_and_takes_whole_answers_one_at_a_time() -> None:
    jpeg, png = image_bytes(), image_bytes(fmt="PNG")
    assert b"Content-Type: image/jpeg\r\n" in upload_request(8081, jpeg)
    request = upload_request(8081, png)
    assert request.startswith(b"POST /v1/frames HTTP/1.1\r\n") and request.endswith(png)
    assert f"Content-Length: {len(png)}\r\n".encode() in request
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
    refused = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 3\r\n\r\n{ }"
    buf = bytearray(ok[:-1])
    assert take_response(buf) is None and buf == ok[:-1]  # not whole yet: left as it was
    buf += ok[-1:] + refused
    assert take_response(buf) is True
    assert take_response(buf) is False
    assert buf == b"" and take_response(buf) is None
