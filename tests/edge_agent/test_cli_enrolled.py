"""An enrolled agent just runs: ``edge-agent status`` (and ``run``) read the config that
``edge-agent enroll`` wrote at its default place, with no flags; ``status --port``;
figures printed rounded."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from edge_agent.cli import _agent_config, app
from edge_agent.enroll import write_config
from edge_agent.settings import AgentSettings
from shared.broker import free_port
from tests.edge_agent.test_cli import fake_cloud  # noqa: F401  (fixture)

runner = CliRunner()

STATUS = {
    "fleet": "plant-3",
    "agent": "cam-7",
    "ready": True,
    "connected": True,
    "model": {"name": "student", "version": "v3", "provider": "cpu"},
    "frames_per_s": 12.345678,
    "latency_p50_ms": 6.428847999814025,
    "latency_p99_ms": 17.00012345,
    "forward_rate": 0.0833333333,
    "spool": {"depth": 0, "bytes": 0},
    "dropped_frames": 0,
    "uplink": {},
    "sources": [],
}


@pytest.fixture
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("EDGELOOP_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "config"


@pytest.fixture
def running_agent() -> Iterator[int]:
    """A stand-in for a running agent's /v1/status on a free port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(STATUS).encode()
            self.send_response(200 if self.path == "/v1/status" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_enroll_writes_where_run_and_status_read(
    fake_cloud: str,  # noqa: F811
    config_home: Path,
) -> None:
    assert _agent_config(None) is None  # nothing enrolled yet: settings from the environment
    result = runner.invoke(app, ["enroll", "--cloud", fake_cloud, "--token", "good"])
    assert result.exit_code == 0, result.output
    written = config_home / "edgeloop" / "agent.toml"
    assert written.is_file() and str(written) in " ".join(result.output.split())
    assert _agent_config(None) == written
    settings = AgentSettings.load(_agent_config(None))
    assert (settings.fleet, settings.agent_id, settings.key_id) == ("warehouse", "cam-7", "k1")
    assert _agent_config(Path("/elsewhere.toml")) == Path("/elsewhere.toml")  # --config wins
    shown = json.loads(runner.invoke(app, ["settings", "--json"]).output)
    assert shown["fleet"] == "warehouse" and shown["api_token"] == "***"


def test_status_reads_the_enrolled_config_and_rounds(config_home: Path, running_agent: int) -> None:
    write_config(
        config_home / "edgeloop" / "agent.toml",
        {"fleet": "plant-3", "agent_id": "cam-7", "http_port": running_agent},
    )
    result = runner.invoke(app, ["status"])
    assert result.exit_code == 0, result.output
    assert "agent plant-3/cam-7: ready=True connected=True" in result.output
    assert "frames/s 12.3  p50 6.43 ms  p99 17.00 ms  forward rate 0.083" in result.output
    assert "6.4288" not in result.output


def test_status_port_overrides_the_config(config_home: Path, running_agent: int) -> None:
    write_config(config_home / "edgeloop" / "agent.toml", {"http_port": free_port()})
    away = runner.invoke(app, ["status", "--json"])
    assert away.exit_code == 0 and json.loads(away.output)["running"] is False
    here = runner.invoke(app, ["status", "--port", str(running_agent), "--json"])
    assert here.exit_code == 0, here.output
    assert json.loads(here.output)["running"] is True
