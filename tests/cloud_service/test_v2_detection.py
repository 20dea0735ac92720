"""The V2 (KServe / Triton) endpoints serve a teacher detector."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_service.api import create_app
from cloud_service.settings import CloudSettings
from edge_agent.testing import make_tiny_detector
from tests.cloud_service.conftest import SIZE

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Starlette's TestClient asks for httpx2 (see test_api.py)
    from fastapi.testclient import TestClient


@pytest.fixture
def client(make_settings: Callable[..., CloudSettings], tmp_path: Path) -> Iterator[TestClient]:
    teacher = make_tiny_detector(tmp_path / "detector.onnx", size=SIZE, rows=8)
    settings = make_settings(database_url=f"sqlite:///{tmp_path / 'v2.db'}", teacher_model=teacher)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def test_metadata_infer_and_config_describe_the_detectors_rows(client: TestClient) -> None:
    meta = client.get("/v2/models/teacher").json()
    assert meta["outputs"] == [{"name": "detections", "datatype": "FP32", "shape": [-1, -1, 6]}]
    assert meta["parameters"]["task"] == "detection"
    frames = np.full((2, SIZE, SIZE, 3), 204, np.uint8)
    request: dict[str, Any] = {
        "inputs": [
            {
                "name": "frames",
                "shape": [2, SIZE, SIZE, 3],
                "datatype": "UINT8",
                "data": frames.reshape(-1).tolist(),
            }
        ]
    }
    response = client.post("/v2/models/teacher/infer", json=request)
    assert response.status_code == 200, response.text
    out = response.json()["outputs"][0]
    assert out["name"] == "detections" and out["shape"] == [2, 8, 6]
    rows = np.asarray(out["data"]).reshape(2, 8, 6)
    assert rows[0, 0, 4] == pytest.approx(0.8, abs=1e-3) and rows[0, 0, 5] == 1.0
    asked = dict(request, outputs=[{"name": "detections", "parameters": {"classification": 3}}])
    refused = client.post("/v2/models/teacher/infer", json=asked)
    assert refused.status_code == 400 and "detection task" in refused.json()["error"]
    config = client.get("/v2/models/teacher/config").json()
    assert config["output"][0]["dims"] == [-1, 6]
