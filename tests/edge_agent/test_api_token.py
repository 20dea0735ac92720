"""The agent's mutating routes need its local API token; ``edge-agent rollback`` sends it."""

from __future__ import annotations

import json
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from edge_agent.agent import Agent
from edge_agent.cli import app
from edge_agent.localauth import local_api_token
from edge_agent.service import run_agent
from edge_agent.settings import AgentSettings
from edge_agent.sources.http import ApiServer, create_app
from edge_agent.testing import MemoryPublisher, make_tiny_student
from edge_agent.updates import InstalledModel, ModelState
from shared.broker import free_port
from shared.errors import ConfigError
from tests.edge_agent.test_cli import fake_cloud  # noqa: F401 (a fixture)

TOKEN = "local-secret-token"


def _with_earlier_version(settings: AgentSettings, student_path: Path) -> None:
    """A state.json whose history holds an earlier model, so a rollback has one to serve."""
    earlier = make_tiny_student(settings.data_dir / "v0.onnx", size=32, seed=5, version="v0")
    ModelState(
        active=InstalledModel(name="tiny-student", version="test-1", path=str(student_path)),
        history=[InstalledModel(name="tiny-student", version="v0", path=str(earlier))],
    ).save(settings.data_dir / "models" / "state.json")


@pytest.fixture
def client(
    make_settings: Callable[..., AgentSettings], student_path: Path
) -> Iterator[httpx.Client]:
    settings = make_settings(local_api_token=TOKEN)
    _with_earlier_version(settings, student_path)
    with (
        Agent(settings, publisher=MemoryPublisher(), start_sources=False) as agent,
        ApiServer(create_app(agent)) as server,
        httpx.Client(base_url=server.url) as http,
    ):
        yield http


def test_rollback_needs_the_local_token(client: httpx.Client) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        answer = client.post("/v1/model/rollback", headers=headers)
        assert answer.status_code == 401, answer.text
        assert answer.json()["reason"] == "unauthorized"
        assert answer.headers["www-authenticate"] == "Bearer"
    assert client.get("/v1/model").json()["active"]["version"] == "test-1"
    answer = client.post("/v1/model/rollback", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"result": "rolled-back", "from": "test-1", "version": "v0"}


def test_a_cross_site_request_is_still_refused_first(client: httpx.Client) -> None:
    answer = client.post(
        "/v1/model/rollback",
        headers={"Origin": "https://evil.example", "Authorization": f"Bearer {TOKEN}"},
    )
    assert answer.status_code == 403 and answer.json()["reason"] == "cross_site"


def test_frame_intake_needs_no_token(
    client: httpx.Client, make_image: Callable[..., bytes]
) -> None:
    answer = client.post("/v1/frames", content=make_image(), headers={"Content-Type": "image/jpeg"})
    assert answer.status_code == 200, answer.text


def test_the_cli_rollback_reads_the_token_the_running_agent_made(
    make_settings: Callable[..., AgentSettings], tmp_path: Path, student_path: Path
) -> None:
    port = free_port()
    settings = make_settings(http_port=port, mqtt_url=f"mqtt://127.0.0.1:{free_port()}")
    _with_earlier_version(settings, student_path)
    stop = threading.Event()
    thread = threading.Thread(target=run_agent, args=(settings,), kwargs={"stop": stop})
    thread.start()
    config = tmp_path / "agent.toml"
    config.write_text(
        f'data_dir = "{tmp_path}"\nhttp_port = {port}\nmodel_path = "{student_path}"\n'
        'fleet = "test-fleet"\nagent_id = "agent-1"\n'
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(400):  # a bounded wait for the agent's API to come up
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            stop.wait(0.05)
        token_file = tmp_path / "local-api-token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert httpx.post(base + "/v1/model/rollback").status_code == 401
        result = CliRunner().invoke(app, ["rollback", "--config", str(config), "--json"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.output)
        assert data["running"] is True and data["version"] == "v0"
    finally:
        stop.set()
        thread.join(15)


def test_a_token_file_others_can_read_is_refused(
    make_settings: Callable[..., AgentSettings], tmp_path: Path
) -> None:
    path = tmp_path / "token"
    path.write_text("abc\n")
    path.chmod(0o644)
    settings = make_settings(local_api_token_file=path)
    with pytest.raises(ConfigError, match="readable by others"):
        local_api_token(settings)
    path.chmod(0o600)
    assert local_api_token(settings) == "abc"


def test_enrollment_writes_a_local_api_token(fake_cloud: str, tmp_path: Path) -> None:  # noqa: F811
    config = tmp_path / "agent.toml"
    result = CliRunner().invoke(
        app, ["enroll", "--cloud", fake_cloud, "--token", "good", "--config", str(config)]
    )
    assert result.exit_code == 0, result.output
    settings = AgentSettings.load(config)
    assert settings.local_api_token is not None
    assert len(settings.local_api_token.get_secret_value()) >= 32
    assert local_api_token(settings) == settings.local_api_token.get_secret_value()
