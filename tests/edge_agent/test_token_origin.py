"""The agent's cloud token goes only to the enrolled cloud's origin, and only over TLS.

Two real HTTP servers on loopback (different ports, so different origins) serve the
artifact and record the Authorization header of every request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from cloud_service.registry import build_manifest
from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from edge_agent.testing import MemoryPublisher, make_tiny_student
from edge_agent.updates import token_for
from shared.manifest import FleetSigningKey
from shared.messages import encode_message, sign_manifest

KEY = FleetSigningKey.generate()
TOKEN = "cloud-token"


class Host:
    """A plain HTTP server serving one file; ``seen`` holds each request's Authorization."""

    def __init__(self, data: bytes) -> None:
        seen: list[str | None] = []
        self.seen = seen

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append(self.headers.get("Authorization"))
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("origin")
    return make_tiny_student(root / "v2.onnx", size=32, seed=2, version="v2")


@pytest.fixture
def hosts(model: Path) -> Iterator[tuple[Host, Host]]:
    cloud, elsewhere = Host(model.read_bytes()), Host(model.read_bytes())
    yield cloud, elsewhere
    cloud.close()
    elsewhere.close()


def _install(
    make_settings: Callable[..., AgentSettings],
    model: Path,
    *,
    cloud_url: str,
    artifact_base: str,
    until: Any,
    env: str = "development",
) -> dict[str, Any]:
    manifest = build_manifest(model.read_bytes())
    manifest = manifest.model_copy(
        update={
            "url": f"{artifact_base}/artifact/{manifest.sha256}",
            "sequence": 1,
            "expires_at": datetime.now(UTC) + timedelta(days=1),
            "fleet": "test-fleet",
        }
    )
    raw = encode_message(sign_manifest(manifest, KEY))
    settings = make_settings(
        env=env, fleet_public_key=KEY.public_key_b64, cloud_url=cloud_url, api_token=TOKEN
    )
    publisher = MemoryPublisher()
    with Agent(settings, publisher=publisher, start_sources=False) as agent:
        publisher.deliver(agent.updater.topic_fleet, raw)
        assert until(lambda: agent.updater.last_result is not None, timeout=30)
        result = agent.updater.last_result
    assert result is not None
    return result


def test_the_enrolled_cloud_gets_the_token(
    make_settings: Callable[..., AgentSettings], model: Path, hosts: tuple[Host, Host], until: Any
) -> None:
    cloud, _ = hosts
    result = _install(
        make_settings, model, cloud_url=cloud.url, artifact_base=cloud.url, until=until
    )
    assert result["result"] == "active", result
    assert cloud.seen == [f"Bearer {TOKEN}"]


def test_an_artifact_on_another_origin_is_fetched_without_the_token(
    make_settings: Callable[..., AgentSettings], model: Path, hosts: tuple[Host, Host], until: Any
) -> None:
    cloud, elsewhere = hosts
    result = _install(
        make_settings, model, cloud_url=cloud.url, artifact_base=elsewhere.url, until=until
    )
    assert result["result"] == "active", result  # the sha256 in the signed manifest vouches
    assert elsewhere.seen == [None]
    assert cloud.seen == []


def test_no_token_over_plain_http_in_production(
    make_settings: Callable[..., AgentSettings], model: Path, hosts: tuple[Host, Host], until: Any
) -> None:
    cloud, _ = hosts
    result = _install(
        make_settings,
        model,
        cloud_url=cloud.url,
        artifact_base=cloud.url,
        until=until,
        env="production",
    )
    assert result["result"] == "active", result
    assert cloud.seen == [None]


@pytest.mark.parametrize(
    ("url", "sent"),
    [
        ("https://cloud.example/v1/models/m/v/artifact", True),
        ("https://cloud.example:443/v1/models/m/v/artifact", True),
        ("https://CLOUD.example/x", True),
        ("http://cloud.example/x", False),  # a downgrade to plaintext
        ("https://cloud.example:8443/x", False),
        ("https://cloud.example.evil.test/x", False),
        ("https://evil.test/x?https://cloud.example", False),
        ("ftp://cloud.example/x", False),
    ],
)
def test_the_origin_rule(make_settings: Callable[..., AgentSettings], url: str, sent: bool) -> None:
    settings = make_settings(env="production", cloud_url="https://cloud.example", api_token=TOKEN)
    assert (token_for(settings, url) == TOKEN) is sent
