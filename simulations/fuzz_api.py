"""Schema fuzzing of the cloud API, run by the short test and ``scripts/fuzz.py``.

A real ``uvicorn`` server in a thread on a free loopback port serves the API over a
seeded database (SQLite here; any SQLAlchemy URL works). Schemathesis reads the
served OpenAPI document and, for every operation, sends generated requests: valid
ones (``positive``) and ones that break the schema (``negative``), with the admin
token so that the handlers themselves are reached, not only the auth check. Any 5xx
is a failure; every answer is counted by operation and status.
"""

from __future__ import annotations

import collections
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from cloud_service.announce import MemoryAnnouncer
from cloud_service.api import create_app
from cloud_service.settings import CloudSettings
from cloud_service.ui.seed import seed
from shared.broker import free_port

ADMIN_TOKEN = "schema-fuzz-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass
class Server:
    url: str
    state: Any


@contextmanager
def api_server(folder: Path, teacher: Path, database_url: str | None = None) -> Iterator[Server]:
    """The cloud API on ``database_url`` (SQLite under ``folder`` by default), seeded."""
    import uvicorn

    settings = CloudSettings(
        data_dir=folder / "data",
        database_url=database_url or f"sqlite:///{folder / 'api.db'}",
        teacher_model=teacher,
        admin_token=ADMIN_TOKEN,
        blob_fsync=False,
        rollout_tick_s=0,
        # No broker is listening here: nothing generated may reach a shared broker.
        mqtt_url=f"mqtt://127.0.0.1:{free_port()}",
        # The fuzzer sends thousands of requests from one address.
        rate_limit_enroll_per_min=0,
        rate_limit_login_per_min=0,
        rate_limit_upload_per_min=0,
    )
    app = create_app(settings, announcer=MemoryAnnouncer())
    state = app.state.edgeloop
    with state.sessions.begin() as session:
        seed(session=session, blobs=state.blobs, samples=20, agents=2, images=4)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="critical", lifespan="on", ws="none"
        )
    )
    thread = threading.Thread(target=server.run, name="schema-fuzz-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the API server did not start")
        time.sleep(0.05)
    try:
        yield Server(f"http://127.0.0.1:{port}", state)
    finally:
        server.should_exit = True
        thread.join(15)


@dataclass
class FuzzReport:
    """Answers by operation and status; 5xx answers with the request that caused them."""

    cases: int = 0
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    by_operation: collections.Counter[str] = field(default_factory=collections.Counter)
    server_errors: list[str] = field(default_factory=list)
    server_error_operations: collections.Counter[str] = field(default_factory=collections.Counter)
    transport_errors: list[str] = field(default_factory=list)
    no_cases: list[str] = field(default_factory=list)
    invalid_operations: list[str] = field(default_factory=list)
    operations: int = 0
    seconds: float = 0.0

    def row(self) -> dict[str, Any]:
        return {
            "target": "cloud API (schemathesis, OpenAPI)",
            "operations": self.operations,
            "cases": self.cases,
            "crashes": len(self.server_errors) + len(self.transport_errors),
            "first_crashes": (self.server_errors + self.transport_errors)[:5],
            "invalid_operations": len(self.invalid_operations),
            "server_errors_by_operation": dict(self.server_error_operations),
            "outcomes": dict(self.statuses.most_common(8)),
            "modes_without_cases": len(self.no_cases),
            "seconds": round(self.seconds, 1),
        }


def fuzz_api(base_url: str, *, examples: int, seed_: int = 0) -> FuzzReport:
    """``examples`` generated requests per operation and mode against ``base_url``."""
    import requests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import schemathesis
        from schemathesis.core.result import Err
        from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    report = FuzzReport()
    start = time.monotonic()
    http = requests.Session()
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            report.invalid_operations.append(str(result.err())[:300])
            continue
        operation = result.ok()
        report.operations += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def send(case: Any) -> None:
                _send(case, base_url, http, report)

            try:
                send()
            except Unsatisfiable:
                # Nothing to break: no parameters or body, so no negative case exists.
                report.no_cases.append(f"{operation.method.upper()} {operation.path} {mode.value}")
    http.close()
    report.seconds = time.monotonic() - start
    return report


def _send(case: Any, base_url: str, http: Any, report: FuzzReport) -> None:
    import requests

    name = f"{case.operation.method.upper()} {case.operation.path}"
    report.cases += 1
    try:
        response = case.call(base_url=base_url, session=http, headers=ADMIN, timeout=30)
    except requests.RequestException as exc:
        report.transport_errors.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
        return
    report.by_operation[name] += 1
    report.statuses[str(response.status_code)] += 1
    if response.status_code >= 500:
        report.server_error_operations[name] += 1
        report.server_errors.append(
            f"{name} -> {response.status_code}: {case.as_curl_command()}"[:500]
        )
