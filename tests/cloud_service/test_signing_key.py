"""Where the fleet's model-signing key comes from, per environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud_service.settings import CloudSettings
from cloud_service.web.state import load_signing_key
from shared.errors import ConfigError


def test_development_creates_the_key_once(tmp_path: Path) -> None:
    settings = CloudSettings(data_dir=tmp_path)
    first = load_signing_key(settings)
    assert settings.resolved_signing_key_file.exists()
    assert load_signing_key(settings).key_id == first.key_id


def test_production_refuses_to_invent_a_key(tmp_path: Path) -> None:
    settings = CloudSettings.model_construct(
        **{**CloudSettings(data_dir=tmp_path).__dict__, "env": "production"}
    )
    with pytest.raises(ConfigError, match="keys init"):
        load_signing_key(settings)
    assert not settings.resolved_signing_key_file.exists()


def test_a_process_that_never_signs_writes_no_key(tmp_path: Path) -> None:
    settings = CloudSettings(data_dir=tmp_path)
    load_signing_key(settings, signs=False)
    assert not settings.resolved_signing_key_file.exists()
