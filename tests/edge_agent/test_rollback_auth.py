"""``POST /v1/model/rollback`` refuses what another site's page could send (real uvicorn)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from edge_agent.sources.http import ApiServer, create_app
from tests.edge_agent.test_http import MemoryPublisher


@pytest.fixture
def client(make_settings: Callable[..., AgentSettings], engine: object) -> Iterator[httpx.Client]:
    settings = make_settings(local_api_token="local-token")
    with (
        Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent,  # type: ignore[arg-type]
        ApiServer(create_app(agent)) as server,
        httpx.Client(base_url=server.url) as http,
    ):
        yield http


def test_a_cross_site_origin_is_refused(client: httpx.Client) -> None:
    answer = client.post("/v1/model/rollback", headers={"Origin": "https://evil.example"})
    assert answer.status_code == 403
    assert answer.json()["reason"] == "cross_site"


@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "multipart/form-data; b=x", "text/plain"]
)
def test_a_form_body_is_refused(client: httpx.Client, content_type: str) -> None:
    answer = client.post(
        "/v1/model/rollback", content=b"a=b", headers={"Content-Type": content_type}
    )
    assert answer.status_code == 403
    assert answer.json()["reason"] == "cross_site"


def test_a_local_client_and_a_same_origin_page_reach_the_updater(client: httpx.Client) -> None:
    # No earlier model to go back to: the updater's own 409, not the cross-site refusal.
    token = {"Authorization": "Bearer local-token"}
    plain = client.post("/v1/model/rollback", headers=token)
    same = client.post(
        "/v1/model/rollback",
        headers={"Origin": str(client.base_url).rstrip("/"), **token},
        json={},
    )
    for answer in (plain, same):
        assert answer.status_code == 409, answer.text
        assert answer.json()["reason"] != "cross_site"
