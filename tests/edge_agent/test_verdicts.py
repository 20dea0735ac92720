"""Verdicts on the edge: the user's webhook (retries, bounded queue, metrics) and the
verdict store that keeps ``GET /v1/samples/{id}`` answering across a restart."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from edge_agent.sources.http import ApiServer, create_app
from edge_agent.testing import MemoryPublisher
from shared.messages import Verdict, decode_message, encode_message, encode_verdicts

HOLD_SAFETY_NET_S = 120.0  # a held answer goes by itself after this, should a test not release it


class WebhookReceiver:
    """A local HTTP server standing in for the user's application.

    ``statuses`` are answered in order (then 200). With ``hold``, every answer waits
    until ``release`` is set; ``holding`` counts the posts held right now.
    """

    def __init__(self, statuses: list[int] | None = None, *, hold: bool = False) -> None:
        self.statuses = list(statuses or [])
        self.hold = hold
        self.holding = 0
        self.received: list[dict[str, Any]] = []
        self.attempts = 0
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.attempts += 1
                if receiver.hold:
                    receiver.holding += 1
                    receiver.release.wait(HOLD_SAFETY_NET_S)
                    receiver.holding -= 1
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                if status == 200:
                    receiver.received.append(json.loads(body))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks/verdicts"

    def __enter__(self) -> WebhookReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _verdict(sample_id: str, label: int, agrees: bool = True) -> bytes:
    return encode_message(
        Verdict(
            sample_id=sample_id,
            fleet="test-fleet",
            agent="agent-1",
            teacher_model="teacher",
            teacher_version="7",
            scores=[0.7, 0.1, 0.1, 0.1],
            label=label,
            confidence=0.7,
            agrees_with_edge=agrees,
            verified_at=datetime.now(UTC),
        )
    )


def _metric(agent: Agent, outcome: str) -> float:
    value = agent.telemetry.registry.get_sample_value(
        "edgeloop_agent_webhook_verdicts_total", {"outcome": outcome}
    )
    return value or 0.0


@pytest.fixture
def frame_ids(make_image: Callable[..., bytes]) -> Callable[[Agent, int], list[str]]:
    def answer(agent: Agent, n: int) -> list[str]:
        return [
            agent.process_upload(make_image(seed=seed), source="http").sample_id
            for seed in range(n)
        ]

    return answer


def test_webhook_retries_with_backoff_then_delivers(
    make_settings: Callable[..., AgentSettings],
    engine: object,
    frame_ids: Callable[[Agent, int], list[str]],
    until: Callable[..., bool],
) -> None:
    publisher = MemoryPublisher()
    with WebhookReceiver(statuses=[503, 500]) as hook:
        settings = make_settings(
            webhook_url=hook.url, webhook_backoff_min_s=0.05, webhook_backoff_max_s=0.2
        )
        with Agent(settings, engine=engine, publisher=publisher) as agent:  # type: ignore[arg-type]
            (sample_id,) = frame_ids(agent, 1)
            publisher.deliver(agent.topic_verdicts, _verdict(sample_id, 2))
            assert until(lambda: len(hook.received) == 1, timeout=30)
            assert hook.attempts == 3
            assert hook.received[0]["sample_id"] == sample_id
            assert hook.received[0]["label"] == 2
            assert hook.received[0]["teacher_version"] == "7"
            # The receiver records the post before it answers; the agent counts the
            # delivery once the answer is back.
            assert until(lambda: _metric(agent, "delivered") == 1, timeout=30)
            assert _metric(agent, "retried") == 2
            with ApiServer(create_app(agent)) as server:
                text = httpx.get(server.url + "/metrics").text
            assert 'edgeloop_agent_webhook_verdicts_total{outcome="delivered"} 1.0' in text


def test_webhook_gives_up_on_a_refusal_and_after_its_attempts(
    make_settings: Callable[..., AgentSettings],
    engine: object,
    frame_ids: Callable[[Agent, int], list[str]],
    until: Callable[..., bool],
) -> None:
    publisher = MemoryPublisher()
    # 404 is final at once; then three 503s use up the second verdict's three attempts.
    with WebhookReceiver(statuses=[404, 503, 503, 503]) as hook:
        settings = make_settings(
            webhook_url=hook.url,
            webhook_attempts=3,
            webhook_backoff_min_s=0.02,
            webhook_backoff_max_s=0.05,
        )
        with Agent(settings, engine=engine, publisher=publisher) as agent:  # type: ignore[arg-type]
            first, second = frame_ids(agent, 2)
            publisher.deliver(agent.topic_verdicts, _verdict(first, 1))
            publisher.deliver(agent.topic_verdicts, _verdict(second, 1))
            assert until(lambda: _metric(agent, "failed") == 2, timeout=30)
            assert hook.attempts == 4
            assert hook.received == []
            assert _metric(agent, "retried") == 2
            assert _metric(agent, "delivered") == 0


def test_a_stuck_webhook_never_blocks_verdicts_or_inference(
    make_settings: Callable[..., AgentSettings],
    engine: object,
    frame_ids: Callable[[Agent, int], list[str]],
    until: Callable[..., bool],
) -> None:
    publisher = MemoryPublisher()
    with WebhookReceiver(hold=True) as hook:
        # The agent would wait longer for the webhook than the webhook holds its answer:
        # had handling a verdict or a frame waited for it, the hold would be over.
        settings = make_settings(
            webhook_url=hook.url, webhook_queue=2, webhook_timeout_s=2 * HOLD_SAFETY_NET_S
        )
        with Agent(settings, engine=engine, publisher=publisher) as agent:  # type: ignore[arg-type]
            ids = frame_ids(agent, 6)
            publisher.deliver(agent.topic_verdicts, _verdict(ids[0], 0))
            assert until(lambda: hook.holding == 1, timeout=30)  # now stuck with the server
            for sample_id in ids[1:]:
                publisher.deliver(agent.topic_verdicts, _verdict(sample_id, 0))
            # Every verdict was handled while the first post was still held.
            assert hook.holding == 1 and hook.attempts == 1
            # Two wait in the queue, the other three are dropped and counted.
            assert _metric(agent, "dropped") == 3
            assert agent.telemetry.verdict_count == 6
            assert all(agent.sample(i)["verdict"]["label"] == 0 for i in ids)  # type: ignore[index]
            frame_ids(agent, 3)
            assert hook.holding == 1  # inference went on while the webhook was stuck
            assert agent.status()["frames_total"] == 9
            hook.release.set()


def test_verdicts_survive_a_restart(
    make_settings: Callable[..., AgentSettings],
    engine: object,
    frame_ids: Callable[[Agent, int], list[str]],
) -> None:
    settings = make_settings(route_max_prob_below=1.01)
    publisher = MemoryPublisher()
    with Agent(settings, engine=engine, publisher=publisher) as agent:  # type: ignore[arg-type]
        (sample_id,) = frame_ids(agent, 1)
        answered = agent.sample(sample_id)
        assert answered is not None
        publisher.deliver(agent.topic_verdicts, _verdict(sample_id, 3, agrees=False))

    with (
        Agent(settings, engine=engine, publisher=MemoryPublisher()) as again,  # type: ignore[arg-type]
        ApiServer(create_app(again)) as server,
    ):
        response = httpx.get(f"{server.url}/v1/samples/{sample_id}")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["sample_id"] == sample_id
    assert body["verdict"]["label"] == 3
    assert body["verdict"]["agrees_with_edge"] is False
    assert body["result"] == answered["result"]


def test_a_batch_of_verdicts_reaches_every_sample_and_a_bad_batch_is_refused_whole(
    make_settings: Callable[..., AgentSettings],
    engine: object,
    frame_ids: Callable[[Agent, int], list[str]],
) -> None:
    settings = make_settings(route_max_prob_below=1.01)
    publisher = MemoryPublisher()
    with Agent(settings, engine=engine, publisher=publisher) as agent:  # type: ignore[arg-type]
        ids = frame_ids(agent, 3)
        verdicts = [
            decode_message(_verdict(sample_id, label, agrees=label != 1), Verdict)
            for label, sample_id in enumerate(ids)
        ]
        ((_fleet, _agent, batch),) = encode_verdicts(verdicts, per_message=100)
        assert json.loads(batch)["schema"] == "edgeloop.verdicts"
        publisher.deliver(agent.topic_verdicts, batch)
        for label, sample_id in enumerate(ids):
            found = agent.sample(sample_id)
            assert found is not None and found["verdict"]["label"] == label
        # One verdict in a batch is not valid (label outside its scores): the whole
        # message is refused and counted, and nothing of it is taken.
        bad = json.loads(batch)
        bad["verdicts"][0]["sample_id"] = "0190f5c2-7a1b-7c3d-8e4f-0123456789ab"
        bad["verdicts"][1]["label"] = 99
        publisher.deliver(agent.topic_verdicts, json.dumps(bad).encode())
        assert agent.sample("0190f5c2-7a1b-7c3d-8e4f-0123456789ab") is None
        refused = agent.telemetry.registry.get_sample_value(
            "edgeloop_agent_malformed_messages_total",
            {"kind": "verdict", "reason": "invalid_message"},
        )
        assert refused == 1.0


def test_verdict_retention_is_bounded(
    make_settings: Callable[..., AgentSettings],
    engine: object,
    frame_ids: Callable[[Agent, int], list[str]],
) -> None:
    settings = make_settings(verdicts_kept=2, results_kept=1)
    publisher = MemoryPublisher()
    with Agent(settings, engine=engine, publisher=publisher) as agent:  # type: ignore[arg-type]
        ids = frame_ids(agent, 3)
        for sample_id in ids:
            publisher.deliver(agent.topic_verdicts, _verdict(sample_id, 1))
        assert agent.verdicts.count() == 2
        assert agent.status()["verdict_write_errors"] == 0
    with Agent(settings, engine=engine, publisher=MemoryPublisher()) as again:  # type: ignore[arg-type]
        assert again.sample(ids[0]) is None
        assert [again.sample(i)["verdict"]["sample_id"] for i in ids[1:]] == ids[1:]  # type: ignore[index]


def test_no_webhook_by_default(
    make_settings: Callable[..., AgentSettings],
    engine: object,
    frame_ids: Callable[[Agent, int], list[str]],
) -> None:
    publisher = MemoryPublisher()
    with Agent(make_settings(), engine=engine, publisher=publisher) as agent:  # type: ignore[arg-type]
        assert "webhook-loop" not in {t.name for t in threading.enumerate()}
        (sample_id,) = frame_ids(agent, 1)
        publisher.deliver(agent.topic_verdicts, _verdict(sample_id, 1))
        assert agent.sample(sample_id)["verdict"]["label"] == 1  # type: ignore[index]
        assert _metric(agent, "dropped") == 0


def test_webhook_url_must_be_http(make_settings: Callable[..., AgentSettings]) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="http:// or https://"):
        make_settings(webhook_url="ftp://example.com/hook")


def test_verdicts_kept_in_the_spool_file_move_to_their_own(
    make_settings: Callable[..., AgentSettings], engine: object
) -> None:
    """Agents before the split kept verdicts in a table of the spool's file: the first
    start moves them to the verdict store's file and drops the old table."""
    import sqlite3

    settings = make_settings()
    spool_path = settings.resolved_spool_path
    spool_path.parent.mkdir(parents=True, exist_ok=True)
    old = sqlite3.connect(spool_path)
    old.execute(
        "CREATE TABLE verdicts (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
        " sample_id TEXT NOT NULL UNIQUE, received_at REAL NOT NULL,"
        " verdict TEXT NOT NULL, result TEXT)"
    )
    old.execute(
        "INSERT INTO verdicts (sample_id, received_at, verdict, result) VALUES (?, ?, ?, ?)",
        ("kept-before", 1.0, json.dumps({"label": 7}), json.dumps({"label": "7"})),
    )
    old.commit()
    old.close()

    with Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent:  # type: ignore[arg-type]
        assert agent.verdicts.path == settings.resolved_verdicts_path != spool_path
        assert agent.sample("kept-before") == {
            "verdict": {"label": 7},
            "result": {"label": "7"},
        }
    tables = {
        name
        for (name,) in sqlite3.connect(spool_path).execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'"
        )
    }
    assert "verdicts" not in tables and "samples" in tables
    # A second start finds nothing to move and keeps what was moved.
    with Agent(settings, engine=engine, publisher=MemoryPublisher()) as again:  # type: ignore[arg-type]
        assert again.verdicts.count() == 1


def test_a_burst_of_verdicts_is_stored_in_one_transaction(tmp_path: Path) -> None:
    from edge_agent.agent import VerdictStore

    store = VerdictStore(tmp_path / "verdicts.db", keep=100, window_s=5.0)
    ids = [f"sample-{i}" for i in range(20)]
    for i, sample_id in enumerate(ids):
        store.put(sample_id, {"label": i}, {"label": str(i)} if i % 2 else None, now=1.0)
    # Readable while queued, before the writer has stored anything.
    assert store.get(ids[3]) == {"verdict": {"label": 3}, "result": {"label": "3"}}
    # A verdict replaced while queued keeps the edge's answer it already had.
    store.put(ids[3], {"label": 30}, None, now=2.0)
    assert store.get(ids[3]) == {"verdict": {"label": 30}, "result": {"label": "3"}}
    assert store.count() == 20  # flushes: the whole burst in one commit
    assert store.commits == 1
    store.put(ids[3], {"label": 31}, None, now=3.0)  # replaced again once stored
    store.close()  # writes what is queued

    again = VerdictStore(tmp_path / "verdicts.db", keep=100)
    assert again.get(ids[3]) == {"verdict": {"label": 31}, "result": {"label": "3"}}
    assert again.get(ids[0]) == {"verdict": {"label": 0}}
    assert again.count() == 20
    again.close()


def test_a_failed_verdict_write_is_counted_and_the_writer_goes_on(tmp_path: Path) -> None:
    import sqlite3

    from edge_agent.agent import VerdictStore

    store = VerdictStore(tmp_path / "verdicts.db", keep=100, window_s=0.0)
    working = store._db
    broken = sqlite3.connect(":memory:", check_same_thread=False)
    broken.close()
    store._db = broken  # every statement now raises sqlite3.ProgrammingError
    store.put("lost", {"label": 1}, None, now=1.0)
    store.flush()
    assert store.write_errors == 1
    store._db = working
    store.put("kept", {"label": 2}, None, now=2.0)
    assert store.count() == 1
    assert store.get("kept") == {"verdict": {"label": 2}}
    store.close()
