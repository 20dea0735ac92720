"""Enrollment: trade a one-time token for the agent's identity, broker settings and keys.

``POST {cloud}/v1/enroll`` with ``{"token", "agent_id"}`` answers the agent's id,
fleet, broker URL and credentials, topic prefix, the fleet's public key and an API
token. The answer is written as a TOML config file with mode 0600 (it holds
credentials), which ``AgentSettings.load`` reads.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import httpx

from shared.errors import ConfigError, TransportError

__all__ = ["enroll", "set_config_values", "write_config"]

log = logging.getLogger(__name__)

_REQUIRED = (
    "agent_id",
    "fleet",
    "mqtt_url",
    "topic_prefix",
    "fleet_public_key",
    "key_id",
    "api_token",
)


def enroll(
    cloud_url: str,
    token: str,
    *,
    agent_id: str | None = None,
    transport: httpx.BaseTransport | None = None,
    timeout: float = 15.0,
) -> dict[str, Any]:
    """Exchange ``token`` for the agent's settings; raises ConfigError/TransportError."""
    url = cloud_url.rstrip("/") + "/v1/enroll"
    try:
        with httpx.Client(transport=transport, timeout=timeout) as client:
            response = client.post(url, json={"token": token, "agent_id": agent_id})
    except httpx.HTTPError as exc:
        raise TransportError(f"cannot reach the cloud at {url}: {exc}") from exc
    if response.status_code != 200:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text[:200]
        meaning = {401: "the token is unknown or expired", 409: "the token was already used"}
        what = meaning.get(response.status_code, f"HTTP {response.status_code}")
        raise ConfigError(f"enrollment refused: {what} ({detail})")
    try:
        data = response.json()
    except ValueError as exc:
        raise ConfigError(f"enrollment answer from {url} is not JSON") from exc
    missing = [key for key in _REQUIRED if not data.get(key)]
    if not isinstance(data, dict) or missing:
        raise ConfigError(f"enrollment answer from {url} lacks {missing}")
    if not data.get("mqtt_username"):
        log.warning(
            "the cloud issued NO broker credentials: this agent will reach the broker "
            "anonymously, which is for development only (the cloud runs with broker_auth off)"
        )
    data["cloud_url"] = cloud_url
    return data


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    # A JSON string is a valid TOML basic string (same escapes).
    return json.dumps(str(value))


def write_config(path: Path, values: dict[str, Any], *, keep: dict[str, Any] | None = None) -> Path:
    """Write flat ``key = value`` TOML with mode 0600 (created so, never world-readable)."""
    merged = {**(keep or {}), **{k: v for k, v in values.items() if v is not None}}
    lines = ["# Written by `edge-agent enroll`; holds credentials (mode 0600)."]
    lines += [f"{key} = {_toml_value(value)}" for key, value in sorted(merged.items())]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def set_config_values(path: Path, values: dict[str, int | float | bool | str]) -> Path:
    """Set top-level scalar ``values`` in the TOML file at ``path``, keeping the rest of
    it as written (comments, tables such as ``[[cameras]]``); creates it (mode 0600)
    when missing. Raises ConfigError when the file is not TOML."""
    text = path.read_text() if path.is_file() else ""
    try:
        before = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not a TOML file: {exc}") from exc
    lines = text.splitlines()
    # Top-level keys end where the first table begins.
    top = next((i for i, line in enumerate(lines) if line.lstrip().startswith("[")), len(lines))
    missing: list[str] = []
    for key, value in values.items():
        line = f"{key} = {_toml_value(value)}"
        pattern = re.compile(rf"^\s*{re.escape(key)}\s*=")
        at = next((i for i in range(top) if pattern.match(lines[i])), None)
        if at is None:
            missing.append(line)
        else:
            lines[at] = line
    lines[top:top] = missing
    updated = "\n".join(lines) + "\n"
    parsed = tomllib.loads(updated)
    kept = {k: v for k, v in parsed.items() if k not in values}
    if any(parsed.get(k) != v for k, v in values.items()) or kept != {
        k: v for k, v in before.items() if k not in values
    }:
        raise ConfigError(f"could not set {sorted(values)} in {path}: set them by hand")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(updated)
    os.replace(tmp, path)
    return path
