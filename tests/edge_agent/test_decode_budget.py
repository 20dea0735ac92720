"""An upload past the decode budget at the agent: 422, its decoder killed, others answered."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from edge_agent import imaging
from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from edge_agent.sources.http import ApiServer, create_app
from edge_agent.testing import MemoryPublisher
from tests.edge_agent.conftest import image_bytes
from tests.shared import decoders
from tests.shared.decoders import slow_progressive_jpeg
from tests.shared.jpeg_bomb import progressive_jpeg

JPEG = {"Content-Type": "image/jpeg"}


@pytest.fixture
def served(
    make_settings: Callable[..., AgentSettings], engine: object
) -> Iterator[tuple[Agent, httpx.Client]]:
    # A budget of 1 ms: a 2000 x 2000 progressive JPEG takes tens of milliseconds to
    # decode anywhere, while baseline frames decode in-process, outside any budget.
    settings = make_settings(route_max_prob_below=1.01, decode_budget_ms=1.0, decode_workers=2)
    with (
        Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent,  # type: ignore[arg-type]
        ApiServer(create_app(agent)) as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        yield agent, client


def test_a_frame_past_the_decode_budget_gets_422_and_other_frames_are_answered(
    served: tuple[Agent, httpx.Client],
) -> None:
    agent, client = served
    bomb = slow_progressive_jpeg()
    normal = [image_bytes(seed=i) for i in range(12)]

    def post(body: bytes) -> httpx.Response:
        return client.post("/v1/frames", content=body, headers=JPEG)

    with ThreadPoolExecutor(4) as threads:
        bombs = [threads.submit(post, bomb) for _ in range(2)]
        answers = list(threads.map(post, normal))
        refused = [future.result() for future in bombs]
    assert [r.status_code for r in answers] == [200] * len(normal)
    for response in refused:
        assert response.status_code == 422, response.text
        assert response.json()["reason"] == "image_decode_timeout"
    assert agent.decode_pool is not None
    assert agent.decode_pool.timeouts == 2
    # The killed decoders were replaced: the agent still answers frames of every kind.
    assert post(image_bytes(seed=99)).status_code == 200
    assert post(image_bytes(fmt="PNG", seed=98)).status_code == 200


def test_a_normal_progressive_frame_is_decoded_in_the_pool_within_its_budget(
    make_settings: Callable[..., AgentSettings], engine: object
) -> None:
    settings = make_settings(route_max_prob_below=1.01)
    with (
        Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent,  # type: ignore[arg-type]
        ApiServer(create_app(agent)) as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        response = client.post("/v1/frames", content=progressive_jpeg(), headers=JPEG)
        assert response.status_code == 200, response.text
        assert agent.decode_pool is not None
        assert agent.decode_pool.decoded == 1
        pids = [pid for pid in agent.decode_pool.pids if pid is not None]
        assert len(pids) == 1  # the worker started for it
    assert agent.decode_pool.pids == [None, None]  # and stopped with the agent


def test_a_decoder_crash_refuses_the_frame_with_422_and_the_agent_heals(
    make_settings: Callable[..., AgentSettings], engine: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(route_max_prob_below=1.01, decode_workers=1)
    with (
        Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent,  # type: ignore[arg-type]
        ApiServer(create_app(agent)) as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        # The worker runs the decoder the agent names: one that segfaults, as a decoder bug would.
        with monkeypatch.context() as patch:
            patch.setattr(imaging, "model_tensor", decoders.crash)
            response = client.post("/v1/frames", content=progressive_jpeg(), headers=JPEG)
        assert response.status_code == 422, response.text
        assert response.json()["reason"] == "image_decode_failed"
        response = client.post("/v1/frames", content=progressive_jpeg(seed=1), headers=JPEG)
        assert response.status_code == 200, response.text
        assert agent.decode_pool is not None
        assert (agent.decode_pool.crashes, agent.decode_pool.decoded) == (1, 1)
