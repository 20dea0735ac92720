"""The agent's parts start and stop together, and its health names every thread they run."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings, FolderSource
from edge_agent.testing import MemoryPublisher

_PART_THREADS = {
    "uplink-pump",
    "verdict-writer",
    "webhook-loop",
    "heartbeat-loop",
    "model-updater",
    "folder-inbox",
}


def test_health_names_each_parts_threads_and_stop_leaves_none(
    make_settings: Callable[..., AgentSettings], engine: object, tmp_path: Path
) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    settings = make_settings(
        webhook_url="http://127.0.0.1:9/hooks/verdicts",
        folders=[FolderSource(name="inbox", path=inbox)],
    )
    with Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent:  # type: ignore[arg-type]
        health = agent.health()
        running = {t.name for t in threading.enumerate()}
    assert health["ready"] is True and health["alive"] is True
    parts = health["parts"]
    assert isinstance(parts, dict)
    assert {part: set(threads) for part, threads in parts.items()} == {
        "forwarding": {"pump"},
        "verdicts": {"loop", "writer"},
        "status": {"loop"},
        "updater": {"updater"},
        "source:inbox": {"inbox"},
    }
    assert parts["forwarding"]["pump"]["alive"] is True
    assert running >= _PART_THREADS
    assert not _PART_THREADS & {t.name for t in threading.enumerate()}
    after = agent.health()
    assert after["ready"] is False and after["alive"] is False
