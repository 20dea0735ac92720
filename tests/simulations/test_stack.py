"""``Stack``: one running system (broker, database, verifier, API, agents) on loopback."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from cloud_service.demo_teacher import build_demo_teacher
from edge_agent.testing import make_tiny_student
from shared.errors import ConfigError
from simulations.processes import ServiceProcess, settings_env
from simulations.stack import InProcessApi, InProcessVerifier, Stack, VerifierProcesses, subprocess


def test_settings_become_the_services_environment(tmp_path: Path) -> None:
    env = settings_env(
        {
            "blob_fsync": False,
            "admin_token": SecretStr("secret-token"),
            "data_dir": tmp_path,
            "max_queue_delay_ms": 2.0,
            "signing_key_file": None,
        }
    )
    assert env == {
        "EDGELOOP_BLOB_FSYNC": "false",
        "EDGELOOP_ADMIN_TOKEN": "secret-token",
        "EDGELOOP_DATA_DIR": str(tmp_path),
        "EDGELOOP_MAX_QUEUE_DELAY_MS": "2.0",
    }


def test_a_verifier_subprocess_is_described_not_started() -> None:
    assert subprocess(2, ingest_max_batch=20) == VerifierProcesses(2, {"ingest_max_batch": 20})


def test_launchers_read_their_settings_from_the_stack(tmp_path: Path) -> None:
    stack = Stack(tmp_path, broker="mqtt://127.0.0.1:1883", verifier=None, name="t")
    with stack:
        process = stack.verifier_process(workers=2, ingest_max_batch=20, stop_timeout_s=5.0)
        assert isinstance(process, ServiceProcess) and process.pid is None
        assert process.env["EDGELOOP_MQTT_URL"] == "mqtt://127.0.0.1:1883"
        assert process.env["EDGELOOP_INGEST_MAX_BATCH"] == "20"
        assert process.env["EDGELOOP_DATABASE_URL"] == f"sqlite:///{tmp_path / 'cloud.db'}"
        assert process.env["EDGELOOP_LOG_LEVEL"] == "WARNING"
        assert process.stop_timeout_s == 5.0 and process.log == tmp_path / "verifier.log"
        assert "--workers" in process._command()
        assert stack.broker is not None and stack.broker.pid is None
        with pytest.raises(ConfigError):
            stack.broker.restart()  # only a private Mosquitto restarts


def test_a_launcher_runs_from_another_checkout_with_its_own_variables(tmp_path: Path) -> None:
    base = tmp_path / "base-checkout"
    stack = Stack(tmp_path, broker="mqtt://127.0.0.1:1883", verifier=None, name="t")
    with stack:
        process = stack.verifier_process(
            checkout=base, env={"EDGELOOP_LOG_LEVEL": "DEBUG"}, ingest_max_batch=20
        )
        assert process.checkout == base
        assert process.env["PYTHONPATH"] == str(base)  # imports from it, not the installed one
        assert process.env["EDGELOOP_LOG_LEVEL"] == "DEBUG"  # after the stack's WARNING
        assert process.env["EDGELOOP_INGEST_MAX_BATCH"] == "20"


@pytest.mark.mqtt
def test_stack_runs_every_part_and_stops_them(tmp_path: Path) -> None:
    teacher = build_demo_teacher(tmp_path / "teacher.onnx", size=32, classes=10, seed=1)
    student = make_tiny_student(tmp_path / "student.onnx", size=32)
    stack = Stack(
        tmp_path / "run",
        broker="embedded",
        verifier="in-process",
        api="in-process",
        agents=2,
        teacher=teacher,
        student=student,
        fleet="fleet-t",
        cloud={"blob_fsync": False},
        edge={"intra_op_threads": 1, "warmup_runs": 1},
    )
    with stack:
        assert isinstance(stack.verifier, InProcessVerifier)
        assert isinstance(stack.api, InProcessApi)
        assert stack.worker is stack.state.worker  # the API serves the verifier's state
        assert httpx.get(f"{stack.api_url}/healthz", timeout=10).status_code == 200
        assert [a.settings.agent_id for a in stack.agents] == ["cam-1", "cam-2"]
        for agent in stack.agents:
            s = agent.settings
            assert s.fleet == "fleet-t" and s.api_token  # enrolled on the API
            assert s.cloud_url == stack.api_url and s.mqtt_protocol == "3.1.1"
            assert s.fleet_public_key == stack.state.signing_key.public_key_b64
        url = stack.api_url
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/healthz", timeout=2)


def test_a_restart_waits_out_a_port_held_for_a_moment(tmp_path: Path) -> None:
    import socket
    import threading

    stack = Stack(tmp_path, broker=None, verifier=None, name="t")
    with stack:
        api = stack.api_process(ready_timeout_s=120.0)
        # Another socket holds the API's port, as a client's ephemeral port may between
        # a kill and the restart; it lets go once a launch has failed to bind.
        holder = socket.socket()
        holder.bind(("127.0.0.1", api.port))
        holder.listen()
        refused = threading.Event()

        def release() -> None:
            while not refused.is_set():
                log = api.log
                said = log.read_bytes() if log is not None and log.exists() else b""
                if b"address already in use" in said:
                    refused.set()
                    break
                refused.wait(0.05)
            holder.close()

        releaser = threading.Thread(target=release)
        releaser.start()
        try:
            api.start()
        finally:
            refused.set()
            releaser.join(30)
        assert httpx.get(f"{api.url}/healthz", timeout=10).status_code == 200
