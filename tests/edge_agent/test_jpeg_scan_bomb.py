"""A JPEG scan bomb at the agent's HTTP intake: refused with a 422 before decoding."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from edge_agent.sources.http import ApiServer, create_app
from edge_agent.testing import MemoryPublisher
from shared.images import MAX_JPEG_SCANS
from tests.shared.jpeg_bomb import progressive_jpeg, scan_bomb


@pytest.fixture
def client(make_settings: Callable[..., AgentSettings], engine: object) -> Iterator[httpx.Client]:
    settings = make_settings(route_max_prob_below=1.01, max_pixels=1_000_000)
    publisher = MemoryPublisher()
    with (
        Agent(settings, engine=engine, publisher=publisher) as agent,  # type: ignore[arg-type]
        ApiServer(create_app(agent)) as server,
        httpx.Client(base_url=server.url) as test_client,
    ):
        yield test_client


def test_scan_bomb_is_refused_with_422_and_the_reason(client: httpx.Client) -> None:
    bomb = scan_bomb(MAX_JPEG_SCANS * 4)
    response = client.post("/v1/frames", content=bomb, headers={"Content-Type": "image/jpeg"})
    assert response.status_code == 422
    body = response.json()
    assert body["reason"] == "jpeg_too_many_scans"
    assert "JPEG or PNG" in body["detail"]
    # The next, ordinary progressive frame is answered as usual.
    normal = progressive_jpeg()
    response = client.post("/v1/frames", content=normal, headers={"Content-Type": "image/jpeg"})
    assert response.status_code == 200, response.text
