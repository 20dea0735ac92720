"""``edgeloop models list|show|promote|rollback|pin`` against a live cloud API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cloud_service import registry
from cloud_service.announce import MemoryAnnouncer
from cloud_service.api import create_app
from cloud_service.settings import CloudSettings
from edge_agent.sources.http import ApiServer
from edge_agent.testing import make_tiny_student
from simulations.cli import app

pytestmark = pytest.mark.sql
TOKEN = "registry-cli-admin-token"


def test_registry_commands_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = CloudSettings(
        data_dir=tmp_path / "cloud",
        database_url=f"sqlite:///{tmp_path / 'cloud.db'}",
        admin_token=TOKEN,
        blob_fsync=False,
        rollout_tick_s=0,
    )
    app_ = create_app(settings, announcer=MemoryAnnouncer())
    state = app_.state.edgeloop
    with state.sessions.begin() as session:
        for version, seed in (("v1", 1), ("v2", 2)):
            path = make_tiny_student(
                tmp_path / f"{version}.onnx", size=32, seed=seed, version=version
            )
            registry.register_model(
                session=session, blobs=state.blobs, key=state.signing_key, artifact=path
            )
    monkeypatch.setenv("EDGELOOP_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("EDGELOOP_DATA_DIR", str(tmp_path / "cli"))
    runner = CliRunner()
    with ApiServer(app_) as server:
        monkeypatch.setenv("EDGELOOP_CLOUD_URL", server.url)

        listed = runner.invoke(app, ["models", "list", "--json"])
        assert listed.exit_code == 0, listed.output
        assert {v["version"] for v in json.loads(listed.output)} == {"v1", "v2"}

        for version in ("v1", "v2"):
            promoted = runner.invoke(app, ["models", "promote", "tiny-student", version, "--json"])
            assert promoted.exit_code == 0, promoted.output
            assert json.loads(promoted.output)["version"] == version

        rolled = runner.invoke(app, ["models", "rollback", "tiny-student", "--json"])
        assert rolled.exit_code == 0, rolled.output
        assert json.loads(rolled.output)["version"] == "v1"

        pinned = runner.invoke(app, ["models", "pin", "tiny-student", "v2", "cam-1", "--json"])
        assert pinned.exit_code == 0, pinned.output
        assert json.loads(pinned.output)["pinned"] == ["cam-1"]

        shown = runner.invoke(app, ["models", "show", "tiny-student", "v2", "--json"])
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.output)["version"] == "v2"

        missing = runner.invoke(app, ["models", "show", "tiny-student", "v9"])
        assert missing.exit_code == 2
        assert "404" in missing.output

    monkeypatch.setenv("EDGELOOP_ADMIN_TOKEN", "a-wrong-token-of-enough-length")
    with ApiServer(app_) as server:
        denied = runner.invoke(app, ["models", "list", "--cloud", server.url])
        assert denied.exit_code == 2
        assert "401" in denied.output or "403" in denied.output
