"""The chaos and attack tests' folder: each scenario builds its own stack in it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The scenario's folder; the test skips where Mosquitto is not installed."""
    if not (shutil.which("mosquitto") or Path("/usr/sbin/mosquitto").exists()):
        pytest.skip("mosquitto is not installed; make test installs it when run as root")
    return tmp_path
