"""``edge-agent enroll | run | status | install-service`` against a fake cloud."""

from __future__ import annotations

import json
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from typer.testing import CliRunner

from edge_agent.cli import app
from edge_agent.service import run_agent
from edge_agent.settings import AgentSettings
from edge_agent.sources.http import ApiServer
from shared.broker import free_port

CA_PEM = "-----BEGIN CERTIFICATE-----\nMIIB(test)\n-----END CERTIFICATE-----\n"
runner = CliRunner()
PUBLIC_KEY = "MCowBQYDK2VwAyEAGb9ECWmEzf6FQbrBZ9w7lshQhqowtrbLDFw4rXAxZuE="


@pytest.fixture
def fake_cloud() -> Iterator[str]:
    """The cloud's enrollment endpoint: token 'good' works once, 'old' is unknown."""
    cloud = FastAPI()
    used: set[str] = set()

    @cloud.post("/v1/enroll")
    async def enroll(body: dict[str, object]) -> JSONResponse:
        token = body.get("token")
        if token != "good":
            return JSONResponse({"detail": "unknown or expired token"}, status_code=401)
        if token in used:
            return JSONResponse({"detail": "token already used"}, status_code=409)
        used.add(token)
        return JSONResponse(
            {
                "agent_id": body.get("agent_id") or "cam-7",
                "fleet": "warehouse",
                "mqtt_url": "mqtt://127.0.0.1:1883",
                "mqtt_username": "cam-7",
                "mqtt_password": 's3cret"with quotes',
                "topic_prefix": "edgeloop/v1",
                "fleet_public_key": PUBLIC_KEY,
                "key_id": "k1",
                "api_token": "tok-123",
                "mqtt_ca_pem": CA_PEM,
            }
        )

    with ApiServer(cloud) as server:
        yield server.url


def test_enroll_writes_a_private_config_the_agent_loads(fake_cloud: str, tmp_path: Path) -> None:
    config = tmp_path / "etc" / "agent.toml"
    result = runner.invoke(
        app, ["enroll", "--cloud", fake_cloud, "--token", "good", "--config", str(config), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["agent_id"] == "cam-7"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    settings = AgentSettings.load(config)
    assert (settings.fleet, settings.agent_id) == ("warehouse", "cam-7")
    assert settings.mqtt_password is not None
    assert settings.mqtt_password.get_secret_value() == 's3cret"with quotes'
    assert settings.fleet_public_key == PUBLIC_KEY
    assert settings.cloud_url == fake_cloud
    assert settings.mqtt_ca_file is not None
    assert settings.mqtt_ca_file.read_text() == CA_PEM
    assert settings.mqtt.ca_file == str(settings.mqtt_ca_file)

    again = runner.invoke(
        app, ["enroll", "--cloud", fake_cloud, "--token", "good", "--config", str(config)]
    )
    assert again.exit_code == 2
    assert "already used" in again.output


def test_enroll_refuses_unknown_tokens(fake_cloud: str, tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    result = runner.invoke(
        app, ["enroll", "--cloud", fake_cloud, "--token", "old", "--config", str(config)]
    )
    assert result.exit_code == 2
    assert "unknown or expired" in result.output
    assert not config.exists()


def test_enroll_with_the_cloud_down(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = runner.invoke(
        app, ["enroll", "--cloud", url, "--token", "good", "--config", str(tmp_path / "a.toml")]
    )
    assert result.exit_code == 2
    assert "cannot reach" in result.output


def test_enroll_through_a_mock_transport() -> None:
    from edge_agent.enroll import enroll

    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content) == {"token": "t", "agent_id": "a1"}
        return httpx.Response(409, json={"detail": "token already used"})

    from shared.errors import ConfigError

    with pytest.raises(ConfigError, match="already used"):
        enroll("http://cloud", "t", agent_id="a1", transport=httpx.MockTransport(handler))


def test_install_service(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(f'data_dir = "{tmp_path}"\nfleet = "f1"\n')
    unit = tmp_path / "edgeloop-agent.service"
    result = runner.invoke(
        app, ["install-service", "--config", str(config), "--user", "edge", "--output", str(unit)]
    )
    assert result.exit_code == 0, result.output
    text = unit.read_text()
    assert "User=edge" in text
    assert "Restart=always" in text
    assert f"--config {config.resolve()}" in text
    assert f"ReadWritePaths={tmp_path.resolve()}" in text


def test_run_and_status(
    make_settings: Callable[..., AgentSettings],
    tmp_path: Path,
    make_image: Callable[..., bytes],
    student_path: Path,
) -> None:
    port = free_port()
    settings = make_settings(http_port=port, mqtt_url=f"mqtt://127.0.0.1:{free_port()}")
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
        for _ in range(200):
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            stop.wait(0.05)
        response = httpx.post(
            base + "/v1/frames", content=make_image(), headers={"Content-Type": "image/jpeg"}
        )
        assert response.status_code == 200
        result = runner.invoke(app, ["status", "--config", str(config), "--json"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.output)
        assert data["running"] and data["frames_total"] == 1
        assert data["connected"] is False  # no broker there: the agent answers anyway
        text = runner.invoke(app, ["status", "--config", str(config)])
        assert "model tiny-student" in text.output
        watched = runner.invoke(app, ["status", "--config", str(config), "--threads", "0.05"])
        assert watched.exit_code == 0, watched.output
        assert "threads over 0.05 s (share of a core):" in watched.output
        assert "http-api" in watched.output  # the API server's thread, by name
        shares = json.loads(
            runner.invoke(
                app, ["status", "--config", str(config), "--threads", "0.05", "--json"]
            ).output
        )["threads"]
        assert "other" in shares and all(share >= 0.0 for share in shares.values())
    finally:
        stop.set()
        thread.join(15)
    down = runner.invoke(app, ["status", "--config", str(config), "--json"])
    data = json.loads(down.output)
    assert data["running"] is False
    assert data["spool"]["exists"] is True
