"""Model delivery: hot swaps under continuous HTTP load; errors, p99 during swaps, swap time.

An agent (in this process) serves ``POST /v1/frames`` on its HTTP API while client
threads post camera-like JPEGs at a fixed target rate (200 frames/s, open loop: a
request is due at its slot whether or not the previous one answered). Meanwhile
the cloud's API (in this process too, real uvicorn) registers new versions, and
each is announced to the agent, which verifies, downloads it over HTTP, loads it
on its updater thread, checks the golden inputs and swaps between two batches.

Reported: frames answered and failed (must be 0), the achieved rate, p99 latency
of the requests sent while a swap was in progress (announcement to active, plus
0.5 s) against the rest (steady state), and how long each swap took. Everything
shares the machine's cores (clients, agent, cloud), so the figures are a floor.
"""

from __future__ import annotations

import concurrent.futures
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import cv2
import httpx
import numpy as np

from bench.common import markdown_table

TARGET_FPS = 200.0
CLIENTS = 16


def _frames(n: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        noise = rng.integers(0, 255, (120, 160, 3), dtype=np.uint8)
        pixels = cv2.GaussianBlur(noise, (5, 5), 2 + i % 3)
        ok, buf = cv2.imencode(".jpg", pixels)
        assert ok
        out.append(buf.tobytes())
    return out


def _p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if values else None


def run(quick: bool = False) -> dict[str, Any]:
    from cloud_service import registry
    from edge_agent.sources.http import ApiServer
    from edge_agent.sources.http import create_app as agent_app
    from edge_agent.testing import MemoryPublisher, make_tiny_student
    from simulations.stack import Stack

    duration = 12.0 if quick else 30.0
    swaps = 3 if quick else 6
    size, channels = 64, 16
    work = Path(tempfile.mkdtemp(prefix="bench-delivery-"))
    models = [
        make_tiny_student(
            work / f"v{i}.onnx", size=size, channels=channels, seed=i, version=f"v{i}"
        )
        for i in range(swaps + 1)
    ]
    # The cloud's API alone (no broker: announcements are handed to the agent here),
    # and one agent enrolled on it, answering frames over its own HTTP API.
    stack = Stack(
        work,
        broker=None,
        verifier=None,
        api="in-process",
        student=models[0],
        fleet="bench",
        cloud={"admin_token": "bench-admin-token", "blob_fsync": False, "rollout_tick_s": 0},
        edge={
            "intra_op_threads": 1,
            "max_batch": 8,
            "max_wait_ms": 2.0,
            "route_max_prob_below": None,
            "audit_share": 0.0,
            "heartbeat_s": 60.0,
        },
        name="bench-delivery",
    )
    frames = _frames(32)
    latencies: list[tuple[float, float]] = []  # (sent at, seconds)
    errors: list[str] = []
    lock = threading.Lock()
    swap_windows: list[tuple[float, float]] = []
    with stack:
        state = stack.state
        with state.sessions.begin() as session:
            announcements = [
                registry.register_model(
                    session=session, blobs=state.blobs, key=state.signing_key, artifact=path
                ).announcement
                for path in models[1:]
            ]
        publisher = MemoryPublisher()
        with (
            stack.agent("agent-1", publisher=publisher, start_sources=False) as agent,
            ApiServer(agent_app(agent)) as agent_server,
        ):
            url = f"{agent_server.url}/v1/frames"
            start = time.perf_counter() + 0.5
            total = int(duration * TARGET_FPS)

            def client(index: int) -> None:
                with httpx.Client(timeout=10.0) as http:
                    for slot in range(index, total, CLIENTS):
                        due = start + slot / TARGET_FPS
                        delay = due - time.perf_counter()
                        if delay > 0:
                            time.sleep(delay)
                        sent = time.perf_counter()
                        try:
                            response = http.post(
                                url,
                                content=frames[slot % len(frames)],
                                headers={"Content-Type": "image/jpeg"},
                            )
                            ok = response.status_code == 200
                            problem = None if ok else f"{response.status_code}"
                        except httpx.HTTPError as exc:
                            problem = type(exc).__name__
                        with lock:
                            if problem is None:
                                latencies.append((sent, time.perf_counter() - sent))
                            else:
                                errors.append(problem)

            def swapper() -> None:
                gap = duration / (swaps + 1)
                for index, raw in enumerate(announcements):
                    time.sleep(max(0.0, start + gap * (index + 1) - time.perf_counter()))
                    began = time.perf_counter()
                    before = agent.updater.last_result
                    publisher.deliver(agent.updater.topic_fleet, raw)
                    deadline = began + 30
                    while agent.updater.last_result is before and time.perf_counter() < deadline:
                        time.sleep(0.005)
                    swap_windows.append((began, time.perf_counter()))

            with concurrent.futures.ThreadPoolExecutor(CLIENTS + 1) as pool:
                jobs = [pool.submit(client, i) for i in range(CLIENTS)]
                jobs.append(pool.submit(swapper))
                for job in jobs:
                    job.result()
            elapsed = time.perf_counter() - start
            final_version = agent.engine.version
            installs = agent.updater.installs

    def in_swap(sent: float) -> bool:
        return any(a <= sent <= b + 0.5 for a, b in swap_windows)

    during = [lat * 1e3 for sent, lat in latencies if in_swap(sent)]
    steady = [lat * 1e3 for sent, lat in latencies if not in_swap(sent)]
    p99_during, p99_steady = _p99(during), _p99(steady)
    ratio = p99_during / p99_steady if p99_during and p99_steady else None
    swap_ms = [(b - a) * 1e3 for a, b in swap_windows]
    figures = {
        "target_fps": TARGET_FPS,
        "achieved_fps": round(len(latencies) / elapsed, 1),
        "frames_answered": len(latencies),
        "errors": len(errors),
        "swaps": len(swap_windows),
        "installs": installs,
        "final_version": final_version,
        "p99_steady_ms": p99_steady,
        "p99_during_swap_ms": p99_during,
        "p99_ratio": ratio,
        "p50_steady_ms": float(np.median(steady)) if steady else None,
        "swap_ms_median": float(np.median(swap_ms)) if swap_ms else None,
        "swap_ms_max": max(swap_ms) if swap_ms else None,
        "model_input": f"{size}x{size}, {channels} channels",
        "clients": CLIENTS,
    }
    table = markdown_table(
        ["figure", "value"],
        [[key, value] for key, value in figures.items()],
    )
    return {"figures": figures, "tables": [table]}
