"""API hardening: agent tokens scoped, rate limits with Retry-After, headers, no secrets logged."""

from __future__ import annotations

import asyncio
import logging
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cloud_service.api import create_app
from cloud_service.db import crud
from cloud_service.security import RateLimiter, RateLimitMiddleware, content_policy

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Starlette wants httpx2; the httpx we have works
    from fastapi.testclient import TestClient

ADMIN = {"Authorization": "Bearer test-admin-token"}
PASSWORD = "correct horse battery staple"


@pytest.fixture
def api(make_settings: Any, tmp_path: Path) -> Iterator[TestClient]:
    settings = make_settings(
        database_url=f"sqlite:///{tmp_path / 'sec.db'}",
        admin_token="test-admin-token",
        rollout_tick_s=0,
        rate_limit_enroll_per_min=6.0,
        rate_limit_login_per_min=6.0,
        rate_limit_burst=3,
    )
    app = create_app(settings)
    with TestClient(app) as client:
        with app.state.edgeloop.sessions.begin() as session:
            crud.create_user(session=session, username="ada", password=PASSWORD, role="admin")
        yield client


def _enroll(api: TestClient, agent: str) -> dict[str, Any]:
    token = api.post(
        "/v1/enrollment-tokens", json={"fleet": "fleet-a", "agent_id": agent}, headers=ADMIN
    ).json()["token"]
    answer: dict[str, Any] = api.post("/v1/enroll", json={"token": token}).json()
    return answer


def test_agent_token_reaches_no_admin_or_other_agent_data(api: TestClient) -> None:
    a = _enroll(api, "cam-a")
    _enroll(api, "cam-b")
    headers = {"Authorization": f"Bearer {a['api_token']}"}
    for method, path in [
        ("GET", "/v1/agents"),
        ("GET", "/v1/agents/cam-b"),
        ("GET", "/v1/agents/cam-a"),
        ("GET", "/v1/samples?agent_id=cam-b"),
        ("GET", "/v1/dead-letters"),
        ("POST", "/v1/enrollment-tokens"),
        ("GET", "/v1/models"),
        ("POST", "/v1/rollouts"),
    ]:
        response = api.request(method, path, headers=headers, json={"fleet": "fleet-a"})
        assert response.status_code in (401, 403, 404), (path, response.status_code)
        assert response.status_code != 200
    # The admin token still works; a made-up token does not.
    assert api.get("/v1/agents", headers=ADMIN).status_code == 200
    assert api.get("/v1/agents", headers={"Authorization": "Bearer ela_nope"}).status_code == 401


def test_security_headers_on_api_and_ui(api: TestClient) -> None:
    for path in ("/healthz", "/v1/agents", "/ui/login"):
        response = api.get(path, headers=ADMIN)
        h = response.headers
        assert h["x-content-type-options"] == "nosniff"
        assert h["x-frame-options"] == "DENY"
        assert h["referrer-policy"] == "no-referrer"
        csp = h["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "'unsafe-inline'" not in csp
    assert api.get("/v1/agents", headers=ADMIN).headers["cache-control"] == "no-store"
    # Every inline bootstrap script of the UI is allowed by hash, nothing else inline.
    assert content_policy().count("'sha256-") >= 1


def test_enrollment_is_rate_limited_with_retry_after(api: TestClient) -> None:
    codes = [api.post("/v1/enroll", json={"token": f"bogus-{i}"}).status_code for i in range(6)]
    assert 429 not in codes[:3]  # refused on their merits (bad token)
    assert codes[3:] == [429, 429, 429]
    refused = api.post("/v1/enroll", json={"token": "x"})
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    metrics = api.get("/metrics").text
    assert 'edgeloop_http_rate_limited_total{group="enroll"}' in metrics


def test_inventing_bearer_tokens_buys_no_fresh_buckets(api: TestClient) -> None:
    # Each request carries a different made-up token: all are charged to the address.
    codes = [
        api.post(
            "/v1/enrollment-tokens",
            json={"fleet": "fleet-a"},
            headers={"Authorization": f"Bearer ela_made-up-{i}"},
        ).status_code
        for i in range(6)
    ]
    assert codes == [401, 401, 401, 429, 429, 429], codes
    codes = [
        api.post(
            "/v1/enroll", json={"token": "x"}, headers={"Authorization": f"Bearer other-{i}"}
        ).status_code
        for i in range(2)
    ]
    assert codes == [429, 429], codes  # the same address, the same empty bucket


def test_authenticated_principal_has_its_own_bucket(api: TestClient) -> None:
    for i in range(4):  # the address's bucket is empty now
        api.post("/v1/enroll", json={"token": f"bogus-{i}"}, headers={"Authorization": "Bearer x"})
    assert api.post("/v1/enroll", json={"token": "bogus"}).status_code == 429
    # The admin authenticates, so it is charged to "admin", not to the shared address.
    codes = [
        api.post("/v1/enrollment-tokens", json={"fleet": "fleet-a"}, headers=ADMIN).status_code
        for _ in range(4)
    ]
    assert codes == [201, 201, 201, 429], codes  # and its own bucket is limited too


def test_client_key_is_the_address_unless_the_token_authenticates() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not reached")

    known = {"good-token": "agent:fleet-a/cam-1"}
    limiter = RateLimitMiddleware(app, limits={}, authenticate=known.get)

    def scope(peer: str, auth: bytes | None) -> dict[str, Any]:
        headers = [(b"authorization", auth)] if auth is not None else []
        return {"type": "http", "client": (peer, 5000), "headers": headers}

    def key(peer: str, auth: bytes | None) -> str:
        return asyncio.run(limiter.client_key(scope(peer, auth)))

    assert key("10.0.0.1", None) == "addr:10.0.0.1"
    assert key("10.0.0.1", b"Bearer made-up") == "addr:10.0.0.1"
    assert key("10.0.0.1", b"Basic Z29vZC10b2tlbg==") == "addr:10.0.0.1"
    assert key("10.0.0.2", b"Bearer made-up") == "addr:10.0.0.2"
    assert key("10.0.0.1", b"Bearer good-token") == "principal:agent:fleet-a/cam-1"


def test_refusals_and_errors_carry_the_security_headers(api: TestClient) -> None:
    for _ in range(4):
        last = api.post("/v1/enroll", json={"token": "bogus"})
    assert last.status_code == 429
    for response in (
        last,
        api.get("/v1/agents"),  # 401
        api.get("/v1/no-such-route"),  # 404
        api.post("/v1/enrollment-tokens", json={"fleet": 3}, headers=ADMIN),  # 422
    ):
        h = response.headers
        assert response.status_code in (401, 404, 422, 429), response.status_code
        assert h["x-content-type-options"] == "nosniff", response.status_code
        assert h["x-frame-options"] == "DENY"
        assert "frame-ancestors 'none'" in h["content-security-policy"]
        assert h["cache-control"] == "no-store"


def test_login_is_rate_limited(api: TestClient) -> None:
    codes = []
    for _ in range(5):
        page = api.get("/ui/login")
        token = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
        assert token
        codes.append(
            api.post(
                "/ui/login",
                data={"username": "ada", "password": "wrong", "csrf_token": token.group(1)},
                follow_redirects=False,
            ).status_code
        )
    assert 429 in codes and codes.index(429) == 3, codes


def test_rate_limiter_refills() -> None:
    now = [0.0]
    limiter = RateLimiter(60.0, 2, clock=lambda: now[0])
    assert limiter.take("k") == 0 and limiter.take("k") == 0
    assert limiter.take("k") == pytest.approx(1.0)
    assert limiter.take("other") == 0  # buckets are per client
    now[0] += 1.0
    assert limiter.take("k") == 0


def test_secrets_never_logged(
    api: TestClient, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    answer = _enroll(api, "cam-log")
    page = api.get("/ui/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
    assert token
    api.post(
        "/ui/login",
        data={"username": "ada", "password": PASSWORD, "csrf_token": token.group(1)},
        follow_redirects=False,
    )
    captured = capsys.readouterr()
    text = caplog.text + captured.out + captured.err
    for secret in (answer["api_token"], PASSWORD, "test-admin-token", answer.get("mqtt_password")):
        if secret:
            assert secret not in text
