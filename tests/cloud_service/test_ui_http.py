"""The review UI over HTTP on both databases: sign-in, roles, CSRF, expiry, reviews, export."""

from __future__ import annotations

import csv
import io
import json
import re
import time
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import pytest

from cloud_service.api import create_app
from cloud_service.db import crud
from cloud_service.ui.auth import SESSION_COOKIE, SessionSigner, hash_password, verify_password
from cloud_service.ui.seed import CLASSES, seed
from cloud_service.ui.store import QueueFilter

with warnings.catch_warnings():
    # Starlette's TestClient warns that it wants the httpx2 package (see test_api.py).
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.sql

PASSWORD = "correct horse battery"


@dataclass
class Ui:
    client: TestClient
    seeded: dict[str, Any]

    @property
    def state(self) -> Any:
        return self.client.app.state.edgeloop  # type: ignore[attr-defined]


@pytest.fixture
def ui(make_settings: Any, database_url: str) -> Iterator[Ui]:
    settings = make_settings(database_url=database_url, rollout_tick_s=0)
    app = create_app(settings)
    with TestClient(app, follow_redirects=False) as client:
        state = app.state.edgeloop
        with state.sessions.begin() as session:
            crud.create_user(session=session, username="ada", password=PASSWORD, role="admin")
            crud.create_user(session=session, username="rev", password=PASSWORD, role="reviewer")
            seeded = seed(session=session, blobs=state.blobs, samples=40, agents=4, images=4)
        yield Ui(client, seeded)


def login(client: TestClient, username: str, password: str = PASSWORD) -> Any:
    page = client.get("/ui/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
    assert token, page.text
    return client.post(
        "/ui/login",
        data={"username": username, "password": password, "csrf_token": token.group(1)},
    )


def csrf_of(client: TestClient) -> str:
    page = client.get("/ui/queue")
    found = re.search(r'<meta name="csrf-token" content="([^"]+)"', page.text)
    assert found, page.text
    return found.group(1)


def test_passwords_are_salted_scrypt() -> None:
    one, two = hash_password("s3cret-pass"), hash_password("s3cret-pass")
    assert one != two and one.startswith("scrypt$")
    assert verify_password("s3cret-pass", one) and not verify_password("wrong-pass", one)
    assert not verify_password("x", "garbage")


def test_login_and_logout(ui: Ui) -> None:
    c = ui.client
    assert c.get("/ui/queue").status_code == 303  # not signed in: to the login page
    assert c.get("/ui/queue").headers["location"].startswith("/ui/login?next=")
    bad = login(c, "rev", "wrong password")
    assert bad.status_code == 401 and "wrong password" in bad.text
    good = login(c, "rev")
    assert good.status_code == 303 and good.headers["location"] == "/ui/queue"
    assert c.get("/ui/queue").status_code == 200
    token = csrf_of(c)
    assert c.post("/ui/logout", data={"csrf_token": token}).status_code == 303
    assert c.get("/ui/queue").status_code == 303


def test_login_refuses_offsite_next(ui: Ui) -> None:
    page = ui.client.get("/ui/login?next=//evil.example/x")
    assert 'value="/ui/queue"' in page.text


def test_login_form_needs_its_csrf_token(ui: Ui) -> None:
    ui.client.get("/ui/login")
    answer = ui.client.post(
        "/ui/login", data={"username": "rev", "password": PASSWORD, "csrf_token": "forged"}
    )
    assert answer.status_code == 403 and SESSION_COOKIE not in answer.cookies


def test_expired_or_forged_session_redirects_to_login(ui: Ui) -> None:
    c = ui.client
    signer = SessionSigner(ui.state.settings.session_secret.get_secret_value())
    with ui.state.sessions() as session:
        user = next(u for u in crud.list_users(session=session) if u.username == "rev")
    old = signer.sign(user_id=user.id, generation=0, now=time.time() - 10 * 3600)
    c.cookies.set(SESSION_COOKIE, old)
    answer = c.get("/ui/queue?status=any")
    assert answer.status_code == 303
    assert answer.headers["location"] == "/ui/login?next=/ui/queue%3Fstatus%3Dany"
    api = c.get(f"/ui/api/samples/{ui.seeded['flagged'][0]}")
    assert api.status_code == 401
    c.cookies.set(SESSION_COOKIE, signer.sign(user_id=user.id, generation=0)[:-3] + "abc")
    assert c.get("/ui/queue").status_code == 303
    # A password change ends the sessions signed before it.
    c.cookies.set(SESSION_COOKIE, signer.sign(user_id=user.id, generation=0))
    assert c.get("/ui/queue").status_code == 200
    with ui.state.sessions.begin() as session:
        crud.set_password(session=session, username="rev", password="another password")
    assert c.get("/ui/queue").status_code == 303


def test_reviewer_cannot_reach_admin_actions(ui: Ui) -> None:
    c = ui.client
    login(c, "rev")
    token = csrf_of(c)
    assert c.get("/ui/users").status_code == 403
    assert "needs an admin" in c.get("/ui/users").text
    refused = c.post(f"/ui/rollouts/{ui.seeded['rollout_id']}/abort", data={"csrf_token": token})
    assert refused.status_code == 403
    added = c.post(
        "/ui/users", data={"csrf_token": token, "username": "eve", "password": "password1"}
    )
    assert added.status_code == 403
    c.cookies.clear()
    login(c, "ada")
    assert c.get("/ui/users").status_code == 200


def test_forms_without_csrf_are_refused(ui: Ui) -> None:
    c = ui.client
    login(c, "rev")
    sample_id = ui.seeded["flagged"][0]
    view = c.get(f"/ui/api/samples/{sample_id}").json()
    body = {"action": "label", "label": 1, "token": view["token"]}
    assert c.post(f"/ui/api/samples/{sample_id}/review", json=body).status_code == 403
    wrong = c.post(
        f"/ui/api/samples/{sample_id}/review", json=body, headers={"X-CSRF-Token": "nope"}
    )
    assert wrong.status_code == 403
    bulk = c.post("/ui/queue/bulk", data={"action": "discard", "ids": [sample_id]})
    assert bulk.status_code == 403
    assert c.get(f"/ui/api/samples/{sample_id}").json()["status"] == "flagged"


def test_review_next_undo_and_conflict(ui: Ui) -> None:
    c = ui.client
    login(c, "rev")
    token = csrf_of(c)
    first, second = ui.seeded["flagged"][:2]
    view = c.get(f"/ui/api/samples/{first}").json()
    assert view["classes"] == CLASSES and view["token"] == "flagged:0"
    done = c.post(
        f"/ui/api/samples/{first}/review",
        json={"action": "label", "label": 3, "token": view["token"], "query": "status=flagged"},
        headers={"X-CSRF-Token": token},
    )
    assert done.status_code == 200, done.text
    body = done.json()
    assert body["next"]["sample_id"] == second  # the next one of the filter, same round trip
    reviewed = c.get(f"/ui/api/samples/{first}").json()
    assert reviewed["status"] == "reviewed" and reviewed["labels"][0]["label"] == 3
    # Someone else acting on the stale token is told, not silently overwriting.
    stale = c.post(
        f"/ui/api/samples/{first}/review",
        json={"action": "discard", "token": view["token"]},
        headers={"X-CSRF-Token": token},
    )
    assert stale.status_code == 409
    assert "changed meanwhile" in stale.json()["detail"] and "by rev" in stale.json()["detail"]
    undone = c.post("/ui/api/undo", json=body["undo"], headers={"X-CSRF-Token": token})
    assert undone.status_code == 200, undone.text
    assert undone.json()["sample"]["status"] == "flagged"
    assert undone.json()["sample"]["labels"] == []
    # Undo twice is a conflict too: the state moved on.
    again = c.post("/ui/api/undo", json=body["undo"], headers={"X-CSRF-Token": token})
    assert again.status_code == 409
    # Moving with J/K: neighbours in the filter's order.
    nxt = c.get(f"/ui/api/samples/{first}/neighbour?direction=next&status=flagged").json()
    prev = c.get(f"/ui/api/samples/{second}/neighbour?direction=prev&status=flagged").json()
    assert nxt["sample"]["sample_id"] == second and prev["sample"]["sample_id"] == first


def test_bulk_actions_skip_what_changed(ui: Ui) -> None:
    c = ui.client
    login(c, "rev")
    token = csrf_of(c)
    a, b, d = ui.seeded["flagged"][:3]
    with ui.state.sessions.begin() as session:
        crud.add_label(session=session, sample_id=d, label=0, labeled_by="someone-else")
    answer = c.post(
        "/ui/queue/bulk",
        data={"csrf_token": token, "action": "relabel", "label": "2", "ids": [a, b, d]},
    )
    assert answer.status_code == 303
    where = unquote(answer.headers["location"])
    assert "2 done" in where and "1 skipped" in where
    assert c.get(f"/ui/api/samples/{a}").json()["labels"][0]["label"] == 2
    c.post("/ui/queue/bulk", data={"csrf_token": token, "action": "discard", "ids": [b]})
    assert c.get(f"/ui/api/samples/{b}").json()["status"] == "reviewed"  # not flagged any more


def test_queue_filters_live_in_the_url(ui: Ui) -> None:
    c = ui.client
    login(c, "rev")
    page = c.get("/ui/queue?agent=cam-2&reason=audit&per_page=25&sort=oldest")
    assert page.status_code == 200
    assert "cam-1" not in re.sub(r"<select name=\"agent\">.*?</select>", "", page.text, flags=re.S)
    flt = QueueFilter.from_query({"agent": "cam-2", "reason": "audit", "per_page": "25"})
    assert flt.query_string() == "agent=cam-2&reason=audit&per_page=25"
    assert f"/ui/queue?{flt.query_string(page=2)}" == (
        "/ui/queue?agent=cam-2&reason=audit&page=2&per_page=25"
    )
    assert c.get("/ui/queue?status=bogus").status_code == 422
    assert c.get("/ui/queue?conf_min=2").status_code == 422
    everything = c.get("/ui/queue?status=any&per_page=100").text
    assert everything.count('class="row"') == 40
    narrow = c.get("/ui/queue?status=any&per_page=100&conf_min=0.5&conf_max=0.6").text
    assert 0 < narrow.count('class="row"') < 40


def test_export_formats_honour_the_filter(ui: Ui) -> None:
    c = ui.client
    login(c, "rev")
    token = csrf_of(c)
    first = ui.seeded["flagged"][0]
    view = c.get(f"/ui/api/samples/{first}").json()
    c.post(
        f"/ui/api/samples/{first}/review",
        json={"action": "label", "label": 4, "token": view["token"]},
        headers={"X-CSRF-Token": token},
    )
    as_csv = c.get("/ui/export?status=reviewed&format=csv")
    assert as_csv.status_code == 200 and "attachment" in as_csv.headers["content-disposition"]
    rows = list(csv.DictReader(io.StringIO(as_csv.text)))
    assert [(r["sample_id"], r["class_name"], r["source"]) for r in rows] == [
        (first, "cat", "human")
    ]
    as_json = c.get("/ui/export?status=any&format=json").json()
    assert len(as_json) > 1 and {r["source"] for r in as_json} == {"human", "teacher"}
    by_agent = c.get("/ui/export?status=any&agent=cam-1&format=json").json()
    assert by_agent and {r["agent_id"] for r in by_agent} == {"cam-1"}
    archive = zipfile.ZipFile(io.BytesIO(c.get("/ui/export?status=reviewed&format=zip").content))
    assert sorted(archive.namelist()) == [f"cat/{first}.png", "labels.csv"]
    assert json.loads(json.dumps(as_json))  # plain JSON


def test_pages_render(ui: Ui) -> None:
    c = ui.client
    login(c, "ada")
    for path in ["/ui/queue", "/ui/agents", "/ui/dashboard", "/ui/models", "/ui/users"]:
        page = c.get(path)
        assert page.status_code == 200, (path, page.text[:500])
        assert "cdn" not in page.text.lower() and "https://" not in page.text
    assert "<svg" in c.get("/ui/dashboard").text
    agents = c.get("/ui/agents").text
    assert "online" in agents and "offline" in agents and "TensorrtExecutionProvider" in agents
    first = ui.seeded["flagged"][0]
    review = c.get(f"/ui/review/{first}?status=flagged")
    assert review.status_code == 200 and first in review.text
    image = c.get(f"/ui/samples/{first}/image")
    assert image.status_code == 200 and image.headers["content-type"] == "image/png"
    assert c.get("/ui/static/app.js").status_code == 200


def test_jobs_pages_are_admin_only_and_need_csrf(ui: Ui) -> None:
    c = ui.client
    login(c, "rev")
    token = csrf_of(c)
    assert c.get("/ui/jobs").status_code == 403
    assert c.post("/ui/jobs", data={"csrf_token": token}).status_code == 403
    c.cookies.clear()
    login(c, "ada")
    token = csrf_of(c)
    assert c.post("/ui/jobs", data={"epochs": "2"}).status_code == 403  # no CSRF token
    made = c.post("/ui/jobs", data={"csrf_token": token, "epochs": "2", "fleet": "fleet-a"})
    assert made.status_code == 303 and made.headers["location"].startswith("/ui/jobs/")
    job_id = int(made.headers["location"].rsplit("/", 1)[1])
    view = c.get(f"/ui/api/jobs/{job_id}").json()
    assert view["state"] == "queued" and view["logs"][0]["message"].startswith("queued")
    bad = c.post("/ui/jobs", data={"csrf_token": token, "epochs": "9999", "fleet": "fleet-a"})
    assert "epochs" in unquote(bad.headers["location"])
    sched = c.post(
        "/ui/schedules",
        data={
            "csrf_token": token,
            "name": "nightly",
            "fleet": "fleet-a",
            "kind": "cron",
            "expression": "0 3 * * *",
        },
    )
    assert "created" in unquote(sched.headers["location"])
    assert "nightly" in c.get("/ui/jobs").text
    cancelled = c.post(f"/ui/api/jobs/{job_id}/cancel", headers={"X-CSRF-Token": token})
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    again = c.post(f"/ui/api/jobs/{job_id}/cancel", headers={"X-CSRF-Token": token})
    assert again.status_code == 409


def test_users_cli(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from cloud_service.cli import app

    monkeypatch.setenv("EDGELOOP_DATA_DIR", str(tmp_path))
    runner = CliRunner()
    added = runner.invoke(app, ["users", "add", "ada", "--role", "admin", "--password", PASSWORD])
    assert added.exit_code == 0, added.output
    dup = runner.invoke(app, ["users", "add", "ada", "--password", PASSWORD])
    assert dup.exit_code != 0 and "already exists" in dup.output
    short = runner.invoke(app, ["users", "add", "bob", "--password", "short"])
    assert short.exit_code != 0
    changed = runner.invoke(app, ["users", "passwd", "ada", "--password", "a new password"])
    assert changed.exit_code == 0, changed.output
    listed = runner.invoke(app, ["users", "list", "--json"])
    assert listed.exit_code == 0 and json.loads(listed.output)[0]["role"] == "admin"


# --- issue 24: agents without figures, class names, error pages, discard undo, exports ---


def _status(agent: str, state: str, sent_at: Any, **figures: Any) -> Any:
    from shared.messages import AgentStatus

    return AgentStatus(fleet="fleet-a", agent=agent, state=state, sent_at=sent_at, **figures)


def test_agents_page_with_idle_and_stopped_agents(ui: Ui) -> None:
    from datetime import UTC, datetime, timedelta

    now = datetime.now(UTC)
    with ui.state.sessions.begin() as session:
        # Stopped: its last will carries no figures. Idle: a heartbeat long ago, no frames.
        crud.record_agent_status(session=session, status=_status("cam-stopped", "offline", now))
        idle_at = now - timedelta(minutes=30)
        crud.record_agent_status(session=session, status=_status("cam-idle", "online", idle_at))
        crud.record_agent_status(
            session=session,
            status=_status("cam-quiet", "online", now, provider="CPUExecutionProvider"),
        )
    login(ui.client, "ada")
    page = ui.client.get("/ui/agents")
    assert page.status_code == 200, page.text[:300]
    rows = {
        m.group(1): m.group(0)
        for m in re.finditer(r"<tr>\s*<td><a[^>]*>([^<]+)</a>.*?</tr>", page.text, re.S)
    }
    assert "offline" in rows["cam-stopped"] and "stale" in rows["cam-idle"]
    assert "online" in rows["cam-quiet"] and "CPUExecutionProvider" in rows["cam-quiet"]
    assert "—" in rows["cam-stopped"] and "(30 min ago)" in rows["cam-idle"]


def _seed_unregistered(ui: Ui, model_name: str, classes: int, count: int = 3) -> list[str]:
    """Samples (flagged, with verdicts) from a model the registry does not know."""
    import uuid
    from datetime import UTC, datetime

    from cloud_service.db.models import Sample, Verdict

    ids = []
    now = datetime.now(UTC)
    with ui.state.sessions.begin() as session:
        for i in range(count):
            sample_id = str(uuid.uuid4())
            scores = [0.0] * classes
            scores[i % classes] = 1.0
            session.add(
                Sample(
                    sample_id=sample_id, fleet="fleet-z", agent_id="cam-z", captured_at=now,
                    model_name=model_name, model_version="v1", edge_scores=scores,
                    edge_predicted=i % classes, edge_confidence=1.0, route_reason="margin",
                    image_key="seed/img-000.png", image_format="png", image_width=96,
                    image_height=96, image_bytes=1000, meta={}, status="flagged",
                )
            )  # fmt: skip
            session.flush()
            session.add(
                Verdict(
                    sample_id=sample_id, teacher_model="teacher", teacher_version="t-1",
                    scores=scores, label=i % classes, confidence=0.9, agrees_with_edge=True,
                    review=True, review_reasons=["audit"], verified_at=now,
                )
            )  # fmt: skip
            ids.append(sample_id)
    return ids


def test_class_names_come_from_the_models_and_filters_take_names(ui: Ui) -> None:
    c = ui.client
    login(c, "rev")
    token = csrf_of(c)
    queue = c.get("/ui/queue?status=any&per_page=100").text
    assert '<option value="bird">' in queue  # the form suggests the models' class names
    by_name = c.get("/ui/queue?status=any&per_page=100&edge_class=cat").text
    by_index = c.get("/ui/queue?status=any&per_page=100&edge_class=4").text
    assert by_name.count('class="row"') == by_index.count('class="row"') > 0
    by_teacher = c.get("/ui/queue?status=any&per_page=100&teacher_class=dog")
    assert by_teacher.status_code == 200 and by_teacher.text.count('class="row"') > 0
    # A model the registry does not know: the teacher's names (its edgeloop.labels).
    teacherless = _seed_unregistered(ui, "edge-student", classes=10)
    view = c.get(f"/ui/api/samples/{teacherless[0]}").json()
    assert view["classes"] == [f"class-{i}" for i in range(10)]
    # Neither registry nor teacher: indices.
    unknown = _seed_unregistered(ui, "mystery", classes=3)
    assert c.get(f"/ui/api/samples/{unknown[0]}").json()["classes"] == ["0", "1", "2"]
    filtered = c.get("/ui/queue?status=any&per_page=100&edge_class=class-1").text
    assert teacherless[1] in filtered and teacherless[0] not in filtered
    # Bulk relabel by name, checked against each sample's own classes.
    a, b = ui.seeded["flagged"][:2]
    done = c.post(
        "/ui/queue/bulk",
        data={"csrf_token": token, "action": "relabel", "label": "bird", "ids": [a, b]},
    )
    assert done.status_code == 303 and "2 done" in unquote(done.headers["location"])
    assert c.get(f"/ui/api/samples/{a}").json()["labels"][0]["label"] == CLASSES.index("bird")
    mixed = c.post(
        "/ui/queue/bulk",
        data={"csrf_token": token, "action": "relabel", "label": "bird", "ids": [unknown[0]]},
    )
    assert mixed.status_code == 422 and "is not a class of sample" in mixed.text


def test_invalid_filters_and_bad_bulk_actions_show_the_error_page(ui: Ui) -> None:
    c = ui.client
    login(c, "rev")
    token = csrf_of(c)
    for path, reason in [
        ("/ui/queue?status=bogus", "status 'bogus' is not one of"),
        ("/ui/queue?conf_min=2", "conf_min must be a number in 0..1"),
        ("/ui/queue?edge_class=unicorn", "'unicorn' is neither a class name nor a class index"),
        ("/ui/queue?since=yesterday", "is not a date"),
        ("/ui/export?format=bogus", "export format 'bogus' is not one of"),
        ("/ui/review?sort=sideways", "sort 'sideways' is not one of"),
        ("/ui/review/00000000-0000-4000-8000-000000000000", "is not stored"),
    ]:
        page = c.get(path)
        assert page.status_code in (404, 422), (path, page.status_code)
        assert page.headers["content-type"].startswith("text/html"), path
        found = re.search(r'id="error-message">([^<]*)<', page.text)
        assert found and reason in unquote(found.group(1)).replace("&#39;", "'"), (path, page.text)
        assert 'id="error-back"' in page.text
    first = [ui.seeded["flagged"][0]]
    bulk_cases: list[tuple[dict[str, Any], str]] = [
        ({"action": "discard", "confirm": "yes"}, "no samples selected"),
        ({"action": "explode", "ids": first}, "is not confirm, relabel or discard"),
        ({"action": "relabel", "ids": first}, "relabel needs a class"),
        ({"action": "relabel", "label": "unicorn", "ids": first}, "'unicorn' is not a class"),
    ]
    for data, reason in bulk_cases:
        form = {"csrf_token": token, "back": "agent=cam-1", **data}
        page = c.post("/ui/queue/bulk", data=form)
        assert page.status_code == 422 and page.headers["content-type"].startswith("text/html")
        assert 'href="/ui/queue?agent=cam-1"' in page.text  # back to the reviewer's queue
        assert reason in page.text.replace("&#39;", "'"), (data, page.text)
    # Fetches keep their JSON.
    api = c.get("/ui/api/samples/00000000-0000-4000-8000-000000000000")
    assert api.status_code == 404 and "is not stored" in api.json()["detail"]


def test_bulk_discard_asks_first_and_can_be_undone(ui: Ui) -> None:
    c = ui.client
    login(c, "rev")
    token = csrf_of(c)
    a, b, d = ui.seeded["flagged"][:3]
    asked = c.post(
        "/ui/queue/bulk",
        data={"csrf_token": token, "action": "discard", "ids": [a, b, d], "back": "agent=cam-1"},
    )
    assert asked.status_code == 200 and "Discard 3 samples?" in asked.text
    assert c.get(f"/ui/api/samples/{a}").json()["status"] == "flagged"  # nothing done yet
    with ui.state.sessions.begin() as session:
        crud.add_label(session=session, sample_id=d, label=1, labeled_by="someone-else")
    done = c.post(
        "/ui/queue/bulk",
        data={"csrf_token": token, "action": "discard", "confirm": "yes", "ids": [a, b, d],
              "back": "agent=cam-1"},
    )  # fmt: skip
    assert done.status_code == 303
    where = done.headers["location"]
    assert where.startswith("/ui/queue?agent=cam-1&") and "2 done, 1 skipped" in unquote(where)
    assert {c.get(f"/ui/api/samples/{i}").json()["status"] for i in (a, b)} == {"discarded"}
    queue = c.get(where).text
    undo_token = re.search(r'name="token" value="([^"]+)"', queue)
    assert undo_token and 'id="undo-bulk-button"' in queue
    # Someone confirms one of them meanwhile: the undo leaves it as it is now.
    view = c.get(f"/ui/api/samples/{b}").json()
    c.post(
        f"/ui/api/samples/{b}/review",
        json={"action": "label", "label": 2, "token": view["token"]},
        headers={"X-CSRF-Token": token},
    )
    other = TestClient(c.app, follow_redirects=False)
    login(other, "ada")
    refused = other.post(
        "/ui/queue/undo", data={"csrf_token": csrf_of(other), "token": undo_token.group(1)}
    )
    assert refused.status_code == 422 and "only the reviewer who discarded" in refused.text
    forged = c.post("/ui/queue/undo", data={"csrf_token": token, "token": "AAAA.BBBB"})
    assert forged.status_code == 422 and "not valid any more" in forged.text
    undone = c.post(
        "/ui/queue/undo",
        data={"csrf_token": token, "token": undo_token.group(1), "back": "agent=cam-1"},
    )
    assert undone.status_code == 303
    assert "1 samples restored, 1 skipped" in unquote(undone.headers["location"])
    assert c.get(f"/ui/api/samples/{a}").json()["status"] == "flagged"
    assert c.get(f"/ui/api/samples/{b}").json()["status"] == "reviewed"
    assert c.get(f"/ui/api/samples/{d}").json()["status"] == "reviewed"


def test_export_follows_the_status_filter_and_guards_csv_cells(ui: Ui) -> None:
    c = ui.client
    login(c, "rev")
    token = csrf_of(c)
    a, b = ui.seeded["flagged"][:2]
    c.post(
        "/ui/queue/bulk",
        data={"csrf_token": token, "action": "discard", "confirm": "yes", "ids": [b]},
    )
    with ui.state.sessions.begin() as session:
        crud.add_label(session=session, sample_id=a, label=3, labeled_by='=HYPERLINK("x")')
    flagged = c.get("/ui/export?status=flagged&format=json").json()
    assert flagged and {r["status"] for r in flagged} == {"flagged"}
    assert {r["source"] for r in flagged} == {"teacher"} and a not in {
        r["sample_id"] for r in flagged
    }
    assert len(flagged) == len(ui.seeded["flagged"]) - 2
    discarded = c.get("/ui/export?status=discarded&format=json").json()
    assert [(r["sample_id"], r["label"]) for r in discarded] == [(b, None)]
    verified = c.get("/ui/export?status=verified&format=csv").text
    assert verified.count("\n") - 1 == 40 - len(ui.seeded["flagged"])
    reviewed = list(csv.DictReader(io.StringIO(c.get("/ui/export?status=reviewed").text)))
    assert [(r["sample_id"], r["class_name"], r["labeled_by"]) for r in reviewed] == [
        (a, "dog", '\'=HYPERLINK("x")')
    ]
