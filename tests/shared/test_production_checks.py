"""Production refuses every unsafe cloud setting at once; the agent is not held to the cloud's."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import pytest

from cloud_service.settings import CloudSettings, secret_weakness
from edge_agent.settings import AgentSettings
from shared.errors import ConfigError

# What `openssl rand -hex 32` gives, and what a careful operator types.
SESSION_SECRET = "9f2c4e71b08d3a65c1e7f94b2d608a3e5b7c91d0f4a2e86c3b5d7f0192e4a6c8"
ADMIN_TOKEN = "Zq7-Lm2xVb9_Rt4nKc8pWd1sYf6hJg3aTe5uQo0i"

GOOD: dict[str, Any] = {
    "env": "production",
    "database_url": "postgresql+psycopg://edgeloop@db.internal/edgeloop",
    "mqtt_url": "mqtts://broker.internal:8884",
    "mqtt_username": "edgeloop-api",
    "mqtt_password": "a-broker-password",
    "session_secret": SESSION_SECRET,
    "admin_token": ADMIN_TOKEN,
    "broker_auth": True,
    "http_host": "127.0.0.1",
    "metrics_token": "Pm4-Xr8vNb2_Kq6tWz1cYd9sLf3hJg7aUe5oRi0x",
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in list(os.environ):
        if key.startswith("EDGELOOP_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))


def test_a_correct_production_config_loads() -> None:
    settings = CloudSettings.load(**GOOD)
    assert settings.env == "production" and settings.production_problems() == []
    # Off loopback behind a TLS-terminating proxy the API trusts.
    proxied = CloudSettings.load(
        **{**GOOD, "http_host": "0.0.0.0", "trusted_proxies": ["10.0.0.0/8"]}
    )
    assert proxied.production_problems() == []


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"session_secret": "x"}, "session secret is shorter than 32"),
        ({"session_secret": "ab" * 20}, "session secret has low entropy"),
        ({"session_secret": "0123456789abcdef" * 3}, "session secret repeats a 16-character"),
        ({"session_secret": "edgeloop-development-session-secret"}, "development default"),
        ({"admin_token": "abcdefghabcdefghabcdefgh"}, "admin token is shorter than 32"),
        ({"admin_token": "abcdefghijkl" * 4}, "admin token repeats a 12-character"),
        (
            {"admin_token": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"},
            "admin token has low entropy",
        ),
        ({"broker_auth": False}, "broker_auth is off"),
        ({"http_host": "0.0.0.0"}, "listens on 0.0.0.0 with plain HTTP"),
        ({"http_host": "192.0.2.7"}, "listens on 192.0.2.7 with plain HTTP"),
        ({"rate_limit_enroll_per_min": 0}, "rate_limit_enroll_per_min is 0"),
        ({"rate_limit_login_per_min": 0}, "rate_limit_login_per_min is 0"),
        ({"rate_limit_upload_per_min": 0}, "rate_limit_upload_per_min is 0"),
        ({"database_url": None}, "SQLite is the development database"),
        ({"mqtt_username": None, "mqtt_password": None}, "anonymous"),
        ({"mqtt_url": "mqtt://broker.internal:1883"}, "without TLS"),
        ({"v2_auth": False}, "v2_auth is off"),
        ({"docs_public": True}, "docs_public is on"),
        ({"metrics_auth": False}, "metrics_auth is off"),
        ({"metrics_token": None}, "metrics_token is unset"),
        ({"metrics_token": "short"}, "metrics token is shorter than 32"),
        ({"cookie_secure": False}, "cookie_secure is off"),
        ({"trusted_proxies": ["0.0.0.0/0"]}, "trusted_proxies holds 0.0.0.0/0"),
        ({"trusted_proxies": ["8.8.8.8"]}, "trusted_proxies holds 8.8.8.8"),
        ({"http_limit_concurrency": None}, "http_limit_concurrency is unset"),
        ({"http_header_timeout_s": 120}, "http_header_timeout_s is 120"),
    ],
)
def test_each_production_misconfiguration_is_refused(
    override: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError, match="refusing to start in production") as caught:
        CloudSettings.load(**{**GOOD, **override})
    assert expected in str(caught.value)


def test_every_problem_is_listed_at_once() -> None:
    """The attack's configuration: every problem in one message."""
    with pytest.raises(ConfigError) as caught:
        CloudSettings.load(
            **{
                **GOOD,
                "session_secret": "x",
                "admin_token": "abcdefghabcdefghabcdefgh",
                "broker_auth": False,
                "http_host": "0.0.0.0",
                "rate_limit_enroll_per_min": 0,
                "rate_limit_login_per_min": 0,
                "rate_limit_upload_per_min": 0,
            }
        )
    problems = [line for line in str(caught.value).splitlines() if line.startswith("  - ")]
    assert len(problems) == 7, problems


def test_random_secrets_pass() -> None:
    """What the documented generators give is never refused (hex may miss a digit)."""
    for _ in range(200):
        assert secret_weakness(secrets.token_hex(32)) is None
        assert secret_weakness(secrets.token_urlsafe(32)) is None


def test_an_agent_with_no_database_is_not_refused_for_sqlite(tmp_path: Path) -> None:
    agent = AgentSettings(
        env="production",
        data_dir=tmp_path,
        agent_id="cam-1",
        mqtt_url="mqtts://broker.internal:8883",
        mqtt_username="fleet-a.cam-1",
        mqtt_password="an-agent-password",
    )
    assert not any("SQLite" in problem for problem in agent.production_problems())


@pytest.mark.parametrize("field", ["verifier_client_id", "announcer_client_id"])
def test_a_service_client_id_cannot_be_an_agents(field: str) -> None:
    """Agents' client ids are their broker users ``{fleet}.{agent}``; services' hold no dot."""
    with pytest.raises(ConfigError, match="hold no dot"):
        CloudSettings.load(**{field: "fleet-a.cam-1"})
