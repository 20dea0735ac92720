"""The unit ``edge-agent install-service`` writes scores OK in ``systemd-analyze security``."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edge_agent.cli import app
from edge_agent.service import systemd_unit

ANALYZE = shutil.which("systemd-analyze")
pytestmark = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze is not installed (no systemd on this machine)"
)
MAX_EXPOSURE = 3.0


def exposure(unit: Path) -> float:
    assert ANALYZE is not None
    done = subprocess.run(
        [ANALYZE, "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout + done.stderr)
    if found is None and "--offline" in done.stderr:
        pytest.skip(f"this systemd-analyze has no --offline: {done.stderr.strip()[:200]}")
    assert found is not None, done.stdout + done.stderr
    return float(found.group(1))


def test_the_installed_unit_is_hardened(tmp_path: Path) -> None:
    data = tmp_path / "data"
    config = tmp_path / "agent.toml"
    config.write_text(f'data_dir = "{data}"\nfleet = "f1"\n')
    unit = tmp_path / "edgeloop-agent.service"
    result = CliRunner().invoke(
        app, ["install-service", "--config", str(config), "--user", "edge", "--output", str(unit)]
    )
    assert result.exit_code == 0, result.output
    text = unit.read_text()
    # Still able to open cameras and GPUs (desktop NVIDIA and Jetson), and its data dir.
    for device in ("video4linux", "nvidia*", "nvhost*", "nvmap"):
        assert f"DeviceAllow=char-{device} rw" in text
    assert "SupplementaryGroups=video" in text
    assert f"ReadWritePaths={data.resolve()}" in text
    score = exposure(unit)
    assert score <= MAX_EXPOSURE, f"exposure {score}:\n{text}"


def test_a_unit_for_files_in_a_home_folder_binds_just_those(tmp_path: Path) -> None:
    unit = tmp_path / "edgeloop-agent.service"
    unit.write_text(
        systemd_unit(
            user="ada",
            config=Path("/home/ada/.config/edgeloop/agent.toml"),
            data_dir=Path("/home/ada/.local/share/edgeloop"),
            executable="/home/ada/venv/bin/python",
        )
    )
    text = unit.read_text()
    assert "ProtectHome=tmpfs" in text
    assert "BindReadOnlyPaths=/home/ada/.config/edgeloop\n" in text  # the broker CA too
    assert "BindReadOnlyPaths=/home/ada/venv\n" in text
    assert "BindPaths=/home/ada/.local/share/edgeloop" in text
    assert exposure(unit) <= MAX_EXPOSURE
