"""Edge agent: throughput against the raw ONNX Runtime session, latency, resident memory.

Side by side on the same frames and the same batch/thread settings:

* raw ORT: the student session alone on frames already decoded and resized
  (the ceiling), and the same loop including JPEG decode and resize (what any
  program answering camera JPEGs must also pay);
* the agent behind its HTTP API (``edge-agent run`` in a subprocess, concurrent
  HTTP clients in this process), and the agent reading a video file in a loop
  (in process; no clients competing for the CPU).

The agent runs with its default routing (max probability below 0.6, 1% audit)
and forwards to the local Mosquitto when one answers (otherwise it spools). The
model is the tiny test student scaled up to a camera-like input (160x160, 48
channels); the reference INT8 student from ``distill.cache`` is added when present.
Resident memory is the RSS of the ``edge-agent run`` process with the student
loaded, after serving.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cv2
import httpx
import numpy as np
import psutil

from bench.common import markdown_table, median_seconds

MAX_BATCH = 8
CLIENTS = 8


def _broker_url() -> str:
    try:
        with socket.create_connection(("127.0.0.1", 1883), timeout=0.3):
            return "mqtt://127.0.0.1:1883"
    except OSError:
        return "mqtt://127.0.0.1:9"  # nothing there: the agent spools and keeps answering


def _frames(n: int, width: int = 320, height: int = 240) -> list[bytes]:
    """Camera-like JPEG frames: smooth gradients plus noise, so they compress like photos."""
    rng = np.random.default_rng(0)
    out = []
    ys, xs = np.mgrid[0:height, 0:width]
    for i in range(n):
        base = ((xs * (1 + i % 5) + ys * (1 + i % 3)) % 256).astype(np.float32)
        pixels = np.stack([base, np.roll(base, i, 0), 255 - base], axis=-1)
        pixels += rng.normal(0, 12, pixels.shape)
        ok, buf = cv2.imencode(".jpg", np.clip(pixels, 0, 255).astype(np.uint8))
        assert ok
        out.append(buf.tobytes())
    return out


def _video(path: Path, frames: list[bytes]) -> Path:
    first = cv2.imdecode(np.frombuffer(frames[0], np.uint8), cv2.IMREAD_COLOR)
    h, w = first.shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 30.0, (w, h))
    for data in frames:
        writer.write(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR))
    writer.release()
    return path


def _models(workdir: Path) -> list[tuple[str, Path]]:
    from edge_agent.testing import make_tiny_student

    models = [
        ("tiny-student 160px", make_tiny_student(workdir / "student.onnx", size=160, channels=48))
    ]
    # The reference INT8 student, when `edgeloop models bootstrap` has built one here.
    try:
        from distill.cache import reference_model_path

        for quick in (False, True):
            try:
                path = reference_model_path("student-int8", quick=quick)
            except Exception:  # ModelError: not bootstrapped (or distill not importable)
                continue
            models.append((f"reference student int8{' (quick)' if quick else ''}", path))
            break
    except ImportError:
        pass
    return models


def _raw(model: Path, jpegs: list[bytes], repeats: int) -> dict[str, float]:
    """Raw ORT frames/s on pre-decoded tensors, and including decode+resize."""
    from edge_agent.engine import EngineOptions, OrtEngine
    from edge_agent.imaging import decode_image, resize_for_model

    engine = OrtEngine(model, EngineOptions(warmup_runs=2, warmup_batch=MAX_BATCH))
    hw = engine.input_hw
    tensors = [
        resize_for_model(decode_image(j, max_bytes=10**7, max_pixels=10**8).rgb, hw) for j in jpegs
    ]

    def tensors_only() -> None:
        for i in range(0, len(tensors), MAX_BATCH):
            engine.run(np.stack(tensors[i : i + MAX_BATCH]))

    def with_decode() -> None:
        for i in range(0, len(jpegs), MAX_BATCH):
            batch = [
                resize_for_model(decode_image(j, max_bytes=10**7, max_pixels=10**8).rgb, hw)
                for j in jpegs[i : i + MAX_BATCH]
            ]
            engine.run(np.stack(batch))

    n = len(jpegs)
    return {
        "raw_fps": n / median_seconds(tensors_only, repeats=repeats),
        "raw_decode_fps": n / median_seconds(with_decode, repeats=repeats),
    }


def _write_config(workdir: Path, model: Path, port: int) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "agent.toml"
    config.write_text(
        f'data_dir = "{workdir}"\nmodel_path = "{model}"\nhttp_port = {port}\n'
        f'mqtt_url = "{_broker_url()}"\nfleet = "bench"\nagent_id = "bench-agent"\n'
        f'max_batch = {MAX_BATCH}\nmax_wait_ms = 2.0\nheartbeat_s = 5.0\nlog_level = "WARNING"\n'
        f'topic_prefix = "edgeloop-bench/v1"\n'
    )
    return config


def _http(model: Path, jpegs: list[bytes], repeats: int, workdir: Path) -> dict[str, float]:
    from shared.broker import free_port

    port = free_port()
    config = _write_config(workdir, model, port)
    process = subprocess.Popen(
        [sys.executable, "-m", "edge_agent.cli", "run", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("edge-agent run did not become ready")
            time.sleep(0.1)
        rss_ready = psutil.Process(process.pid).memory_info().rss / 2**20
        latencies: list[float] = []
        headers = {"Content-Type": "image/jpeg"}
        with httpx.Client(
            base_url=base, timeout=30, limits=httpx.Limits(max_connections=CLIENTS)
        ) as client:

            def one(data: bytes) -> None:
                start = time.perf_counter()
                response = client.post("/v1/frames", content=data, headers=headers)
                response.raise_for_status()
                latencies.append(time.perf_counter() - start)

            with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:

                def burst() -> None:
                    list(pool.map(one, jpegs))

                seconds = median_seconds(burst, repeats=repeats)
        rss_served = psutil.Process(process.pid).memory_info().rss / 2**20
    finally:
        process.terminate()
        process.wait(20)
    ms = np.array(latencies) * 1e3
    return {
        "http_fps": len(jpegs) / seconds,
        "http_p50_ms": float(np.percentile(ms, 50)),
        "http_p99_ms": float(np.percentile(ms, 99)),
        "rss_ready_mb": rss_ready,
        "rss_served_mb": rss_served,
    }


def _video_source(model: Path, video: Path, repeats: int, window_s: float) -> dict[str, float]:
    from edge_agent.agent import Agent
    from edge_agent.settings import AgentSettings, CameraSource
    from edge_agent.testing import MemoryPublisher

    with tempfile.TemporaryDirectory() as tmp:
        settings = AgentSettings(
            data_dir=Path(tmp),
            model_path=model,
            fleet="bench",
            agent_id="bench-video",
            max_batch=MAX_BATCH,
            max_wait_ms=2.0,
            cameras=[CameraSource(name="video", uri=str(video), max_fps=10_000.0)],
        )
        with Agent(settings, publisher=MemoryPublisher(auto_receipt=True)) as agent:
            time.sleep(1.0)  # past the first frames
            rates = []
            for _ in range(repeats):
                start_frames, start = agent.telemetry.frames_total, time.perf_counter()
                time.sleep(window_s)
                rates.append(
                    (agent.telemetry.frames_total - start_frames) / (time.perf_counter() - start)
                )
            snap = agent.telemetry.snapshot()
            dropped = agent.status()["dropped_frames"]
    return {
        "video_fps": statistics.median(rates),
        "video_p50_ms": snap["latency_p50_ms"] or 0.0,
        "video_p99_ms": snap["latency_p99_ms"] or 0.0,
        "video_dropped": float(dropped),
    }


def _raw_video(model: Path, video: Path, n: int, repeats: int) -> float:
    """Raw ORT on the same video: read with OpenCV, convert, resize, batch, run."""
    from edge_agent.engine import EngineOptions, OrtEngine
    from edge_agent.imaging import resize_for_model

    engine = OrtEngine(model, EngineOptions(warmup_runs=2, warmup_batch=MAX_BATCH))

    def loop() -> None:
        capture = cv2.VideoCapture(str(video))
        batch: list[np.ndarray] = []
        for _ in range(n):
            ok, frame = capture.read()
            if not ok:
                capture.set(cv2.CAP_PROP_POS_FRAMES, 0)
                ok, frame = capture.read()
            rgb = cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
            batch.append(resize_for_model(rgb, engine.input_hw))
            if len(batch) == MAX_BATCH:
                engine.run(np.stack(batch))
                batch = []
        capture.release()

    return n / median_seconds(loop, repeats=repeats)


def run(quick: bool = False) -> dict[str, Any]:
    repeats = 5
    n_frames = 96 if quick else 256
    window_s = 1.5 if quick else 3.0
    figures: dict[str, Any] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        jpegs = _frames(n_frames)
        video = _video(workdir / "clip.avi", jpegs[:64])
        for label, model in _models(workdir):
            raw = _raw(model, jpegs, repeats)
            raw_video = _raw_video(model, video, n_frames, repeats)
            http = _http(model, jpegs, repeats, workdir / "http")
            vid = _video_source(model, video, repeats, window_s)
            result = {**raw, "raw_video_fps": raw_video, **http, **vid}
            result["http_vs_raw"] = http["http_fps"] / raw["raw_fps"]
            result["http_vs_raw_decode"] = http["http_fps"] / raw["raw_decode_fps"]
            result["video_vs_raw"] = vid["video_fps"] / raw["raw_fps"]
            result["video_vs_raw_video"] = vid["video_fps"] / raw_video
            figures[label] = {k: round(v, 3) for k, v in result.items()}
            rows.append(
                [
                    label,
                    raw["raw_fps"],
                    raw["raw_decode_fps"],
                    http["http_fps"],
                    result["http_vs_raw"],
                    result["http_vs_raw_decode"],
                    http["http_p50_ms"],
                    http["http_p99_ms"],
                    raw_video,
                    vid["video_fps"],
                    result["video_vs_raw_video"],
                    vid["video_p50_ms"],
                    vid["video_p99_ms"],
                    http["rss_served_mb"],
                ]
            )
    table = markdown_table(
        [
            "model",
            "raw ORT fps (tensors)",
            "raw ORT fps (JPEG decode+resize)",
            "agent HTTP fps",
            "HTTP / raw",
            "HTTP / raw+decode",
            "HTTP p50 ms",
            "HTTP p99 ms",
            "raw ORT fps (video read)",
            "agent video fps",
            "video / raw video",
            "video p50 ms",
            "video p99 ms",
            "agent RSS MB",
        ],
        rows,
    )
    note = (
        f"max_batch={MAX_BATCH}, {CLIENTS} concurrent HTTP clients in the bench process, "
        f"{n_frames} 320x240 JPEG frames per repeat, medians of {repeats} repeats; "
        "ORT threads at its default (one per core); agent routing at its defaults."
    )
    return {"figures": figures, "tables": [table, note]}
