"""Fixtures of the deployment tests: the manifests and monitoring files, parsed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML reads the manifests (pip install pyyaml)")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load_documents(*paths: Path) -> list[dict[str, Any]]:
    """Every YAML document in ``paths``, in order, empty ones left out."""
    documents: list[dict[str, Any]] = []
    for path in paths:
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                assert isinstance(document, dict), f"{path}: a document is not a mapping"
                documents.append(document)
    return documents


@pytest.fixture(scope="module")
def manifests() -> list[dict[str, Any]]:
    """The Kubernetes objects `kubectl apply -f deploy/k8s/` creates, plus the Secret examples."""
    folder = DEPLOY / "k8s"
    return load_documents(
        *sorted(folder.glob("*.yaml")), *sorted((folder / "examples").glob("*.yaml"))
    )
