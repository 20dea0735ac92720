"""Crash safety: SIGKILL the verifier mid-stream, restart it, count rows.

Every published sample must end up stored exactly once with exactly one verdict.
This relies on: acks only after commit (an unacked message is redelivered from
the broker's copy of the verifier's persistent session), ON CONFLICT on sample_id
(a message acked-late is stored once), and the start-up recovery scan (a stored
sample whose verdict was lost with the process is verified again).

Shared subscriptions and offline sessions (Mosquitto 2, measured by this test):
messages published to ``$share/verifiers/...`` while the only member's session is
offline are queued in that session and delivered when it reconnects with
clean_start=False; so are the unacked in-flight ones.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import paho.mqtt.client as mqtt
import pytest
from sqlalchemy import create_engine, func, select, text

from cloud_service.db.models import Sample, Verdict
from shared.broker import free_port
from tests.cloud_service.conftest import make_envelope, publisher

pytestmark = [pytest.mark.mqtt, pytest.mark.sql, pytest.mark.slow]

TOTAL = 300
KILL_AFTER = 60


def _start(env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "cloud_service", "verifier", "--port", str(port)],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"verifier exited with {process.returncode}: {log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"verifier did not become ready: {log.read_text()}")


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_sigkill_mid_stream_loses_nothing_and_duplicates_nothing(
    broker, topics, database_url, teacher_path, tmp_path
) -> None:
    fleet, agent = "fleet-a", "cam-1"
    env = {
        **os.environ,
        "EDGELOOP_MQTT_URL": broker.url,
        "EDGELOOP_TOPIC_PREFIX": topics.prefix,
        "EDGELOOP_DATABASE_URL": database_url,
        "EDGELOOP_DATA_DIR": str(tmp_path / "data"),
        "EDGELOOP_TEACHER_MODEL": str(teacher_path),
        "EDGELOOP_VERIFIER_CLIENT_ID": f"crash-verifier-{uuid.uuid4().hex[:8]}",
        "EDGELOOP_MQTT_SESSION_EXPIRY_S": "120",
        "EDGELOOP_LOG_LEVEL": "WARNING",
        "EDGELOOP_INGEST_MAX_BATCH": "20",
    }
    port = free_port()
    log = tmp_path / "verifier.log"
    engine = create_engine(database_url)

    def count(model: type) -> int:
        with engine.connect() as conn:
            return int(conn.scalar(select(func.count()).select_from(model)) or 0)

    process = _start(env, port, log)
    sent: list[str] = []
    pub = publisher(broker.url, broker.protocol)
    envelopes = [make_envelope(fleet=fleet, agent=agent) for _ in range(TOTAL)]
    done = threading.Event()
    published: list[mqtt.MQTTMessageInfo] = []

    def publish_all() -> None:
        for header, envelope in envelopes:
            sent.append(header.sample_id)
            published.append(pub.publish(topics.samples(fleet, agent), envelope, qos=1))
            time.sleep(0.004)  # ~250/s: the stream is still flowing when the kill comes
        done.set()

    thread = threading.Thread(target=publish_all)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while count(Sample) < KILL_AFTER and time.monotonic() < deadline:
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        stored_at_kill, verdicts_at_kill = count(Sample), count(Verdict)
        thread.join(60)
        assert done.is_set()
        for info in published:  # the broker has everything; the verifier is still down
            info.wait_for_publish(60)
        assert all(info.is_published() for info in published)
        process = _start(env, port, log)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (count(Sample) < TOTAL or count(Verdict) < TOTAL):
            time.sleep(0.1)
        # A late duplicate cannot add a row (one sample and one verdict per sample id);
        # what follows checks that none is missing and that those constraints hold.
        with engine.connect() as conn:
            samples = conn.scalar(select(func.count()).select_from(Sample))
            distinct = conn.scalar(select(func.count(func.distinct(Sample.sample_id))))
            verdicts = conn.scalar(select(func.count()).select_from(Verdict))
            per_sample = conn.execute(
                text("SELECT max(c) FROM (SELECT count(*) c FROM verdicts GROUP BY sample_id) t")
            ).scalar()
            stored_ids = set(conn.scalars(select(Sample.sample_id)).all())
        print(
            f"\ncrash test: published={TOTAL} stored_at_kill={stored_at_kill}"
            f" verdicts_at_kill={verdicts_at_kill} after_restart: samples={samples}"
            f" distinct={distinct} verdicts={verdicts} max_verdicts_per_sample={per_sample}"
            f" missing={len(set(sent) - stored_ids)}"
        )
        assert stored_at_kill < TOTAL, "the kill came after everything was stored"
        assert stored_ids == set(sent)
        assert samples == distinct == TOTAL
        assert verdicts == TOTAL and per_sample == 1
    finally:
        pub.loop_stop()
        pub.disconnect()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        engine.dispose()
    assert process.returncode == 0, log.read_text()[-2000:]
