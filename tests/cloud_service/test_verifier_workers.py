"""``cloud-service verifier --workers N``: N verifier processes under one supervisor."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest
from sqlalchemy import create_engine, func, select

from cloud_service.db.models import Verdict
from cloud_service.service import run_verifiers, worker_settings
from cloud_service.settings import CloudSettings
from shared.broker import free_port
from shared.errors import ConfigError
from tests.cloud_service.conftest import make_envelope, publisher, wait_until

SAMPLES = 80


def test_worker_zero_keeps_the_client_id_and_the_others_get_their_own(
    make_settings: Callable[..., CloudSettings],
) -> None:
    settings = make_settings(verifier_client_id="verifier-eu", ort_intra_op_threads=0)
    ids = [worker_settings(settings, i, 3).verifier_client_id for i in range(3)]
    assert ids == ["verifier-eu", "verifier-eu-w1", "verifier-eu-w2"]
    cores = os.cpu_count() or 1
    assert worker_settings(settings, 1, 2).ort_intra_op_threads == max(1, cores // 2)
    assert worker_settings(settings, 1, 2).verifier_workers == 1
    pinned = make_settings(ort_intra_op_threads=3, verifier_decode_threads=5)
    assert worker_settings(pinned, 1, 2).ort_intra_op_threads == 3
    assert worker_settings(settings, 0, 1) is settings
    # Decode threads: one per core of each worker's share, at most 4; a set one stays.
    share = max(1, cores // 2)
    assert worker_settings(settings, 1, 2).verifier_decode_threads == min(4, share)
    assert worker_settings(pinned, 1, 2).verifier_decode_threads == 5


def test_decode_threads_are_one_per_core_up_to_four() -> None:
    from cloud_service.verifier_ingest import auto_decode_threads

    assert [auto_decode_threads(n) for n in (1, 2, 3, 4, 8, 64)] == [1, 2, 3, 4, 4, 4]


def test_several_workers_refuse_sqlite(make_settings: Callable[..., CloudSettings]) -> None:
    settings = make_settings(database_url="sqlite:///x.db")
    with pytest.raises(ConfigError, match="need PostgreSQL"):
        run_verifiers(settings, host="127.0.0.1", port=free_port(), workers=2)


@pytest.mark.mqtt
def test_several_workers_refuse_a_broker_without_mqtt_v5(
    make_settings: Callable[..., CloudSettings], embedded_broker: object
) -> None:
    settings = make_settings(
        mqtt_url=embedded_broker.url,  # type: ignore[attr-defined]
        database_url="postgresql+psycopg://nobody@127.0.0.1:1/none",
    )
    with pytest.raises(ConfigError, match="MQTT v5"):
        run_verifiers(settings, host="127.0.0.1", port=free_port(), workers=2)


def _two_free_ports() -> int:
    """A port p with p + 1 free too."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two neighbouring free ports")


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(predicate: Callable[[], bool], timeout: float) -> bool:
    return wait_until(predicate, timeout, step=0.1)


def _workers(supervisor: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The supervisor's worker processes (not multiprocessing's resource tracker)."""
    found = []
    for child in psutil.Process(supervisor.pid).children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # gone, or a zombie not reaped yet
            continue
    return found


def _verdicts_stored(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(
        float(value)
        for value in re.findall(r"^edgeloop_verdicts_total\{[^}]*\} (\S+)$", text, re.M)
    )


@pytest.mark.mqtt
@pytest.mark.sql
@pytest.mark.slow
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_two_workers_split_the_samples_and_a_dead_one_is_started_again(
    broker: object, topics: object, database_url: str, teacher_path: Path, tmp_path: Path
) -> None:
    url, protocol = broker.url, broker.protocol  # type: ignore[attr-defined]
    if protocol != "5":
        pytest.skip("several verifier workers need an MQTT v5 broker (Mosquitto 2)")
    fleet, agent = "fleet-a", "cam-1"
    env = {
        **os.environ,
        "EDGELOOP_MQTT_URL": url,
        "EDGELOOP_TOPIC_PREFIX": topics.prefix,  # type: ignore[attr-defined]
        "EDGELOOP_DATABASE_URL": database_url,
        "EDGELOOP_DATA_DIR": str(tmp_path / "data"),
        "EDGELOOP_TEACHER_MODEL": str(teacher_path),
        "EDGELOOP_VERIFIER_CLIENT_ID": f"workers-{uuid.uuid4().hex[:8]}",
        "EDGELOOP_VERIFIER_GROUP": f"workers-{uuid.uuid4().hex[:6]}",
        "EDGELOOP_MQTT_SESSION_EXPIRY_S": "60",
        "EDGELOOP_BLOB_FSYNC": "false",
        "EDGELOOP_REVIEW_AUDIT_SHARE": "0",
        "EDGELOOP_LOG_LEVEL": "INFO",
    }
    port = _two_free_ports()
    log = tmp_path / "verifiers.log"
    with log.open("ab") as handle:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "cloud_service", "verifier", "--workers=2", f"--port={port}"],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    engine = create_engine(database_url)

    def verdicts() -> int:
        with engine.connect() as conn:
            return int(conn.scalar(select(func.count()).select_from(Verdict)) or 0)

    try:
        assert _wait(lambda: _ready(port) and _ready(port + 1), 90), log.read_text()
        workers = _workers(supervisor)
        assert len(workers) == 2, log.read_text()

        pub = publisher(url, protocol)
        try:
            for i in range(SAMPLES):
                _, envelope = make_envelope(fleet=fleet, agent=agent, priority=i % 8)
                pub.publish(topics.samples(fleet, agent), envelope, qos=1)  # type: ignore[attr-defined]
            assert _wait(lambda: verdicts() >= SAMPLES, 60), f"{verdicts()} verdicts"
        finally:
            pub.loop_stop()
            pub.disconnect()
        # Each sample verified once, and both workers took a share.
        assert verdicts() == SAMPLES
        shares = [_verdicts_stored(port), _verdicts_stored(port + 1)]
        assert sum(shares) == SAMPLES and all(share > 0 for share in shares), shares

        # A worker that dies is started again, on its own port.
        workers[1].kill()
        assert _wait(
            lambda: (
                len(_workers(supervisor)) == 2
                and workers[1] not in _workers(supervisor)
                and _ready(port)
                and _ready(port + 1)
            ),
            60,
        ), log.read_text()
        assert "exited with code" in log.read_text()
    finally:
        supervisor.send_signal(signal.SIGTERM)
        try:
            code = supervisor.wait(45)
        except subprocess.TimeoutExpired:
            supervisor.kill()
            raise
        engine.dispose()
    assert code == 0, log.read_text()
    assert not _ready(port) and not _ready(port + 1)
