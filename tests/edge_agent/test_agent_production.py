"""In production the agent refuses to start on unsafe settings, and only on those."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.settings import AgentSettings
from shared.errors import ConfigError

PUBLIC_KEY = "M6LxbtiYwPoaoiOpxKVxLoXOLjaWAel8j+LpbvaBIbo="


def _config(tmp_path: Path, **values: str) -> Path:
    """An enrolled production agent's config, with ``values`` replacing its lines."""
    lines = {
        "env": "production",
        "data_dir": str(tmp_path),
        "fleet": "plant-3",
        "agent_id": "cam-7",
        "mqtt_url": "mqtts://broker.example:8883",
        "mqtt_username": "cam-7",
        "mqtt_password": "broker-secret",
        "fleet_public_key": PUBLIC_KEY,
        "cloud_url": "https://cloud.example",
        "api_token": "cloud-token",
        "local_api_token": "local-token",
        **values,
    }
    path = tmp_path / "agent.toml"
    path.write_text("".join(f'{k} = "{v}"\n' for k, v in lines.items() if v))
    return path


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("EDGELOOP_ENV", "EDGELOOP_DATABASE_URL", "EDGELOOP_HTTP_HOST"):
        monkeypatch.delenv(name, raising=False)


def test_an_enrolled_agent_starts_in_production(tmp_path: Path) -> None:
    # No SQL database here: the agent is not asked for one.
    settings = AgentSettings.load(_config(tmp_path))
    assert settings.env == "production"
    assert settings.production_problems() == []


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"cloud_url": "http://cloud.example"}, "without TLS: use https://"),
        ({"cloud_url": ""}, "no cloud_url"),
        ({"http_host": "0.0.0.0", "local_api_token": ""}, "without a configured local API token"),
        ({"mqtt_username": "", "mqtt_password": ""}, "anonymous"),
        ({"mqtt_url": "mqtt://broker.example:1883"}, "broker.example is reached without TLS"),
        ({"fleet_public_key": ""}, "no fleet public key"),
    ],
)
def test_each_unsafe_setting_is_refused(
    tmp_path: Path, values: dict[str, str], problem: str
) -> None:
    with pytest.raises(ConfigError, match="refusing to start in production") as refused:
        AgentSettings.load(_config(tmp_path, **values))
    assert problem in str(refused.value)
    assert "SQLite" not in str(refused.value)


def test_all_problems_are_listed_at_once(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        cloud_url="http://cloud.example",
        http_host="0.0.0.0",
        local_api_token="",
        mqtt_url="mqtt://broker.example:1883",
    )
    with pytest.raises(ConfigError) as refused:
        AgentSettings.load(config)
    assert str(refused.value).count("\n  - ") == 3


def test_an_api_off_loopback_with_a_token_file_is_accepted(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t\n")
    token.chmod(0o600)
    config = _config(
        tmp_path, http_host="0.0.0.0", local_api_token="", local_api_token_file=str(token)
    )
    assert AgentSettings.load(config).http_host == "0.0.0.0"
