"""The token the agent's own API requires on its mutating routes (``Authorization: Bearer``).

The token is ``local_api_token`` when set (``edge-agent enroll`` writes one into the
agent's config), else the contents of ``local_api_token_file`` (default
``{data_dir}/local-api-token``), which the agent creates with mode 0600 when it
starts without one. ``edge-agent rollback`` reads it the same way, so the command
works on the device as the agent's user and nowhere else.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat

from edge_agent.settings import AgentSettings
from shared.errors import ConfigError

__all__ = ["bearer_refusal", "local_api_token"]


def local_api_token(settings: AgentSettings, *, create: bool = False) -> str | None:
    """The agent API's token; ``create`` makes the default file when there is none."""
    if settings.local_api_token is not None:
        return settings.local_api_token.get_secret_value()
    path = settings.resolved_local_api_token_file
    try:
        info = path.stat()
    except FileNotFoundError:
        if not create or settings.local_api_token_file is not None:
            return None  # a file named in the settings is the operator's to write
        return _create(settings)
    except OSError as exc:
        raise ConfigError(f"cannot read the local API token file {path}: {exc.strerror}") from exc
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"the local API token file {path} is readable by others"
            f" (mode {stat.S_IMODE(info.st_mode):o}): chmod 600 it"
        )
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the local API token file {path}: {exc.strerror}") from exc
    if not token:
        raise ConfigError(f"the local API token file {path} is empty")
    return token


def _create(settings: AgentSettings) -> str:
    path = settings.resolved_local_api_token_file
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first: use theirs
        return local_api_token(settings) or token
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    return token


def bearer_refusal(authorization: str | None, settings: AgentSettings) -> str | None:
    """Why a request with this ``Authorization`` header may not mutate the agent, else None."""
    try:
        expected = local_api_token(settings, create=True)
    except ConfigError as exc:
        return f"the agent has no usable local API token: {exc.message}"
    if expected is None:
        return (
            f"the agent has no local API token: write one to {settings.local_api_token_file}"
            " or set local_api_token"
        )
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return (
            "this route needs the agent's local API token (Authorization: Bearer ...;"
            " `edge-agent rollback` sends it)"
        )
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        return "the local API token is wrong"
    return None
