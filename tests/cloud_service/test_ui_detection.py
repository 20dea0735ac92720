"""The review UI's detection samples over HTTP on both databases: the sample's boxes and
their differences, reviews with boxes (checked), bulk confirm taking the teacher's boxes."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import select

from cloud_service.api import create_app
from cloud_service.db import crud
from cloud_service.db.models import Label
from cloud_service.ui.seed import DETECTION_CLASSES, DETECTION_FRAMES, seed, seed_detection

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Starlette's TestClient wants httpx2 (see test_api.py)
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.sql

PASSWORD = "correct horse battery"

# The view of a classification sample: exactly these keys, as before detection came.
CLASSIFICATION_KEYS = {
    "sample_id", "agent_id", "fleet", "captured_at", "model_version", "route_reason",
    "status", "classes", "edge_scores", "edge_label", "edge_confidence", "teacher_scores",
    "teacher_label", "teacher_confidence", "review_reasons", "labels", "token", "image_url",
}  # fmt: skip


@dataclass
class Ui:
    client: TestClient
    flagged: list[str]  # classification samples, newest first
    detection: list[str]  # detection samples, in DETECTION_FRAMES' order

    @property
    def state(self) -> Any:
        return self.client.app.state.edgeloop  # type: ignore[attr-defined]

    def labels(self, sample_id: str) -> list[Label]:
        with self.state.sessions() as session:
            query = select(Label).where(Label.sample_id == sample_id).order_by(Label.id)
            return list(session.scalars(query))


@pytest.fixture
def ui(make_settings: Any, database_url: str) -> Iterator[Ui]:
    settings = make_settings(database_url=database_url, rollout_tick_s=0)
    app = create_app(settings)
    with TestClient(app, follow_redirects=False) as client:
        state = app.state.edgeloop
        with state.sessions.begin() as session:
            crud.create_user(session=session, username="rev", password=PASSWORD, role="reviewer")
            classification = seed(session=session, blobs=state.blobs, samples=12, images=2)
            detection = seed_detection(session=session, blobs=state.blobs)
        page = client.get("/ui/login")
        found = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
        assert found, page.text
        signed_in = client.post(
            "/ui/login",
            data={"username": "rev", "password": PASSWORD, "csrf_token": found.group(1)},
        )
        assert signed_in.status_code == 303
        queue = client.get("/ui/queue")
        csrf = re.search(r'<meta name="csrf-token" content="([^"]+)"', queue.text)
        assert csrf, queue.text
        client.headers["X-CSRF-Token"] = csrf.group(1)
        yield Ui(client, classification["flagged"], detection["detection"])


def review(ui: Ui, sample_id: str, **body: Any) -> Any:
    token = ui.client.get(f"/ui/api/samples/{sample_id}").json()["token"]
    return ui.client.post(
        f"/ui/api/samples/{sample_id}/review", json={"action": "label", "token": token, **body}
    )


def test_a_detection_sample_carries_its_boxes_and_differences(ui: Ui) -> None:
    view = ui.client.get(f"/ui/api/samples/{ui.detection[0]}").json()
    teacher, edge = DETECTION_FRAMES[0]
    assert view["task"] == "detection"
    assert view["classes"] == DETECTION_CLASSES  # the detector's manifest names them
    assert view["edge_boxes"] == [list(b) for b in edge]
    assert view["teacher_boxes"] == [list(b) for b in teacher]
    assert view["label_boxes"] is None
    differences = view["differences"]
    assert differences["teacher"] == ["matched", "wrong_class", "localisation", "missed"]
    assert differences["edge"] == ["matched", "wrong_class", "localisation", "extra"]
    assert [p[:2] for p in differences["pairs"]] == [[0, 0], [1, 1], [2, 2]]
    assert differences["kinds"] == ["missed", "extra", "wrong_class", "localisation"]
    agreeing = ui.client.get(f"/ui/api/samples/{ui.detection[1]}").json()["differences"]
    assert agreeing["kinds"] == [] and set(agreeing["teacher"]) == {"matched"}
    empty_edge = ui.client.get(f"/ui/api/samples/{ui.detection[2]}").json()
    assert empty_edge["edge_boxes"] == [] and empty_edge["differences"]["teacher"] == ["missed"]
    page = ui.client.get(f"/ui/review/{ui.detection[0]}")
    assert page.status_code == 200 and "/ui/static/boxes.js" in page.text
    assert ui.client.get("/ui/static/boxes.js").status_code == 200


def test_a_classification_sample_view_is_unchanged(ui: Ui) -> None:
    view = ui.client.get(f"/ui/api/samples/{ui.flagged[0]}").json()
    assert set(view) == CLASSIFICATION_KEYS  # no "task", no boxes
    assert review(ui, ui.flagged[0], label=2).status_code == 200
    labels = ui.labels(ui.flagged[0])
    assert [(label.label, label.boxes) for label in labels] == [(2, None)]
    refused = review(ui, ui.flagged[1], label=1, boxes=[[0.1, 0.1, 0.2, 0.2, 1]])
    assert refused.status_code == 422 and "classification sample" in refused.json()["detail"]


def test_a_review_with_boxes_stores_them(ui: Ui) -> None:
    sample_id = ui.detection[0]
    boxes = [[0.1, 0.1, 0.3, 0.35, 3], [0.5, 0.15, 0.7, 0.4, 7], [0.6, 0.6, 0.9, 0.9, 5]]
    done = review(ui, sample_id, boxes=boxes, query="status=flagged&agent=belt-1")
    assert done.status_code == 200, done.text
    assert done.json()["next"]["sample_id"] == ui.detection[1]  # the next of the filter
    [label] = ui.labels(sample_id)
    assert label.boxes == [[*b[:4], 1.0, b[4]] for b in boxes] and label.label == 3
    assert label.labeled_by == "rev"
    view = ui.client.get(f"/ui/api/samples/{sample_id}").json()
    assert view["status"] == "reviewed" and view["label_boxes"] == label.boxes
    assert view["labels"][0]["boxes"] == label.boxes
    # Undo takes the label back, as for classification.
    undone = ui.client.post("/ui/api/undo", json=done.json()["undo"])
    assert undone.status_code == 200 and undone.json()["sample"]["status"] == "flagged"
    assert ui.labels(sample_id) == []
    # An empty frame is a label too: no boxes, class 0.
    assert review(ui, ui.detection[3], boxes=[]).status_code == 200
    assert [(lb.label, lb.boxes) for lb in ui.labels(ui.detection[3])] == [(0, [])]


@pytest.mark.parametrize(
    ("boxes", "says"),
    [
        (None, "labelled with boxes"),
        ([[0.1, 0.1, 0.3]], "expected [x1, y1, x2, y2, class]"),
        ([[0.3, 0.1, 0.1, 0.3, 1]], "not inside the frame"),
        ([[0.1, 0.1, 0.3, 1.2, 1]], "0 <= y1 < y2 <= 1"),
        ([[0.1, 0.1, 0.3, 0.3, 10]], "integer 0..9"),
        ([[0.1, 0.1, 0.3, 0.3, 1.5]], "integer 0..9"),
        ([[0.1, 0.1, 0.3, 0.3, "one"]], "expected [x1, y1, x2, y2, class]"),
        ([[0.1, 0.1, 0.3, 0.3, 1]] * 301, "at most 300 boxes"),
    ],
)
def test_invalid_boxes_are_refused_with_the_accepted_form(ui: Ui, boxes: Any, says: str) -> None:
    answer = review(ui, ui.detection[0], boxes=boxes)
    assert answer.status_code == 422, answer.text
    assert says in answer.json()["detail"]
    assert ui.labels(ui.detection[0]) == []
    assert ui.client.get(f"/ui/api/samples/{ui.detection[0]}").json()["status"] == "flagged"


def test_bulk_confirm_takes_the_teachers_boxes(ui: Ui) -> None:
    chosen = [ui.detection[0], ui.detection[3], ui.flagged[0]]
    csrf = ui.client.headers["X-CSRF-Token"]
    answer = ui.client.post(
        "/ui/queue/bulk", data={"action": "confirm", "ids": chosen, "csrf_token": csrf}
    )
    assert answer.status_code == 303 and "confirm%3A%203%20done" in answer.headers["location"]
    teacher = DETECTION_FRAMES[0][0]
    [first] = ui.labels(ui.detection[0])
    assert first.boxes == [[*b[:4], 1.0, b[5]] for b in teacher] and first.label == teacher[0][5]
    [empty] = ui.labels(ui.detection[3])  # the teacher saw nothing: an empty frame
    assert (empty.label, empty.boxes) == (0, [])
    [plain] = ui.labels(ui.flagged[0])
    assert plain.boxes is None  # a classification sample keeps its plain label
    relabel = ui.client.post(
        "/ui/queue/bulk",
        data={"action": "relabel", "label": "3", "ids": [ui.detection[1]], "csrf_token": csrf},
        headers={"Accept": "application/json"},
    )
    assert relabel.status_code == 422 and "detection sample" in relabel.json()["detail"]
    assert ui.labels(ui.detection[1]) == []
