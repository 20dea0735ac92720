"""The job page's metric tables for each task's job."""

from __future__ import annotations

from cloud_service.ui.jobs import metric_tables


def test_a_detection_job_shows_map50_and_map50_95_as_evaluation_tables() -> None:
    metrics = {
        "task": "detection",
        "evaluation": {
            "new_int8": {"holdout": 0.8123, "reference": 0.9},
            "serving": {"holdout": 0.7},
        },
        "evaluation_map50_95": {"new_int8": {"holdout": 0.5512, "reference": 0.6}},
        "gate": {"passed": True, "reasons": [], "metric": "map50"},
    }
    tables = metric_tables(metrics)
    titles = [t["title"] for t in tables]
    assert titles[:3] == ["Summary", "Evaluation (mAP@0.5, %)", "Evaluation (mAP@0.5:0.95, %)"]
    assert tables[1]["columns"] == ["model", "holdout", "reference"]
    assert tables[1]["rows"] == [["new_int8", "81.2", "90.0"], ["serving", "70.0", "0.0"]]
    assert tables[2]["rows"] == [["new_int8", "55.1", "60.0"]]
    assert "Evaluation map50 95" not in titles  # not repeated as name/value rows


def test_a_classification_job_keeps_its_top1_table() -> None:
    metrics = {"evaluation": {"serving": {"holdout": 0.5}}, "gate": {"metric": "top1_accuracy"}}
    assert metric_tables(metrics)[0]["title"] == "Evaluation (top-1, %)"
