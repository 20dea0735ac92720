"""Edge agent: throughput against the raw ONNX Runtime session, latency, resident memory.

    python -m bench.run --only agent        # or: python -m bench.agent [--quick] [--no-video]

Side by side on the same frames and the same session and thread settings, the raw
loops in the ORT layout they run fastest in (``fastest_layout``: one batch at a time
on ORT's intra-op threads, one per core; or a batch per core at once, each on one
thread, the agent's ``inference_threads``), the agent in the one ``edge-agent tune``
picks for it of the same two on the same frames or clip (``agent_layout``; the two
can differ where the raw loops tie):

* raw ORT on the same JPEG frames (camera-like 320x240 frames; for the detector,
  scenes of the scenario it was trained on, at its input size, which it forwards
  at the rate a deployed detector would), decoding with the agent's own
  ``decode_for_model`` on as many threads as the agent decodes with, overlapping
  inference, or, with several batches at once, by each inference thread for its own
  batch, as the agent decodes uploads then (whichever runs faster), and OpenCV's own
  threads as the agent sets them (``opencv_threads``) (the goal's baseline); for
  information, the same decode on one thread,
  and the session alone on frames decoded beforehand (the ceiling);
* the agent behind its HTTP API: ``edge-agent run`` in a subprocess, driven by a
  one-thread load generator in another process over keep-alive connections, so
  the client costs little CPU (its share is reported). Its forwarded samples go
  through the local Mosquitto to a stand-in for the verifier in a third process
  (``_CloudAnswers``: a receipt per agent every 50 ms, at most 100 ids each, and
  the verdicts in batches of at most 100, as the verifier sends them; its CPU share
  is reported);
* the agent reading a video file in a loop (in process, no clients), against raw
  ORT reading the same file. Its forwarded samples go to the same stand-in, in
  process in place of the broker link.

Either way the agent pays for its whole side of delivery (the envelope, the spool,
publishing, and handling every receipt and verdict: deleting from the spool,
storing the verdict), and not for the cloud's.

The raw loops and the HTTP bursts alternate round by round, so a noisy host slows
both sides of a ratio alike; CPU milliseconds per frame (agent process vs raw loop)
are reported too, as they depend much less on what else the host runs.

The agent runs with its task's default routing and forwards to the local Mosquitto
when one answers (otherwise it spools, and no stand-in answers); twins with routing
off and with every frame forwarded tell the forward path's cost per forwarded sample.
The models: the tiny test student scaled up to a camera-sized input (224x224, 48
channels), and, when built in the model cache, the reference detector's INT8 student
(320x320) and the 64 px reference INT8 classifier (information only: its inference
costs about 0.05 ms, so its ratio measures the interpreter around it).
Resident memory is the RSS of the ``edge-agent run`` process with the student
loaded, after serving.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import logging
import multiprocessing
import os
import queue
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import cv2
import httpx
import numpy as np
import psutil

from bench.common import Scrape, by_stage, markdown_table, ready, scrape
from edge_agent.tuning import candidate_layouts, connect, receive_answer, upload_request
from shared.topics import Topics

log = logging.getLogger(__name__)

MAX_BATCH = 8


@dataclass(frozen=True)
class Layout:
    """How inference spreads over the cores, for the agent and every baseline alike:
    ORT's intra-op threads per session run, and the batches inferred at once (each on
    its own thread; the agent's ``inference_threads``)."""

    intra_op_threads: int  # 0: ORT's default, one per core
    inference_threads: int
    pinned: bool = False  # each inference thread on a core of its own
    # The raw loop only: each inference thread decodes its own batch's JPEGs (as the
    # agent does with several), not decode threads ahead of it.
    decode_inline: bool = False

    @property
    def clients(self) -> int:
        """Keep-alive connections that keep the agent busy: a batch's worth for each batch
        inferred at once, and one more batch's queued meanwhile."""
        return (self.inference_threads + 1) * MAX_BATCH

    @property
    def label(self) -> str:
        intra = self.intra_op_threads or "one per core"
        pinned = ", pinned" if self.pinned else ""
        inline = ", each decoding its own" if self.decode_inline else ""
        return f"{self.inference_threads} at once{pinned} x {intra} intra-op{inline}"


CORES = os.cpu_count() or 1
# One batch at a time on every core (ORT's parallel operators), or a batch per core,
# each on one thread (no hand-offs inside an operator), free to move or each pinned to
# its core. Which is faster depends on the model: each model is measured in the layout
# its raw loop runs fastest in.
LAYOUTS = tuple(
    Layout(candidate.intra_op_threads, candidate.inference_threads, candidate.pinned)
    for candidate in candidate_layouts(CORES, [MAX_BATCH])
)
DEFAULT_LAYOUT = LAYOUTS[0]
# The raw JPEG loop's candidates: each layout with decode threads ahead of inference,
# and, with several batches at once, each inference thread decoding its own batch.
RAW_JPEG_LAYOUTS = LAYOUTS + tuple(
    Layout(layout.intra_op_threads, layout.inference_threads, layout.pinned, decode_inline=True)
    for layout in LAYOUTS
    if layout.inference_threads > 1
)
SPINNING = os.environ.get("BENCH_ORT_SPINNING", "0") == "1"  # the agent's ort_spinning
DECODE_THREADS = 2  # the agent's http_decode_threads, and the baseline's decode threads
# The agent's routing in each run: its defaults; off (nothing forwarded: no
# low-confidence rule of either task, no audit samples); every frame forwarded (as audit
# samples). Off against all tells the forward path's cost per forwarded sample (goal 2).
ROUTING: dict[str, dict[str, Any]] = {
    "defaults": {},
    "off": {
        "route_max_prob_below": 0.0,
        "route_mean_score_below": 0.0,
        "route_low_share_above": 1.0,
        "empty_audit_share": 0.0,
        "audit_share": 0.0,
    },
    "all": {"audit_share": 1.0},
}
TOPIC_PREFIX = "edgeloop-bench/v1"
FLEET = "bench"
# The HTTP bench's agents by routing; the stand-in cloud answers those that forward.
HTTP_AGENTS = {
    "defaults": "bench-agent",
    "off": "bench-agent-unforwarded",
    "all": "bench-agent-forward-all",
}
# Goal 3's models: a camera-sized student (input >= this side); smaller ones are information.
CAMERA_SIZED = 224


_NO_BROKER = "mqtt://127.0.0.1:9"  # nothing there: the agent spools and keeps answering


def _broker_url() -> str:
    try:
        with socket.create_connection(("127.0.0.1", 1883), timeout=0.3):
            return "mqtt://127.0.0.1:1883"
    except OSError:
        return _NO_BROKER


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


def _scene_frames(n: int, side: int) -> list[bytes] | None:
    """JPEG frames of the reference detection scenario at ``side`` (its test split, in
    a loop): what a detector trained on them sees on its cameras. None without distill."""
    try:
        from distill.detector_cache import reference_scenario
        from distill.scenes import render_scenes
    except ImportError:
        return None
    scenes = render_scenes("test", reference_scenario(side)).frames
    out = []
    for i in range(n):
        ok, buf = cv2.imencode(".jpg", cv2.cvtColor(scenes[i % len(scenes)], cv2.COLOR_RGB2BGR))
        assert ok
        out.append(buf.tobytes())
    return out


def _frames_for(task: str, side: int, n: int) -> tuple[list[bytes], str]:
    """The frames a model is measured on, and what they are: a detector's own scenes
    (synthetic gradients are out of its domain, and it forwards a third to over half of
    them to the teacher: a measure of its routing, not of the agent), else camera-like
    320x240 frames."""
    if task == "detection":
        scenes = _scene_frames(n, side)
        if scenes is not None:
            return scenes, f"{side}x{side} scenes of its reference scenario"
    return _frames(n), "320x240 camera-like frames"


def _video(path: Path, frames: list[bytes]) -> Path:
    images = []
    for data in frames:
        image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        assert image is not None
        images.append(image)
    h, w = images[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), 30.0, (w, h))
    for image in images:
        writer.write(image)
    writer.release()
    return path


def _models(workdir: Path) -> list[tuple[str, Path]]:
    """The students the agent is measured with: a 224x224 classifier (the tiny test
    student scaled up), the reference detector's INT8 student at its input size and the
    64 px reference classifier's (information), each when built here."""
    from edge_agent.testing import make_tiny_student

    models = [
        (
            "tiny-student 224px",
            make_tiny_student(workdir / "student.onnx", size=224, channels=48),
        )
    ]
    try:
        from distill.cache import reference_model_path
        from distill.detector_cache import reference_detector_path
    except ImportError:  # distill not installed: the tiny student alone
        return models
    lookups: list[tuple[str, Callable[..., Path]]] = [
        ("detector student int8", reference_detector_path),
        ("reference student int8", reference_model_path),
    ]
    for label, lookup in lookups:
        for quick in (False, True):  # the full pair when built, else the quick one
            try:
                path = lookup("student-int8", quick=quick)
            except Exception:  # ModelError: not built in this cache
                continue
            models.append((f"{label}{' (quick)' if quick else ''}", path))
            break
    return models


@functools.lru_cache(maxsize=16)
def _model_info(model: Path) -> tuple[str, int]:
    """A student's task and input side, from its ONNX file (read once per file)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    task = session.get_modelmeta().custom_metadata_map.get("edgeloop.task", "classification")
    return task, int(session.get_inputs()[0].shape[1])


def _decode(jpeg: bytes, hw: tuple[int, int]) -> np.ndarray:
    """The agent's own upload decode (limits, JPEG DCT reduction, resize, RGB)."""
    from edge_agent.imaging import decode_for_model

    return decode_for_model(jpeg, hw, max_bytes=10**7, max_pixels=10**8).tensor


def _decode_batch(jpegs: list[bytes], hw: tuple[int, int]) -> np.ndarray:
    """The agent's upload decode as its inference threads run it (``MicroBatcher``):
    each upload checked, then decoded into its slot of the batch."""
    from edge_agent.imaging import check_upload_cost, model_tensor

    batch = np.empty((len(jpegs), *hw, 3), np.uint8)
    for slot, jpeg in zip(batch, jpegs, strict=True):
        info, _cost = check_upload_cost(jpeg, max_bytes=10**7, max_pixels=10**8)
        model_tensor(jpeg, info, hw, slot)
    return batch


def _engine(model: Path, layout: Layout) -> Any:
    from edge_agent.engine import EngineOptions, OrtEngine

    return OrtEngine(
        model,
        EngineOptions(
            intra_op_threads=layout.intra_op_threads,
            spinning=SPINNING,
            warmup_runs=2,
            warmup_batch=MAX_BATCH,
        ),
    )


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    cpu, start = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def _infer_all(
    engine: Any,
    batches: Iterator[Any],
    layout: Layout,
    prepare: Callable[[Any], np.ndarray] | None = None,
) -> None:
    """Run every batch of ``batches`` on ``layout``'s inference threads as the agent
    infers: one thread at a time takes the next batch, the others infer theirs
    meanwhile (one: in order on this thread), each pinned to a core of its own where
    the layout pins them. With ``prepare``, the thread that took a batch makes it
    (``prepare(item)``) before inferring it."""
    from edge_agent.batcher import pin_to_core

    threads = layout.inference_threads
    if threads == 1:
        for batch in batches:
            engine.run(batch if prepare is None else prepare(batch))
        return
    taking = threading.Lock()

    def runner(index: int) -> None:
        if layout.pinned:
            pin_to_core(index)
        while True:
            with taking:
                batch = next(batches, None)
            if batch is None:
                return
            engine.run(batch if prepare is None else prepare(batch))

    runners = [threading.Thread(target=runner, args=(i,), name="raw-infer") for i in range(threads)]
    for thread in runners:
        thread.start()
    for thread in runners:
        thread.join()


def _raw_loops(
    model: Path, jpegs: list[bytes], layout: Layout = DEFAULT_LAYOUT
) -> dict[str, Callable[[], object]]:
    """Raw ORT loops on the same frames, with the same session options as the agent.

    ``raw_decode``, the goal's baseline: the agent's decode+resize on as many threads
    as the agent decodes with, overlapping inference, or, in a layout that decodes
    inline, by each inference thread for its own batch; ``serial``: decode then run,
    on one thread; ``tensors``: frames decoded beforehand (the ceiling).
    """
    engine = _engine(model, layout)
    hw = engine.input_hw
    tensors = [_decode(j, hw) for j in jpegs]
    pool = concurrent.futures.ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="raw-decode")

    def tensors_only() -> None:
        for i in range(0, len(tensors), MAX_BATCH):
            engine.run(np.stack(tensors[i : i + MAX_BATCH]))

    def serial() -> None:
        for i in range(0, len(jpegs), MAX_BATCH):
            engine.run(np.stack([_decode(j, hw) for j in jpegs[i : i + MAX_BATCH]]))

    def pipelined() -> None:
        decoded = [pool.submit(_decode, j, hw) for j in jpegs]
        batches = (
            np.stack([f.result() for f in decoded[i : i + MAX_BATCH]])
            for i in range(0, len(jpegs), MAX_BATCH)
        )
        _infer_all(engine, batches, layout)

    def inline() -> None:
        starts = iter(range(0, len(jpegs), MAX_BATCH))
        _infer_all(engine, starts, layout, lambda i: _decode_batch(jpegs[i : i + MAX_BATCH], hw))

    return {
        "raw_decode": inline if layout.decode_inline else pipelined,
        "raw_decode_serial": serial,
        "raw": tensors_only,
    }


def _write_config(
    workdir: Path, model: Path, port: int, layout: Layout, *, routing: str = "defaults"
) -> Path:
    """``edge-agent run``'s config for the HTTP bench, with routing ``ROUTING[routing]``."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "agent.toml"
    agent_id = HTTP_AGENTS[routing]
    config.write_text(
        f'data_dir = "{workdir}"\nmodel_path = "{model}"\nhttp_port = {port}\n'
        f'mqtt_url = "{_broker_url()}"\nfleet = "{FLEET}"\nagent_id = "{agent_id}"\n'
        f"max_batch = {MAX_BATCH}\nmax_wait_ms = 2.0\nheartbeat_s = 5.0\n"
        f"intra_op_threads = {layout.intra_op_threads}\n"
        f"inference_threads = {layout.inference_threads}\n"
        f"pin_inference_threads = {str(layout.pinned).lower()}\n"
        f"http_decode_threads = {DECODE_THREADS}\n"
        f"ort_spinning = {str(SPINNING).lower()}\n"
        'log_level = "WARNING"\n'
        + "".join(f"{k} = {v}\n" for k, v in ROUTING[routing].items())
        + f'topic_prefix = "{TOPIC_PREFIX}"\n'
    )
    return config


# --- the load generator: its own process, one thread, keep-alive sockets -------------


def _burst(socks: list[socket.socket], requests: list[bytes]) -> tuple[list[float], int]:
    """Send every request over the connections, one in flight on each; latencies, errors."""
    selector = selectors.DefaultSelector()
    total = len(requests)
    sent = 0
    latencies: list[float] = []
    errors = 0
    buffers: dict[socket.socket, bytearray] = {}
    started: dict[socket.socket, float] = {}

    def send(sock: socket.socket) -> None:
        nonlocal sent
        started[sock] = time.perf_counter()
        sock.sendall(requests[sent])
        sent += 1

    for sock in socks[:total]:
        buffers[sock] = bytearray()
        selector.register(sock, selectors.EVENT_READ, sock)
        send(sock)
    while len(latencies) < total:
        for key, _ in selector.select():
            sock = key.data
            answered = receive_answer(sock, buffers[sock])
            if answered is None:
                continue
            latencies.append(time.perf_counter() - started[sock])
            errors += not answered
            if sent < total:
                send(sock)
    selector.close()
    return latencies, errors


def _client_main(jpegs: list[bytes], concurrency: int, conn: Connection) -> None:
    """Child process: answer each ``("burst", port)`` with (seconds, latencies, errors, cpu_s).

    Each burst opens its connections afresh (the agent closes idle keep-alive
    connections while the raw loops run) and keeps them alive through the burst.
    """
    requests: dict[int, list[bytes]] = {}
    conn.send("ready")
    while (message := conn.recv())[0] == "burst":
        port = message[1]
        if port not in requests:
            requests[port] = [upload_request(port, j) for j in jpegs]
        cpu, start = time.process_time(), time.perf_counter()
        socks = [connect(port) for _ in range(concurrency)]
        try:
            latencies, errors = _burst(socks, requests[port])
        finally:
            for sock in socks:
                sock.close()
        conn.send((time.perf_counter() - start, latencies, errors, time.process_time() - cpu))


# --- the bare HTTP server: the HTTP layer alone, under the same load -----------------


def _bare_answer() -> bytes:
    """An answer's JSON as the agent sends it (ten scores), for the bare server."""
    from edge_agent.agent import FrameResult
    from shared.ids import new_sample_id

    scores = [0.01] * 10
    scores[3] = 0.91
    result = FrameResult(
        sample_id=new_sample_id(),
        label="3",
        predicted=3,
        scores=scores,
        confidence=0.91,
        forwarded=False,
        route_reason=None,
        priority=0,
        over_budget=False,
        latency_ms=2.5,
        model_name="student",
        model_version="1",
        source="http",
    )
    return json.dumps(result.as_dict()).encode()


def bare_app(answer: bytes) -> Callable[..., Any]:
    """An ASGI app that reads each request's body whole and answers ``answer`` (JSON):
    what serving HTTP costs before any decoding, inference or routing."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(answer)).encode()),
    ]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    return app


class BareRoute:
    """The agent's frame uploads as its server's protocol takes them
    (``shared.http_server.RawRoute``), answered at once with ``answer``."""

    path = b"/v1/frames"
    max_bytes = 1 << 24

    def __init__(self, answer: bytes) -> None:
        self.answer = answer

    def accepts(self, headers: Any) -> bool:
        return (b"content-type", b"image/jpeg") in headers

    def handle(self, body: bytes, respond: Callable[..., None]) -> None:
        respond(200, self.answer, ())


def _bare_main(conn: Connection) -> None:
    """Child process: the bare app behind the agent's own server (``ApiServer``: the same
    uvicorn settings, and its uploads taken by the protocol as the agent's are); sends
    its port, serves until told to stop."""
    from edge_agent.sources.http import ApiServer

    answer = _bare_answer()
    with ApiServer(bare_app(answer), raw_route=BareRoute(answer)) as server:
        conn.send(server.port)
        conn.recv()


def _answer(conn: Connection, client: Any, timeout: float = 300.0) -> Any:
    """The load generator's next message; raise if it died or went silent."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.5):
        if not client.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the load generator stopped without answering")
    return conn.recv()


def _cloud_count(conn: Connection, cloud: Any) -> tuple[int, float]:
    """(samples answered, CPU seconds) of the stand-in cloud so far; zeros without one."""
    if cloud is None:
        return 0, 0.0
    conn.send("count")
    samples, cpu = _answer(conn, cloud)
    return int(samples), float(cpu)


def _start_agent(
    model: Path, workdir: Path, layout: Layout, *, routing: str = "defaults"
) -> tuple[Any, int]:
    """``edge-agent run`` in a subprocess on a free port: (process, port)."""
    from shared.broker import free_port

    port = free_port()
    config = _write_config(workdir, model, port, layout, routing=routing)
    process = subprocess.Popen(
        [sys.executable, "-m", "edge_agent.cli", "run", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return process, port


def _wait_ready(process: Any, port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready(port):
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError("edge-agent run did not become ready")
        time.sleep(0.1)


def _http(
    model: Path,
    jpegs: list[bytes],
    repeats: int,
    workdir: Path,
    layout: Layout = DEFAULT_LAYOUT,
    served: Layout | None = None,
) -> dict[str, float]:
    """The agent behind HTTP and the raw loops, interleaved round by round (a noisy host
    then slows both sides of each ratio alike); medians over the rounds. The raw loops
    run in ``layout``, the agents in ``served`` (default: the same).

    Each round also sends a burst to the agent's twins with routing off (nothing
    forwarded) and with every frame forwarded, and to a bare server (``BareRoute``: the
    same uvicorn settings and upload path, no decoding, inference or routing), to tell
    the HTTP layer's and the forward path's costs from the rest of the agent's.
    """
    task, _side = _model_info(model)
    raw_loops = _raw_loops(model, jpegs, layout)
    served = served or layout
    agent_process, agent_port = _start_agent(model, workdir / "agent", served)
    twin_process, twin_port = _start_agent(model, workdir / "unforwarded", served, routing="off")
    all_process, all_port = _start_agent(model, workdir / "forward-all", served, routing="all")
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    client: Any = None
    cloud: Any = None
    cloud_parent, cloud_child = context.Pipe()
    bare_parent, bare_child = context.Pipe()
    bare = context.Process(target=_bare_main, args=(bare_child,), name="bench-bare-http")
    rounds: list[dict[str, float]] = []
    latencies: list[float] = []
    try:
        bare.start()
        bare_port = int(_answer(bare_parent, bare))
        _wait_ready(agent_process, agent_port)
        _wait_ready(twin_process, twin_port)
        _wait_ready(all_process, all_port)
        agent = psutil.Process(agent_process.pid)
        servers = {
            "http": (agent, agent_port),
            "http_unforwarded": (psutil.Process(twin_process.pid), twin_port),
            "http_forward_all": (psutil.Process(all_process.pid), all_port),
            "bare_http": (psutil.Process(bare.pid), bare_port),
        }
        broker = _broker_url()
        if broker != _NO_BROKER:  # the stand-in cloud answers the samples the agent forwards
            cloud = context.Process(
                target=_cloud_main,
                args=(
                    broker,
                    FLEET,
                    [HTTP_AGENTS["defaults"], HTTP_AGENTS["all"]],
                    task == "detection",
                    cloud_child,
                ),
                name="bench-cloud",
            )
            cloud.start()
            if _answer(cloud_parent, cloud) != "ready":
                raise RuntimeError("the stand-in cloud did not start")
        client = context.Process(
            target=_client_main, args=(jpegs, served.clients, child), name="bench-load"
        )
        client.start()
        if _answer(parent, client) != "ready":
            raise RuntimeError("the load generator did not start")
        for loop in raw_loops.values():
            loop()
        n = len(jpegs)
        cores = os.cpu_count() or 1
        twins = ("http_unforwarded", "http_forward_all")
        twin_cpu: dict[str, float] = {}
        for i in range(repeats + 1):  # the first round warms up
            if i == 1:  # goal 2 counts the twins' CPU from here, until their work settles
                if cloud is not None:
                    _settle(all_port)
                twin_cpu = {key: sum(servers[key][0].cpu_times()[:2]) for key in twins}
            raw_timed = {name: _timed(loop) for name, loop in raw_loops.items()}
            raw_s = {name: wall for name, (wall, _) in raw_timed.items()}
            raw_cpu_ms = raw_timed["raw_decode"][1] / n * 1e3
            figures = {f"{name}_fps": n / raw for name, raw in raw_s.items()}
            figures["raw_decode_cpu_ms_per_frame"] = raw_cpu_ms
            for key, (server, port) in servers.items():
                answers_cloud = key == "http"  # the stand-in answers only this agent
                metrics = [f"http://127.0.0.1:{port}/metrics"]
                threads = scrape(metrics) if answers_cloud else Scrape()
                server_cpu = sum(server.cpu_times()[:2])
                cloud_cpu = _cloud_count(cloud_parent, cloud)[1] if answers_cloud else 0.0
                parent.send(("burst", port))
                seconds, burst, errors, client_cpu = _answer(parent, client)
                server_cpu = sum(server.cpu_times()[:2]) - server_cpu
                if errors:
                    raise RuntimeError(f"{errors} of {n} requests to {key} were not answered 200")
                if answers_cloud:
                    cloud_cpu = _cloud_count(cloud_parent, cloud)[1] - cloud_cpu
                    latencies += burst if i else []
                    figures.update(
                        {f"http_vs_{name}": raw / seconds for name, raw in raw_s.items()}
                    )
                    figures["client_cpu_share"] = client_cpu / (seconds * cores)
                    figures["cloud_cpu_share"] = cloud_cpu / (seconds * cores)
                    figures["agent_cpu_share"] = server_cpu / (seconds * cores)
                    figures["agent_cpu_ms_per_frame"] = server_cpu / n * 1e3
                    used = scrape(metrics).since(threads)
                    figures["http_batch_frames"] = used.batch_frames / max(used.batches, 1.0)
                    stages = by_stage(used.threads)
                    for name, _ in HTTP_THREADS:
                        figures[f"http_cpu_us_{name}"] = stages.get(name, 0.0) / n * 1e6
                else:
                    figures[f"{key}_vs_raw_decode"] = raw_s["raw_decode"] / seconds
                    figures[f"{key}_cpu_ms_per_frame"] = server_cpu / n * 1e3
                    if key == "bare_http":
                        # The HTTP layer's ceiling: the raw loop with the bare server's and
                        # the load client's CPU per request added, as many cores busy.
                        added = (server_cpu + client_cpu) / n * 1e3
                        figures["http_ceiling"] = raw_cpu_ms / (raw_cpu_ms + added)
                figures[f"{key}_fps"] = n / seconds
            if i:
                rounds.append(figures)
        # A forwarded sample's work goes on after its frame is answered (the spool's
        # transactions, publishing, the receipt and the verdict): the twins' CPU is read
        # once the forward-all twin's spool is empty, over every measured round at once.
        if cloud is not None:
            _settle(all_port)
        twin_cpu = {key: sum(servers[key][0].cpu_times()[:2]) - twin_cpu[key] for key in twins}
        parent.send(("stop", 0))
        client.join(10)
        rss_served = agent.memory_info().rss / 2**20
        status = httpx.get(f"http://127.0.0.1:{agent_port}/v1/status", timeout=10).json()
        forward_rate = status["forward_rate"] or 0.0
        status = httpx.get(f"http://127.0.0.1:{all_port}/v1/status", timeout=10).json()
        forward_all_rate = status["forward_rate"] or 0.0
        cloud_samples = _cloud_count(cloud_parent, cloud)[0]
        if cloud is not None:
            cloud_parent.send("stop")
            cloud.join(10)
        bare_parent.send("stop")
        bare.join(10)
    finally:
        for child_process in (client, cloud, bare):
            if child_process is not None and child_process.is_alive():
                child_process.kill()
        for process in (agent_process, twin_process, all_process):
            process.terminate()
            process.wait(20)
    ms = np.array(latencies) * 1e3
    result = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    result.update(
        http_p50_ms=float(np.percentile(ms, 50)),
        http_p99_ms=float(np.percentile(ms, 99)),
        rss_served_mb=rss_served,
        http_forward_rate=forward_rate,
        http_forward_all_rate=forward_all_rate,
        cloud_samples=float(cloud_samples),
    )
    # Goal 2: the agent's CPU per forwarded sample (envelope, spool, publish, receipt,
    # verdict), from the twins that forward every frame and none, over the same rounds,
    # each twin's CPU counted until its forward work had settled.
    frames = n * repeats
    result["http_forward_cpu_ms_per_sample"] = (
        (twin_cpu["http_forward_all"] - twin_cpu["http_unforwarded"])
        / frames
        * 1e3
        / max(forward_all_rate, 1e-9)
    )
    return result


def _settle(port: int, timeout_s: float = 30.0) -> None:
    """Wait until the agent on ``port`` has no sample left in its spool (every forwarded
    sample receipted), then a moment for the verdicts sent with the last receipts."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=10).json()
        if not status["spool"]["depth"]:
            break
        time.sleep(0.05)
    else:
        log.warning("the agent on port %d still spools samples after %.0f s", port, timeout_s)
    time.sleep(0.2)


class _CloudAnswers:
    """What the verifier sends an agent for its forwarded samples, without a verifier.

    A receipt per flush, as the verifier sends them (``receipt_flush_ms`` 50,
    ``receipt_max_ids`` 100), and the flush's verdicts in ``edgeloop.verdicts``
    messages of at most ``verdicts_per_message`` (100), made from one encoded
    template, so the stand-in's own work per sample is small. The agent pays for
    its side of delivery: publishing, the spool, and handling every receipt and
    verdict (decoding, deleting from the spool, storing the verdict).
    """

    FLUSH_S = 0.05
    MAX_IDS = 100

    def __init__(
        self,
        send: Callable[[str, bytes], object],
        topics: Topics,
        fleet: str,
        agent: str,
        *,
        detection: bool = False,
    ) -> None:
        from cloud_service.settings import CloudSettings
        from shared.ids import new_sample_id
        from shared.messages import Verdict, Verdicts, encode_message

        self._send = send
        # As the verifier batches an agent's verdicts, with its default batch size.
        self._per_message = CloudSettings.model_fields["verdicts_per_message"].default
        self._batch_head = b'{"schema":"%s","v":%d,"verdicts":[' % (
            Verdicts.SCHEMA.encode(),
            Verdicts.VERSION,
        )
        self._receipts = topics.receipts(fleet, agent)
        self._verdicts = topics.verdicts(fleet, agent)
        self._template_id = new_sample_id()
        scores = [0.01] * 10
        scores[3] = 0.91
        answer: dict[str, Any] = {"scores": scores, "label": 3}
        if detection:  # a detector's verdict: the teacher's boxes (none, here)
            answer = {"scores": [], "label": 0, "boxes": []}
        self._template = encode_message(
            Verdict(
                sample_id=self._template_id,
                fleet=fleet,
                agent=agent,
                teacher_model="teacher",
                teacher_version="1",
                confidence=0.91,
                agrees_with_edge=True,
                verified_at=datetime.now(UTC),
                **answer,
            )
        )
        self._ids: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-cloud", daemon=True)
        self.samples = 0

    def add(self, envelope: bytes | bytearray) -> None:
        """Note a sample the agent published."""
        from shared.envelope import peek_sample_id  # the stand-in's cost is not the agent's

        sample_id = peek_sample_id(envelope)
        with self._lock:
            self._ids.append(sample_id)
            self.samples += 1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        from shared.messages import Receipt, encode_message

        template_id = self._template_id.encode()
        while not self._stop.wait(self.FLUSH_S):
            with self._lock:
                ids, self._ids = self._ids, []
            for at in range(0, len(ids), self.MAX_IDS):
                chunk = ids[at : at + self.MAX_IDS]
                receipt = Receipt(sample_ids=chunk, stored_at=datetime.now(UTC))
                self._send(self._receipts, encode_message(receipt))
            for at in range(0, len(ids), self._per_message):
                verdicts = b",".join(
                    self._template.replace(template_id, sample_id.encode())
                    for sample_id in ids[at : at + self._per_message]
                )
                self._send(self._verdicts, self._batch_head + verdicts + b"]}")


class _StandInCloud:
    """The agent's Publisher for the video bench: a stand-in for broker and verifier
    that answers every forwarded sample as the verifier does (``_CloudAnswers``), in
    the agent's process."""

    connected = True
    backlog = 0

    def __init__(self, topics: Topics, fleet: str, agent: str, *, detection: bool = False) -> None:
        self._on_message: Callable[[str, bytes], None] | None = None
        self.answers = _CloudAnswers(self._deliver, topics, fleet, agent, detection=detection)

    def set_handlers(
        self, *, on_message: Callable[[str, bytes], None], on_connect: Callable[[], None]
    ) -> None:
        self._on_message = on_message

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        if topic.endswith("/samples"):
            self.answers.add(payload)

    def _deliver(self, topic: str, payload: bytes) -> None:
        assert self._on_message is not None
        self._on_message(topic, payload)

    def start(self) -> None:
        self.answers.start()

    def stop(self) -> None:
        self.answers.stop()


def _cloud_main(
    broker: str, fleet: str, agents: list[str], detection: bool, conn: Connection
) -> None:
    """Child process: the stand-in cloud on the real broker for the HTTP bench, answering
    each of ``agents``."""
    from shared.mqtt import MqttTarget, make_client

    topics = Topics(prefix=TOPIC_PREFIX)
    target = MqttTarget.parse(broker)
    client = make_client(target, client_id=f"bench-cloud-{os.getpid()}")
    client.max_inflight_messages_set(1000)
    client.max_queued_messages_set(0)

    def publish(topic: str, payload: bytes) -> None:
        client.publish(topic, payload, qos=1)

    answers = {
        topics.samples(fleet, agent): _CloudAnswers(
            publish, topics, fleet, agent, detection=detection
        )
        for agent in agents
    }
    client.on_message = lambda _c, _u, message: answers[message.topic].add(message.payload)
    client.connect(target.host, target.port)
    for topic in answers:
        client.subscribe(topic, qos=1)
    client.loop_start()
    for stand_in in answers.values():
        stand_in.start()
    conn.send("ready")
    cpu = time.process_time()
    while conn.recv() != "stop":
        samples = sum(stand_in.samples for stand_in in answers.values())
        conn.send((samples, time.process_time() - cpu))
    for stand_in in answers.values():
        stand_in.stop()
    client.disconnect()
    client.loop_stop()


# The agent's threads by name (numbers dropped), in the order of a frame's path.
AGENT_THREADS = (
    ("camera-video", "camera reader (reads; decodes a stream not read as JPEGs)"),
    ("camera-video-prepare", "preparation (decodes a JPEG at the model's size; shrinks, RGB)"),
    (
        "inference-loop",
        "inference loop (batches, ORT; with several, routing, answers, forwarded samples)",
    ),
    ("native", "ORT and OpenCV worker threads"),
    (
        "agent-post",
        "with one inference thread: routing and answers, a forwarded frame's JPEG and envelope",
    ),
    ("spool-writer", "spool writer (transactions, publishing; one inference thread)"),
    ("bench-cloud", "receipts and verdicts (the agent's handling, on the stand-in's thread)"),
    ("verdict-writer", "verdict writer"),
)


HTTP_THREADS = (
    ("http-api", "HTTP server (requests, answers)"),
    ("http-decode", "decoding (a JPEG at the model's size, RGB)"),
    (
        "inference-loop",
        "inference (batches, ORT, routing, answers; with several, forwarded samples)",
    ),
    ("agent-post", "a forwarded frame's envelope (one inference thread)"),
    ("spool-writer", "spool writer (transactions, publishing; one inference thread)"),
    ("mqtt-io", "MQTT link (receipts, verdicts in)"),
    ("verdict-writer", "verdict writer"),
    ("other", "ORT's and OpenCV's worker threads"),
)


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far, by stage (threads Python did not
    start, such as ORT's and OpenCV's, as "native")."""
    from shared.thread_cpu import OTHER, thread_cpu_seconds

    seconds = thread_cpu_seconds()
    seconds["native"] = seconds.pop(OTHER)
    return by_stage(seconds)


def _video_window(
    model: Path,
    video: Path,
    window_s: float,
    *,
    routing: str = "defaults",
    layout: Layout = DEFAULT_LAYOUT,
) -> dict[str, float]:
    """Start an agent with a camera source on ``video``, time one window, stop it.

    ``routing``: a key of ``ROUTING`` ("off": nothing forwarded, "all": every frame),
    to tell the forward path's cost from the rest of the agent's.
    """
    from edge_agent.agent import Agent
    from edge_agent.settings import AgentSettings, CameraSource

    with tempfile.TemporaryDirectory() as tmp:
        settings = AgentSettings(
            data_dir=Path(tmp),
            model_path=model,
            fleet="bench",
            agent_id="bench-video",
            max_batch=MAX_BATCH,
            max_wait_ms=2.0,
            intra_op_threads=layout.intra_op_threads,
            inference_threads=layout.inference_threads,
            pin_inference_threads=layout.pinned,
            ort_spinning=SPINNING,
            cameras=[CameraSource(name="video", uri=str(video), max_fps=10_000.0)],
            **ROUTING[routing],
        )
        task, _side = _model_info(model)
        cloud = _StandInCloud(
            settings.topics, settings.fleet, settings.agent_id, detection=task == "detection"
        )
        with Agent(settings, publisher=cloud) as agent:
            time.sleep(1.0)  # past the first frames
            start_frames, start = agent.telemetry.frames_total, time.perf_counter()
            cpu, threads = time.process_time(), _thread_cpu()
            time.sleep(window_s)
            frames = agent.telemetry.frames_total - start_frames
            seconds = time.perf_counter() - start
            cpu_s = time.process_time() - cpu
            threads = {k: v - threads.get(k, 0.0) for k, v in _thread_cpu().items()}
            snap = agent.telemetry.snapshot()
            dropped = agent.status()["dropped_frames"]
    per_thread = {
        f"video_cpu_us_{name}": threads.get(name, 0.0) / max(1, frames) * 1e6
        for name, _ in AGENT_THREADS
    }
    return {
        **per_thread,
        "video_fps": frames / seconds,
        "video_p50_ms": snap["latency_p50_ms"] or 0.0,
        "video_p99_ms": snap["latency_p99_ms"] or 0.0,
        "video_dropped": float(dropped),
        "video_cpu_ms_per_frame": cpu_s / max(1, frames) * 1e3,
        "video_forward_rate": snap["forward_rate"] or 0.0,
    }


def _raw_video_loops(
    model: Path, video: Path, n: int, layout: Layout = DEFAULT_LAYOUT
) -> dict[str, Callable[[], object]]:
    """Raw ORT on ``n`` frames of the same video, with the agent's frame preparation.

    ``raw_video`` (the goal's baseline) is laid out as the agent's camera source is:
    one thread reads, one prepares, and the calling thread runs batches, so reading,
    preparing and inference overlap; at most ``2 * MAX_BATCH`` frames are read ahead.
    In a layout that decodes inline, the reader queues the clip's JPEGs and each
    inference thread decodes its own batch, as the camera source has them decoded
    where the agent runs several inference threads.
    It reads the clip as the camera source does: a Motion JPEG clip (the bench's) as
    its JPEGs, each decoded at the model's size as an upload is, any other decoded by
    OpenCV and prepared from BGR. ``raw_video_serial`` (for information) does the same
    work one step after another on one thread.
    """
    from edge_agent.imaging import prepare_bgr
    from edge_agent.sources.camera import jpeg_packets, read_next

    engine = _engine(model, layout)
    hw = engine.input_hw

    def prepare(frame: np.ndarray | bytes) -> np.ndarray:
        if isinstance(frame, bytes):
            return _decode(frame, hw)
        return prepare_bgr(frame, hw)

    last: list[np.ndarray | None] = [None]

    def open_clip() -> tuple[cv2.VideoCapture, bool]:
        capture = cv2.VideoCapture(str(video))
        return capture, jpeg_packets(capture)

    def read(capture: cv2.VideoCapture, jpeg: bool) -> np.ndarray | bytes:
        # As the agent's camera source reads, starting the clip again at its end.
        frame = read_next(capture, last[0], jpeg=jpeg)
        if frame is None:
            capture.set(cv2.CAP_PROP_POS_FRAMES, 0)
            frame = read_next(capture, None, jpeg=jpeg)
        assert frame is not None
        if isinstance(frame, np.ndarray):
            last[0] = frame
        return frame

    def serial() -> None:
        capture, jpeg = open_clip()
        batch: list[np.ndarray] = []
        for _ in range(n):
            batch.append(prepare(read(capture, jpeg)))
            if len(batch) == MAX_BATCH:
                engine.run(np.stack(batch))
                batch = []
        capture.release()

    def pipelined() -> None:
        capture, jpeg = open_clip()
        prepared: queue.Queue[concurrent.futures.Future[np.ndarray] | None] = queue.Queue(
            maxsize=2 * MAX_BATCH
        )
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raw-prep") as preparer:

            def reader() -> None:
                for _ in range(n):
                    prepared.put(preparer.submit(prepare, read(capture, jpeg)))
                prepared.put(None)

            thread = threading.Thread(target=reader, name="raw-read")
            thread.start()
            _infer_all(engine, _batches_of(prepared), layout)
            thread.join()
        capture.release()

    def inline() -> None:
        # As the camera source reads where several inference threads decode their own
        # batches: a reader queues the clip's JPEGs as they are, and the thread that
        # takes a batch decodes it into the batch (an MJPG clip only; else pipelined).
        capture, jpeg = open_clip()
        if not jpeg:
            capture.release()
            pipelined()
            return
        packets: queue.Queue[bytes | None] = queue.Queue(maxsize=2 * MAX_BATCH)

        def reader() -> None:
            for _ in range(n):
                packets.put(read(capture, jpeg))  # type: ignore[arg-type]
            packets.put(None)

        def batches() -> Iterator[list[bytes]]:
            batch: list[bytes] = []
            while (packet := packets.get()) is not None:
                batch.append(packet)
                if len(batch) == MAX_BATCH:
                    yield batch
                    batch = []

        thread = threading.Thread(target=reader, name="raw-read")
        thread.start()
        _infer_all(engine, batches(), layout, lambda batch: _decode_batch(batch, hw))
        thread.join()
        capture.release()

    return {
        "raw_video": inline if layout.decode_inline else pipelined,
        "raw_video_serial": serial,
    }


def _batches_of(
    prepared: queue.Queue[concurrent.futures.Future[np.ndarray] | None],
) -> Iterator[np.ndarray]:
    """Full batches of prepared frames from ``prepared`` until its None."""
    batch: list[np.ndarray] = []
    while (future := prepared.get()) is not None:
        batch.append(future.result())
        if len(batch) == MAX_BATCH:
            yield np.stack(batch)
            batch = []


def _video_rounds(
    model: Path,
    video: Path,
    n: int,
    repeats: int,
    window_s: float,
    layout: Layout = DEFAULT_LAYOUT,
    served: Layout | None = None,
) -> dict[str, float]:
    """The agent's camera source (in layout ``served``, default ``layout``) and the raw
    loops (in ``layout``) on the same clip, round by round.

    Each round times the raw loops on ``n`` frames, then starts an agent on the clip,
    times one window and stops it (then once more with nothing forwarded), so the two
    never share the cores and a noisy host slows both sides of a round alike. Figures
    and ratios (per round) are medians.
    """
    loops = _raw_video_loops(model, video, n, layout)
    served = served or layout
    for loop in loops.values():
        loop()  # warm-up
    rounds: list[dict[str, float]] = []
    for _ in range(repeats):
        figures: dict[str, float] = {}
        for name, loop in loops.items():
            wall, cpu = _timed(loop)
            figures[f"{name}_fps"] = n / wall
            figures[f"{name}_cpu_ms_per_frame"] = cpu / n * 1e3
        figures.update(_video_window(model, video, window_s, layout=served))
        unforwarded = _video_window(model, video, window_s, routing="off", layout=served)
        figures["video_unforwarded_fps"] = unforwarded["video_fps"]
        figures["video_unforwarded_cpu_ms_per_frame"] = unforwarded["video_cpu_ms_per_frame"]
        every = _video_window(model, video, window_s, routing="all", layout=served)
        figures["video_forward_all_cpu_ms_per_frame"] = every["video_cpu_ms_per_frame"]
        figures["video_forward_all_rate"] = every["video_forward_rate"]
        # Goal 2 on video: the CPU per forwarded sample (the frame's JPEG included).
        figures["video_forward_cpu_ms_per_sample"] = (
            every["video_cpu_ms_per_frame"] - unforwarded["video_cpu_ms_per_frame"]
        ) / max(every["video_forward_rate"], 1e-9)
        for name in loops:
            figures[f"video_vs_{name}"] = figures["video_fps"] / figures[f"{name}_fps"]
        figures["video_unforwarded_vs_raw_video"] = (
            figures["video_unforwarded_fps"] / figures["raw_video_fps"]
        )
        rounds.append(figures)
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def _layout_figures(
    section: str, layout: Layout, seconds: dict[str, float], n: int
) -> dict[str, float]:
    """The chosen layout and each layout's raw fps, as figures of ``section``."""
    figures = {
        f"{section}_inference_threads": float(layout.inference_threads),
        f"{section}_intra_op_threads": float(layout.intra_op_threads),
    }
    figures[f"{section}_pinned"] = float(layout.pinned)
    if section == "http":
        figures[f"{section}_raw_decode_inline"] = float(layout.decode_inline)
    for other in RAW_JPEG_LAYOUTS:
        if other.label in seconds:
            key = f"{section}_raw_fps_{other.inference_threads}x{other.intra_op_threads}"
            key += "_pinned" if other.pinned else ""
            key += "_inline" if other.decode_inline else ""
            figures[key] = n / seconds[other.label]
    return figures


def _layout_fps(seconds: dict[str, float], n: int) -> str:
    """Each layout's raw fps in the passes that chose one ("-" when the layout was named)."""
    if not seconds:
        return "-"
    return "; ".join(f"{label}: {n / s:.0f}" for label, s in seconds.items())


def _tuned_fps(fps: dict[str, float]) -> str:
    """Each layout's frames/s in ``edge-agent tune`` ("-" when the layout was named)."""
    return "; ".join(f"{label}: {value:.0f}" for label, value in fps.items()) or "-"


def fastest_layout(
    build: Callable[..., dict[str, Callable[[], object]]],
    *args: Any,
    loop: str,
    rounds: int = 3,
    layouts: tuple[Layout, ...] = LAYOUTS,
) -> tuple[Layout, dict[str, float]]:
    """The layout of ``layouts`` whose raw loop ``build(*args, layout)[loop]`` runs
    fastest, with each layout's median seconds; the layouts alternate round by round
    after one warm-up pass each. A ``BENCH_LAYOUT`` of "intra,threads" (say "1,2")
    names the layout (its first candidate of ``layouts``)."""
    forced = os.environ.get("BENCH_LAYOUT")
    if forced:
        intra, threads = (int(x) for x in forced.split(","))
        named = [
            c for c in layouts if (c.intra_op_threads, c.inference_threads) == (intra, threads)
        ]
        return (named[0] if named else Layout(intra, threads)), {}
    timed = {layout: build(*args, layout)[loop] for layout in layouts}
    for run_once in timed.values():
        run_once()
    seconds: dict[Layout, list[float]] = {layout: [] for layout in layouts}
    for _ in range(rounds):
        for layout, run_once in timed.items():
            seconds[layout].append(_timed(run_once)[0])
    medians = {layout: statistics.median(s) for layout, s in seconds.items()}
    best = min(medians, key=lambda layout: medians[layout])
    return best, {layout.label: medians[layout] for layout in layouts}


def agent_layout(
    model: Path, frames: list[bytes] | Path, *, seconds: float, rounds: int = 3
) -> tuple[Layout, dict[str, float]]:
    """The layout ``edge-agent tune`` picks for the agent on ``model`` and ``frames`` (its
    whole pipeline, the task's default routing; JPEGs as uploads, a clip read as a camera
    is), with each layout's frames/s. The raw loops tie between layouts on some models
    while the agent does not: each side is measured in its own fastest. ``BENCH_LAYOUT``
    names one layout for both."""
    from edge_agent.settings import AgentSettings
    from edge_agent.tuning import tune

    forced = os.environ.get("BENCH_LAYOUT")
    if forced:
        intra, threads = (int(x) for x in forced.split(","))
        return Layout(intra, threads), {}
    with tempfile.TemporaryDirectory() as tmp:
        settings = AgentSettings(
            data_dir=Path(tmp),
            model_path=model,
            fleet=FLEET,
            agent_id="bench-tune",
            mqtt_url=_NO_BROKER,
            max_batch=MAX_BATCH,
            max_wait_ms=2.0,
            http_decode_threads=DECODE_THREADS,
            ort_spinning=SPINNING,
        )
        trials = tune(
            settings,
            frames,
            layouts=candidate_layouts(CORES, [MAX_BATCH]),
            seconds=seconds,
            rounds=rounds,
        )
    fps = {
        Layout(t.layout.intra_op_threads, t.layout.inference_threads, t.layout.pinned).label: (
            t.frames_per_s
        )
        for t in trials
    }
    best = trials[0].layout
    return Layout(best.intra_op_threads, best.inference_threads, best.pinned), fps


CAMERA_SIZES = ((320, 240), (640, 480), (1280, 720), (1920, 1080))


def frame_preparation(hw: tuple[int, int] = (64, 64), repeats: int = 7) -> list[list[Any]]:
    """CPU microseconds to shrink a BGR camera frame to the model's input: the agent's
    ``prepare_bgr`` against one OpenCV area resize and colour conversion (medians)."""
    from edge_agent.imaging import prepare_bgr

    rng = np.random.default_rng(0)
    rows: list[list[Any]] = []
    for width, height in CAMERA_SIZES:
        bgr = cv2.resize(
            rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8),
            (width, height),
            interpolation=cv2.INTER_CUBIC,
        )
        loops = max(3, 20_000_000 // (width * height))

        def one_resize(bgr: np.ndarray = bgr) -> np.ndarray:
            shrunk = cv2.resize(bgr, (hw[1], hw[0]), interpolation=cv2.INTER_AREA)
            return cv2.cvtColor(shrunk, cv2.COLOR_BGR2RGB)

        def agent(bgr: np.ndarray = bgr) -> np.ndarray:
            return prepare_bgr(bgr, hw)

        timed = {}
        for name, fn in (("agent", agent), ("one area resize", one_resize)):
            samples = []
            for _ in range(repeats):
                started = time.process_time()
                for _ in range(loops):
                    fn()
                samples.append((time.process_time() - started) / loops * 1e6)
            timed[name] = statistics.median(samples)
        diff = np.abs(agent().astype(int) - one_resize().astype(int))
        rows.append(
            [
                f"{width}x{height}",
                round(timed["agent"], 1),
                round(timed["one area resize"], 1),
                round(timed["one area resize"] / timed["agent"], 2),
                round(float(diff.mean()), 2),
            ]
        )
    return rows


def run(quick: bool = False, *, video: bool = True, only: str = "") -> dict[str, Any]:
    repeats = 5
    n_frames = 96 if quick else 1024  # per HTTP burst and raw pass (about a second)
    video_frames = 384 if quick else 1024  # per raw video pass
    window_s = 1.5 if quick else 3.0
    tune_s = 1.0 if quick else 2.0  # per layout and round in `edge-agent tune`
    figures: dict[str, Any] = {}
    http_rows: list[list[Any]] = []
    video_rows: list[list[Any]] = []
    thread_rows: list[list[Any]] = []
    http_thread_rows: list[list[Any]] = []
    from edge_agent.imaging import opencv_threads
    from edge_agent.settings import AgentSettings

    # The raw loops run in this process: OpenCV's threads as the agent runs with them.
    opencv = opencv_threads(AgentSettings.model_fields["opencv_threads"].default)
    with tempfile.TemporaryDirectory() as tmp, opencv:
        workdir = Path(tmp)
        for index, (label, model) in enumerate(_models(workdir)):
            if only and only not in label:
                continue
            task, side = _model_info(model)
            jpegs, frames_shown = _frames_for(task, side, n_frames)
            clip = _video(workdir / f"clip-{index}.avi", jpegs[:64])
            shown = f"{label} ({task}, {side}px; {frames_shown})"
            served, served_fps = agent_layout(model, jpegs, seconds=tune_s)
            http_layout, http_layouts = fastest_layout(
                _raw_loops, model, jpegs, loop="raw_decode", layouts=RAW_JPEG_LAYOUTS
            )
            http = _http(model, jpegs, repeats, workdir / "http", http_layout, served)
            result = {
                **http,
                **_layout_figures("http", http_layout, http_layouts, len(jpegs)),
                "agent_inference_threads": float(served.inference_threads),
                "agent_intra_op_threads": float(served.intra_op_threads),
                "input_side": float(side),
            }
            http_rows.append(
                [
                    shown,
                    http_layout.label,
                    _layout_fps(http_layouts, len(jpegs)),
                    served.label,
                    _tuned_fps(served_fps),
                    http["raw_decode_fps"],
                    http["http_fps"],
                    http["http_vs_raw_decode"],
                    http["http_p50_ms"],
                    http["http_p99_ms"],
                    http["raw_decode_serial_fps"],
                    http["http_vs_raw_decode_serial"],
                    http["raw_fps"],
                    http["http_vs_raw"],
                    http["client_cpu_share"],
                    http["cloud_cpu_share"],
                    http["agent_cpu_share"],
                    http["agent_cpu_ms_per_frame"],
                    http["raw_decode_cpu_ms_per_frame"],
                    http["rss_served_mb"],
                    http["http_forward_rate"],
                    http["http_forward_cpu_ms_per_sample"],
                    http["http_unforwarded_vs_raw_decode"],
                    http["http_unforwarded_cpu_ms_per_frame"],
                    http["bare_http_fps"],
                    http["bare_http_cpu_ms_per_frame"],
                    http["http_ceiling"],
                ]
            )
            http_thread_rows.append(
                [
                    shown,
                    http["http_batch_frames"],
                    *(http[f"http_cpu_us_{name}"] for name, _ in HTTP_THREADS),
                ]
            )
            if video:
                video_layout, video_layouts = fastest_layout(
                    _raw_video_loops,
                    model,
                    clip,
                    video_frames,
                    loop="raw_video",
                    layouts=RAW_JPEG_LAYOUTS,
                )
                on_video, on_video_fps = agent_layout(model, clip, seconds=tune_s)
                vid = _video_rounds(
                    model, clip, video_frames, repeats, window_s, video_layout, on_video
                )
                result["video_agent_inference_threads"] = float(on_video.inference_threads)
                result["video_agent_intra_op_threads"] = float(on_video.intra_op_threads)
                result.update(vid)
                result.update(_layout_figures("video", video_layout, video_layouts, video_frames))
                result["video_vs_raw"] = vid["video_fps"] / http["raw_fps"]
                video_rows.append(
                    [
                        shown,
                        video_layout.label,
                        _layout_fps(video_layouts, video_frames),
                        on_video.label,
                        _tuned_fps(on_video_fps),
                        vid["raw_video_fps"],
                        vid["video_fps"],
                        result["video_vs_raw_video"],
                        vid["video_p50_ms"],
                        vid["video_p99_ms"],
                        vid["video_dropped"],
                        vid["video_cpu_ms_per_frame"],
                        vid["raw_video_cpu_ms_per_frame"],
                        vid["video_forward_rate"],
                        vid["video_forward_cpu_ms_per_sample"],
                        vid["raw_video_serial_fps"],
                        vid["video_vs_raw_video_serial"],
                        vid["video_unforwarded_vs_raw_video"],
                        vid["video_unforwarded_cpu_ms_per_frame"],
                    ]
                )
                thread_rows.append(
                    [shown, *(vid[f"video_cpu_us_{name}"] for name, _ in AGENT_THREADS)]
                )
            figures[label] = {k: round(v, 3) for k, v in result.items()}
    tables = [
        markdown_table(
            [
                "model",
                "raw loop's ORT layout (its fastest: batches at once x intra-op threads)",
                "raw ORT fps by layout, in the passes that chose it (info)",
                "agent's layout (`edge-agent tune`'s pick)",
                "agent fps by layout in `edge-agent tune` (info)",
                f"raw ORT fps (same decode+resize, {DECODE_THREADS} decode threads)",
                "agent HTTP fps",
                "HTTP / raw+decode",
                "HTTP p50 ms",
                "HTTP p99 ms",
                "raw ORT fps (decode+resize, one thread; info)",
                "HTTP / raw one thread (info)",
                "raw ORT fps (tensors; info)",
                "HTTP / raw tensors (info)",
                "load client CPU share",
                "stand-in cloud CPU share",
                "agent CPU share",
                "agent CPU ms/frame",
                "raw+decode CPU ms/frame",
                "agent RSS MB",
                "forwarded share",
                "agent CPU ms per forwarded sample (goal <= 0.5)",
                "HTTP / raw+decode, nothing forwarded (info)",
                "agent CPU ms/frame, nothing forwarded (info)",
                "bare HTTP server requests/s (info)",
                "bare HTTP server CPU ms/request (info)",
                "HTTP ceiling: raw+decode with the bare server's and client's CPU (info)",
            ],
            http_rows,
        ),
        f"max_batch={MAX_BATCH}; (batches at once + 1) x {MAX_BATCH} keep-alive connections"
        " (a batch's worth for each batch inferred and one queued; opened at each burst's start)"
        " from a one-thread load"
        f" generator in its own process; {n_frames} JPEG frames per burst (each model's, as"
        " its row says). Each of"
        f" {repeats} rounds (after one warm-up) times the raw loops and then one HTTP burst"
        " back to back; figures and ratios are medians over the rounds (ratios per round),"
        " latency percentiles over all bursts, CPU shares of all cores during the burst. The"
        " agent and the raw loops decode with edge_agent.imaging.model_tensor (libjpeg-turbo"
        " through shared.imdecode: a JPEG scaled in its IDCT to the smallest eighth still at"
        " least the model input, RGB; resize), into the batch where each inference thread"
        " decodes its own;"
        " the raw loops in the ORT layout they ran fastest"
        f" in of {'; '.join(layout.label for layout in RAW_JPEG_LAYOUTS)} (decode threads"
        " ahead of inference unless each inference thread decodes its own batch; three"
        " alternating passes each before the rounds, shown; the rounds time the chosen one"
        " again), the agent in the one `edge-agent tune` picks for it of"
        f" {' and '.join(layout.label for layout in LAYOUTS)} (its whole pipeline in"
        " process, three alternating rounds each, shown; with several batches at once,"
        " each inference thread decodes its own batch's uploads): each side in its"
        " fastest; agent"
        " routing at its defaults; RSS of `edge-agent run` after serving. Each round also sends one"
        " burst to a second `edge-agent run` with routing off (nothing forwarded) and one"
        " to a bare server (the agent's uvicorn settings, its uploads taken by the server's"
        " protocol as the agent's are and answered with a fixed answer-sized JSON: the HTTP"
        " layer alone). The ceiling is the"
        " raw loop's CPU per frame over that plus the bare server's and the load client's"
        " CPU per request: the ratio an agent whose only cost beyond the raw loop were"
        " serving HTTP would reach with as many cores busy. A third `edge-agent run`"
        " forwards every frame (audit share 1): its CPU per frame less the twin's that"
        " forwards none, per forwarded frame, is the agent's cost per forwarded sample"
        " (envelope, spool, publish, receipt and verdict handling). The stand-in cloud"
        " answers both forwarding agents; a detector's verdicts carry (empty) boxes.",
        markdown_table(
            [
                "model",
                "frames per inference batch",
                *(f"{title}, CPU us/frame" for _, title in HTTP_THREADS),
            ],
            http_thread_rows,
        ),
        "The agent's CPU per answered frame behind HTTP, by thread (routing at its"
        " defaults; medians over the rounds, from its edgeloop_thread_cpu_seconds), and"
        " the frames of its inference batches (the raw loops run batches of"
        f" {MAX_BATCH}).",
    ]
    if video_rows:
        tables += [
            markdown_table(
                [
                    "model",
                    "raw loop's ORT layout (its fastest)",
                    "raw ORT fps by layout, in the passes that chose it (info)",
                    "agent's layout (`edge-agent tune`'s pick on the clip)",
                    "agent fps by layout in `edge-agent tune` on the clip (info)",
                    "raw ORT fps (video read, pipelined)",
                    "agent video fps",
                    "video / raw video",
                    "video p50 ms",
                    "video p99 ms",
                    "frames dropped",
                    "agent CPU ms/frame",
                    "raw video CPU ms/frame",
                    "forwarded share",
                    "agent CPU ms per forwarded sample (goal <= 0.5)",
                    "raw ORT fps (one thread; info)",
                    "video / raw one thread (info)",
                    "video / raw video, nothing forwarded (info)",
                    "agent CPU ms/frame, nothing forwarded (info)",
                ],
                video_rows,
            ),
            f"The same 64-frame MJPEG clip in a loop, read as the agent's camera source reads"
            " a Motion JPEG stream: as its JPEGs (edge_agent.sources.camera.jpeg_packets),"
            " each decoded at the model's size as an upload is (decode_for_model). Raw: one"
            " thread reads, one decodes and prepares, the"
            f" calling thread runs batches of {MAX_BATCH} (in the layout of a batch per core,"
            " as many threads each run one), as the agent's camera source is laid out; the"
            " layout is the raw loop's fastest, as for HTTP (the one-thread loop does the"
            " same work step after step; information);"
            " the agent runs in the layout `edge-agent tune` picks for it on the same clip"
            " (read by a camera source, as here);"
            f" Agent: a camera source on the file, in process, frames/s over a {window_s:g} s"
            " window after 1 s of warm-up. Each of"
            f" {repeats} rounds times the raw loops on {video_frames} frames, then starts an"
            " agent, times its window and stops it, then once more with routing off (nothing"
            " forwarded; information) and once forwarding every frame (the CPU per"
            " forwarded sample: its CPU per frame less routing off's, per forwarded frame:"
            " the envelope, the spool, and handling receipts and verdicts; a forwarded"
            " frame is the camera's JPEG, not encoded again); figures and ratios (per"
            " round) are medians over the rounds. The cloud here is a stand-in in the"
            " agent's process (no broker): publishing over MQTT is in the HTTP figure only.",
            markdown_table(
                ["model", *(f"{title}, CPU us/frame" for _, title in AGENT_THREADS)],
                thread_rows,
            ),
            "The agent's CPU per answered frame on video, by thread (routing at its defaults;"
            " medians over the rounds): where the agent's time goes beside the raw loop's"
            " reading, preparing and inference.",
        ]
    preparation = frame_preparation(repeats=3 if quick else 7)
    tables += [
        markdown_table(
            [
                "camera frame -> 64x64 RGB",
                "agent's prepare_bgr, CPU us",
                "one OpenCV area resize, CPU us",
                "speed-up",
                "mean abs difference (grey levels)",
            ],
            preparation,
        ),
        "prepare_bgr halves the frame with OpenCV's 2x2 box filter while it is at least"
        " four times the model's size (even sides), then does one area resize; frames of"
        " smooth blobs with fine detail; medians of repeated timings in this process.",
    ]
    # Beside the per-model figures (which the goal summary reads), not among them.
    return {
        "figures": figures,
        "tables": tables,
        "frame_preparation_us": {row[0]: row[1] for row in preparation},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer frames per burst")
    parser.add_argument("--no-video", action="store_true", help="only the HTTP figures")
    parser.add_argument("--only", default="", help="models whose label contains this")
    args = parser.parse_args()
    section = run(args.quick, video=not args.no_video, only=args.only)
    print("\n\n".join(section["tables"]))
