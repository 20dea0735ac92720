"""Settings: file + environment, environment wins, production refuses unsafe defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud_service.settings import CloudSettings
from edge_agent.settings import AgentSettings
from shared.errors import ConfigError
from shared.settings import EdgeLoopSettings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("EDGELOOP_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))


def test_defaults_are_development_on_one_machine(tmp_path: Path) -> None:
    settings = EdgeLoopSettings.load()
    assert settings.env == "development"
    assert settings.data_dir == tmp_path / "xdg" / "edgeloop"
    assert settings.resolved_database_url == f"sqlite:///{settings.data_dir / 'edgeloop.db'}"
    assert settings.mqtt.host == "127.0.0.1" and settings.mqtt.port == 1883
    assert settings.topics.prefix == "edgeloop/v1"


def test_environment_wins_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "edgeloop.toml"
    config.write_text('mqtt_url = "mqtt://broker.example:1884"\nmax_pixels = 1000\n')
    monkeypatch.setenv("EDGELOOP_MAX_PIXELS", "2000")
    settings = EdgeLoopSettings.load(config)
    assert settings.mqtt.host == "broker.example" and settings.mqtt.port == 1884
    assert settings.max_pixels == 2000
    assert settings.envelope_limits.max_pixels == 2000


def test_unknown_key_in_file_is_refused_with_its_name(tmp_path: Path) -> None:
    config = tmp_path / "edgeloop.toml"
    config.write_text('mqtt_ulr = "mqtt://x:1"\n')
    with pytest.raises(ConfigError, match="mqtt_ulr"):
        EdgeLoopSettings.load(config)


def test_missing_file_and_bad_toml_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        EdgeLoopSettings.load(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("mqtt_url = \n")
    with pytest.raises(ConfigError):
        EdgeLoopSettings.load(bad)


@pytest.mark.parametrize(
    "url", ["http://host:1883", "mqtt://", "mqtt://host:notaport", "tcp://host"]
)
def test_bad_broker_urls_name_the_accepted_forms(url: str) -> None:
    with pytest.raises(ConfigError):
        EdgeLoopSettings.load(mqtt_url=url)


def test_production_refuses_every_unsafe_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGELOOP_ENV", "production")
    monkeypatch.setenv("EDGELOOP_MQTT_URL", "mqtt://broker.internal:1883")
    with pytest.raises(ConfigError) as caught:
        CloudSettings.load()
    text = str(caught.value)
    assert "anonymous" in text
    assert "without TLS" in text
    assert "SQLite" in text
    assert "session secret" in text
    assert "admin token" in text.lower()


def test_production_accepts_safe_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGELOOP_ENV", "production")
    monkeypatch.setenv("EDGELOOP_MQTT_URL", "mqtts://verifier:s3cret@broker.internal:8883")
    monkeypatch.setenv("EDGELOOP_DATABASE_URL", "postgresql+psycopg://edgeloop@db/edgeloop")
    monkeypatch.setenv("EDGELOOP_SESSION_SECRET", "a-real-secret-from-the-vault-7Qk2xW9p")
    monkeypatch.setenv("EDGELOOP_ADMIN_TOKEN", "an-admin-token-from-the-vault-Zr4mT8v")
    monkeypatch.setenv("EDGELOOP_BROKER_AUTH", "true")
    monkeypatch.setenv("EDGELOOP_METRICS_TOKEN", "a-scrape-token-from-the-vault-Hy6nP3q")
    settings = CloudSettings.load()
    assert settings.mqtt.username == "verifier" and settings.mqtt.tls
    assert "s3cret" not in repr(settings.mqtt)
    assert "a-real-secret" not in repr(settings)


def test_agent_ids_are_validated_and_agent_needs_fleet_key_in_production(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError, match="agent"):
        AgentSettings.load(agent_id="Bad Agent!")
    monkeypatch.setenv("EDGELOOP_ENV", "production")
    monkeypatch.setenv("EDGELOOP_MQTT_URL", "mqtts://cam1:pw@broker.internal:8883")
    monkeypatch.setenv("EDGELOOP_DATABASE_URL", "sqlite:////var/lib/edgeloop/agent.db")
    with pytest.raises(ConfigError, match="fleet public key"):
        AgentSettings.load(agent_id="cam-1")
