"""The README's "A fleet in five steps", run exactly as written, in a fresh data dir.

The commands are read out of the README's shell block; ``<token>`` becomes what
``cloud-service tokens create`` printed, the password prompt is answered on stdin, a
command ending in ``&`` runs in the background, and so does the last one (``edge-agent
run`` serves until stopped, as in a second terminal). Then one frame is POSTed to the
agent, as the README's ``curl -F frame=@...`` line does, and the agent's heartbeat is
looked for in the cloud.

The only departures from a new user's shell: the model cache is seeded with the
session's quick reference models and ``EDGELOOP_BOOTSTRAP_QUICK`` set, so
``edgeloop models bootstrap`` finds them cached instead of training for minutes; the
topic prefix and MQTT client ids are this test's own, so it cannot meet another
process on the shared broker.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
from PIL import Image

from cloud_service.settings import DEV_ADMIN_TOKEN

README = Path(__file__).resolve().parent.parent / "README.md"
BIN = Path(sys.executable).parent
PASSWORD = "a-long-enough-password"
T = TypeVar("T")

# What a background command prints once it serves, and the port it then answers on.
SERVING = {"cloud-service": ("Uvicorn running on", 8080), "edge-agent": ("agent API on", 8081)}


def readme_commands() -> list[str]:
    """The shell block of the README's five-steps section, one command a line, no comments."""
    text = README.read_text()
    section = text.split("## A fleet in five steps", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match, "the five-steps section has no ```bash block"
    lines = [re.split(r"\s+#\s", line, maxsplit=1)[0].strip() for line in match[1].splitlines()]
    return [line for line in lines if line]


def test_the_readme_block_is_the_five_steps() -> None:
    commands = readme_commands()
    assert [shlex.split(c.rstrip("&"))[:2] for c in commands] == [
        ["edgeloop", "models"],
        ["cloud-service", "keys"],
        ["cloud-service", "users"],
        ["cloud-service", "all"],
        ["cloud-service", "tokens"],
        ["edge-agent", "enroll"],
        ["edge-agent", "run"],
    ]
    section = README.read_text().split("## A fleet in five steps", 1)[1].split("\n## ", 1)[0]
    assert "curl -F frame=@frame.jpg http://127.0.0.1:8081/v1/frames" in section
    assert "http://127.0.0.1:8080/ui/" in section


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


class Background:
    """A command left running: its output copied to a log; ``serving`` is set when it
    prints the line that says it listens."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, marker: str) -> None:
        self.log = log
        self.serving = threading.Event()
        self.process = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own group: the distill worker child stops with it
        )
        self._reader = threading.Thread(target=self._copy, args=(marker,), daemon=True)
        self._reader.start()

    def _copy(self, marker: str) -> None:
        assert self.process.stdout is not None
        with self.log.open("wb") as out:
            for line in self.process.stdout:
                out.write(line)
                out.flush()
                if marker.encode() in line:
                    self.serving.set()
        self.serving.set()  # it exited: the waiter looks at returncode

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._reader.join(10)
        if self.process.stdout is not None:
            self.process.stdout.close()


def _eventually(check: Callable[[], T | None], *, attempts: int = 300) -> T | None:
    """``check()`` until it answers (the cloud stores heartbeats at its own pace)."""
    pause = threading.Event()
    for _ in range(attempts):
        value = check()
        if value is not None:
            return value
        pause.wait(0.1)
    return None


@pytest.fixture
def fleet_env(tmp_path: Path, quick_models: Any, broker: Any) -> Iterator[dict[str, str]]:
    for port in (8080, 8081):
        if not _port_free(port):
            pytest.skip(f"port {port} is taken; the README's steps use it")
    data = tmp_path / "data"
    cache = data / "models" / "cache"
    cache.mkdir(parents=True)
    for entry in (quick_models.teacher_onnx.parent, quick_models.student_onnx.parent):
        shutil.copytree(entry, cache / entry.name)
    run_id = uuid.uuid4().hex[:8]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGELOOP_")}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        EDGELOOP_DATA_DIR=str(data),
        XDG_CONFIG_HOME=str(tmp_path / "config"),
        EDGELOOP_BOOTSTRAP_QUICK="1",
        EDGELOOP_MQTT_URL=broker.url,
        EDGELOOP_TOPIC_PREFIX=f"edgeloop-test/five-steps-{run_id}/v1",
        EDGELOOP_VERIFIER_CLIENT_ID=f"five-steps-verifier-{run_id}",
        EDGELOOP_ANNOUNCER_CLIENT_ID=f"five-steps-announcer-{run_id}",
        EDGELOOP_HEARTBEAT_S="1",
    )
    yield env


def _frame_jpeg() -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG")
    return out.getvalue()


def test_the_five_steps_run_as_written(fleet_env: dict[str, str], tmp_path: Path) -> None:
    commands = readme_commands()
    running: list[Background] = []
    outputs: dict[str, str] = {}
    token: str | None = None
    try:
        for i, command in enumerate(commands):
            background = command.endswith("&") or i == len(commands) - 1
            text = command.rstrip("&").strip()
            if "<token>" in text:
                assert token, "tokens create printed no token"
                text = text.replace("<token>", token)
            argv = shlex.split(text)
            if background:
                marker, port = SERVING[argv[0]]
                job = Background(argv, fleet_env, tmp_path / f"{argv[0]}.log", marker)
                running.append(job)
                assert job.serving.wait(120), f"{text} did not start: {job.log.read_text()}"
                assert job.process.poll() is None, f"{text} exited: {job.log.read_text()}"
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
                assert ready.status_code == 200, ready.text
                continue
            done = subprocess.run(
                argv,
                env=fleet_env,
                input=f"{PASSWORD}\n{PASSWORD}\n",
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, f"{text}\n{done.stdout}\n{done.stderr}"
            outputs[" ".join(argv[:2])] = done.stdout
            found = re.search(r"elt_[A-Za-z0-9_-]+", done.stdout)
            if argv[:2] == ["cloud-service", "tokens"] and found:
                token = found[0]

        bootstrap = " ".join(outputs["edgeloop models"].split())
        assert "trained now: nothing (all cached)" in bootstrap  # the cache is honoured
        assert "installed the teacher" in bootstrap and "installed the student" in bootstrap
        assert "INFO" not in outputs["cloud-service users"]  # no Alembic chatter
        assert "enrolled as plant-3/" in outputs["edge-agent enroll"]

        # The README's curl -F frame=@frame.jpg line, and edge-agent status.
        answer = httpx.post(
            "http://127.0.0.1:8081/v1/frames",
            files={"frame": ("frame.jpg", _frame_jpeg(), "image/jpeg")},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["label"] in [str(d) for d in range(10)] and 0 < body["confidence"] <= 1
        status = subprocess.run(
            ["edge-agent", "status"], env=fleet_env, capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 0, status.stdout + status.stderr
        assert "agent plant-3/" in status.stdout and "connected=True" in status.stdout

        # The agent's heartbeat reaches the cloud.
        agent_id = re.search(r"agent plant-3/(\S+):", status.stdout)
        assert agent_id
        admin = {"Authorization": f"Bearer {DEV_ADMIN_TOKEN}"}

        def seen() -> dict[str, Any] | None:
            got = httpx.get(
                f"http://127.0.0.1:8080/v1/agents/{agent_id[1]}", headers=admin, timeout=10
            )
            row = got.json() if got.status_code == 200 else {}
            return row if row.get("last_seen_at") and row.get("telemetry") else None

        agent = _eventually(seen)
        assert agent is not None, "the agent's heartbeat never reached the cloud"
        assert agent["fleet"] == "plant-3" and agent["state"] == "online"

        # cloud-service all runs a distill worker: it is registered, nothing waits for one.
        def worker_live() -> bool | None:
            metrics = httpx.get("http://127.0.0.1:8080/metrics", timeout=10).text
            return True if "edgeloop_distill_workers_live 1.0" in metrics else None

        assert _eventually(worker_live), "cloud-service all registered no distill worker"
    finally:
        for job in reversed(running):
            job.stop()
