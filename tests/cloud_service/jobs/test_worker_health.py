"""The distill worker's probes, over HTTP, against a real worker loop."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
from sqlalchemy import create_engine

from cloud_service.db.session import make_engine, make_session_factory, upgrade_database
from cloud_service.jobs.health import HealthServer
from cloud_service.jobs.worker import DistillWorker, JobContext, JobOutcome
from tests.cloud_service.conftest import wait_until


def _runner(ctx: JobContext) -> JobOutcome:
    return JobOutcome(metrics={})


def _get(port: int, path: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)


def test_probes_follow_the_worker_loop(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    upgrade_database(url)
    engine = make_engine(url)
    worker = DistillWorker(make_session_factory(engine), runner=_runner, poll_s=0.02)
    loop = threading.Thread(target=worker.run, daemon=True)
    with HealthServer(worker.health, "127.0.0.1", 0) as probes:
        loop.start()
        # Ready once the loop has been round (the wait is a safety net, not a bound).
        assert wait_until(lambda: _get(probes.port, "/readyz").status_code == 200, 60)
        alive, ready = _get(probes.port, "/healthz"), _get(probes.port, "/readyz")
        assert alive.status_code == 200 and ready.status_code == 200, alive.text
        assert "idle" in alive.json()["detail"]
        assert _get(probes.port, "/metrics").status_code == 404

        # The database goes away: the loop keeps running, no longer ready.
        broken = create_engine(f"sqlite:///{tmp_path / 'missing' / 'jobs.db'}")
        worker.sessions = make_session_factory(broken)
        assert wait_until(lambda: _get(probes.port, "/readyz").status_code == 503, 60), (
            "readiness did not follow the database"
        )
        assert loop.is_alive()
        # Liveness does not follow the database: an outage must not restart every replica.
        assert _get(probes.port, "/healthz").status_code == 200

        # A loop that stopped going round is not alive.
        worker.stop()
        loop.join(60)
        worker.last_contact -= 3600
        assert _get(probes.port, "/healthz").status_code == 503
    engine.dispose()
    broken.dispose()
