"""Logout ends the session on the server: a cookie captured before it gets the login page."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from cloud_service.api import create_app
from cloud_service.db import crud
from cloud_service.ui.auth import SESSION_COOKIE

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Starlette's TestClient asks for httpx2 (see test_api.py)
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.sql

PASSWORD = "correct horse battery"


@pytest.fixture
def client(make_settings: Any, database_url: str) -> Iterator[TestClient]:
    app = create_app(make_settings(database_url=database_url, rollout_tick_s=0))
    with TestClient(app, follow_redirects=False) as client:
        with app.state.edgeloop.sessions.begin() as session:
            crud.create_user(session=session, username="ada", password=PASSWORD, role="admin")
        yield client


def _login(client: TestClient) -> str:
    page = client.get("/ui/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
    assert token, page.text
    answer = client.post(
        "/ui/login", data={"username": "ada", "password": PASSWORD, "csrf_token": token.group(1)}
    )
    assert answer.status_code == 303, answer.text
    cookie = client.cookies.get(SESSION_COOKIE)
    assert cookie
    return cookie


def _csrf(client: TestClient) -> str:
    found = re.search(r'<meta name="csrf-token" content="([^"]+)"', client.get("/ui/queue").text)
    assert found
    return found.group(1)


def test_a_cookie_captured_before_logout_gets_the_login_page_after_it(client: TestClient) -> None:
    captured = _login(client)
    assert client.get("/ui/queue").status_code == 200
    out = client.post("/ui/logout", headers={"X-CSRF-Token": _csrf(client)})
    assert out.status_code == 303 and out.headers["location"] == "/ui/login"

    client.cookies.set(SESSION_COOKIE, captured)  # the attacker replays the old cookie
    page = client.get("/ui/queue")
    assert page.status_code == 303 and page.headers["location"].startswith("/ui/login")


def test_signing_in_again_after_logout_works(client: TestClient) -> None:
    _login(client)
    client.post("/ui/logout", headers={"X-CSRF-Token": _csrf(client)})
    _login(client)
    assert client.get("/ui/queue").status_code == 200
