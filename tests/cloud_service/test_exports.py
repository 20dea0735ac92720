"""Review results as datasets: the formats (COCO checked with pycocotools) and GET /v1/exports."""

from __future__ import annotations

import csv
import io
import json
import re
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from cloud_service.api import create_app
from cloud_service.db import crud
from cloud_service.exports import csv_cell
from cloud_service.ui.seed import CLASSES, seed

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Starlette's TestClient asks for httpx2 (see test_api.py)
    from fastapi.testclient import TestClient

ADMIN = {"Authorization": "Bearer test-admin-token"}


@dataclass
class Fleet:
    client: TestClient
    seeded: dict[str, Any]
    human: dict[str, str]  # sample id -> the class name a reviewer gave it


@pytest.fixture
def fleet(make_settings: Any, tmp_path: Any) -> Iterator[Fleet]:
    settings = make_settings(
        database_url=f"sqlite:///{tmp_path / 'exports.db'}",
        admin_token="test-admin-token",
        rollout_tick_s=0,
    )
    app = create_app(settings)
    with TestClient(app) as client:
        state = app.state.edgeloop
        human: dict[str, str] = {}
        with state.sessions.begin() as session:
            seeded = seed(session=session, blobs=state.blobs, samples=30, agents=2, images=3)
            for sample_id, name in zip(
                seeded["flagged"][:4], ["dog", "cat", "dog", "bus"], strict=True
            ):
                crud.add_label(
                    session=session,
                    sample_id=sample_id,
                    label=CLASSES.index(name),
                    labeled_by="rev",
                )
                human[sample_id] = name
        yield Fleet(client, seeded, human)


def test_csv_cells_that_would_be_formulas_are_quoted() -> None:
    for text in ("=1+1", "+1", "-1", "@SUM(A1)", "\tx", "\rx"):
        assert csv_cell(text) == "'" + text
    assert csv_cell("dog") == "dog" and csv_cell(-1.5) == -1.5 and csv_cell(None) is None


def test_the_api_needs_the_admin_token_and_names_bad_input(fleet: Fleet) -> None:
    c = fleet.client
    assert c.get("/v1/exports").status_code == 401
    bad = c.get("/v1/exports?format=pascal", headers=ADMIN)
    assert bad.status_code == 422 and "export format 'pascal' is not one of" in bad.json()["detail"]
    unknown = c.get("/v1/exports?edge_class=unicorn", headers=ADMIN)
    assert unknown.status_code == 422 and "neither a class name" in unknown.json()["detail"]


def test_coco_export_loads_in_pycocotools(fleet: Fleet, tmp_path: Any) -> None:
    from pycocotools.coco import COCO
    from pycocotools.mask import area as mask_area

    answer = fleet.client.get("/v1/exports?format=coco&status=reviewed", headers=ADMIN)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    assert "attachment" in answer.headers["content-disposition"]
    path = tmp_path / "instances.json"
    path.write_bytes(answer.content)
    coco = COCO(str(path))
    names = {cat["id"]: cat["name"] for cat in coco.loadCats(coco.getCatIds())}
    assert sorted(names.values()) == sorted(CLASSES)  # every class of the model, ids from 1
    assert min(names) == 1
    images = coco.loadImgs(coco.getImgIds())
    assert len(images) == len(fleet.human)
    for image in images:
        (ann,) = coco.loadAnns(coco.getAnnIds(imgIds=[image["id"]]))
        assert names[ann["category_id"]] == fleet.human[image["sample_id"]]
        assert ann["bbox"] == [0, 0, image["width"], image["height"]]  # the whole frame
        assert image["file_name"] == f"{fleet.human[image['sample_id']]}/{image['sample_id']}.png"
        assert image["coco_url"].endswith(f"/v1/samples/{image['sample_id']}/image")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # pycocotools vs NumPy 2
            covered = int(mask_area(coco.annToRLE(ann)))
        assert covered == ann["area"] == image["width"] * image["height"]  # the polygon too
    dogs = coco.getImgIds(catIds=coco.getCatIds(catNms=["dog"]))
    assert len(dogs) == 2


def test_image_folder_and_yolo_zips(fleet: Fleet) -> None:
    c = fleet.client
    folder = zipfile.ZipFile(
        io.BytesIO(c.get("/v1/exports?format=imagefolder", headers=ADMIN).content)
    )
    expected = {f"{name}/{sample_id}.png" for sample_id, name in fleet.human.items()}
    assert set(folder.namelist()) == expected | {"labels.csv"}

    yolo = zipfile.ZipFile(io.BytesIO(c.get("/v1/exports?format=yolo", headers=ADMIN).content))
    names = yolo.read("classes.txt").decode().splitlines()
    assert sorted(names) == sorted(CLASSES)
    for sample_id, name in fleet.human.items():
        assert f"images/{sample_id}.png" in yolo.namelist()
        line = yolo.read(f"labels/{sample_id}.txt").decode().split()
        assert names[int(line[0])] == name and line[1:] == ["0.5", "0.5", "1.0", "1.0"]
    data_yaml = yolo.read("data.yaml").decode()
    assert "train: images" in data_yaml and f"nc: {len(names)}" in data_yaml
    declared = dict(re.findall(r"^  (\d+): \"(.*)\"$", data_yaml, re.M))
    assert declared == {str(i): name for i, name in enumerate(names)}


def test_label_studio_export_has_predictions_and_annotations(fleet: Fleet) -> None:
    answer = fleet.client.get("/v1/exports?format=labelstudio&status=any", headers=ADMIN)
    tasks = answer.json()
    assert len(tasks) == fleet.seeded["samples"]
    by_id = {t["data"]["sample_id"]: t for t in tasks}
    for sample_id, name in fleet.human.items():
        task = by_id[sample_id]
        assert task["data"]["image"].endswith(f"/v1/samples/{sample_id}/image")
        (annotation,) = task["annotations"]
        assert annotation["result"][0]["value"]["choices"] == [name]
        edge, teacher = task["predictions"]
        assert edge["model_version"].startswith("student:s-")
        assert teacher["model_version"] == "teacher:t-1"
        for prediction in (edge, teacher):
            assert 0.0 <= prediction["score"] <= 1.0
            (result,) = prediction["result"]
            assert result["type"] == "choices" and result["from_name"] == "label"
            assert result["to_name"] == "image" and result["value"]["choices"][0] in CLASSES
    unreviewed = [t for t in tasks if t["data"]["sample_id"] not in fleet.human]
    assert unreviewed and all(t["annotations"] == [] for t in unreviewed)


def test_filters_narrow_the_export(fleet: Fleet) -> None:
    c = fleet.client
    dogs = c.get("/v1/exports?format=json&status=any&edge_class=dog", headers=ADMIN).json()
    assert dogs and {r["edge_class"] for r in dogs} == {"dog"}
    by_index = c.get(
        f"/v1/exports?format=json&status=any&edge_class={CLASSES.index('dog')}", headers=ADMIN
    ).json()
    assert by_index == dogs
    flagged = list(
        csv.DictReader(io.StringIO(c.get("/v1/exports?status=flagged", headers=ADMIN).text))
    )
    assert flagged and {r["status"] for r in flagged} == {"flagged"}
    one_agent = c.get("/v1/exports?format=json&status=any&agent=cam-2", headers=ADMIN).json()
    assert one_agent and {r["agent_id"] for r in one_agent} == {"cam-2"}
    assert json.loads(json.dumps(one_agent))
