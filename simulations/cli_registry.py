"""``edgeloop models list|show|promote|rollback|pin``: the model registry from the command line.

Thin clients of the cloud's REST API (``/v1/models``), authenticated with the
admin token. The API's URL is ``--cloud`` or ``EDGELOOP_CLOUD_URL``, else the
cloud settings' ``http_host``/``http_port``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.table import Table

from cloud_service.settings import CloudSettings
from shared.console import ConfigOption, JsonOption, console, fail, load_settings, print_json

__all__ = ["register_commands"]

CloudOption = typer.Option(None, "--cloud", help="Cloud API URL (default: EDGELOOP_CLOUD_URL).")
FleetOption = typer.Option("default", "--fleet", help="Fleet the change applies to.")


def _request(
    config: Path | None, cloud: str | None, method: str, path: str, body: Any = None
) -> Any:
    settings = load_settings(CloudSettings, config)
    base = (
        cloud
        or os.environ.get("EDGELOOP_CLOUD_URL")
        or (f"http://{settings.http_host}:{settings.http_port}")
    )
    headers = {"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"}
    try:
        response = httpx.request(method, base.rstrip("/") + path, json=body, headers=headers)
    except httpx.HTTPError as exc:
        fail(f"cannot reach the cloud API at {base}: {exc}")
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        fail(f"{method} {path} failed ({response.status_code}): {detail}")
    return response.json()


def list_models(
    name: str | None = typer.Option(None, "--name", help="Only this model name."),
    config: Path | None = ConfigOption,
    cloud: str | None = CloudOption,
    as_json: bool = JsonOption,
) -> None:
    """List registered model versions, newest first."""
    versions = _request(config, cloud, "GET", "/v1/models" + (f"?name={name}" if name else ""))
    if as_json:
        print_json(versions)
        return
    table = Table("name", "version", "format", "state", "parent", "size")
    for v in versions:
        table.add_row(
            v["name"],
            v["version"],
            v["format"],
            v["state"],
            v.get("parent_version") or "-",
            f"{v['size_bytes'] / 1024:.0f} KiB",
        )
    console.print(table)


def show_model(
    name: str,
    version: str,
    config: Path | None = ConfigOption,
    cloud: str | None = CloudOption,
    as_json: bool = JsonOption,
) -> None:
    """Show one version: manifest, metrics, lineage and agents' install reports."""
    detail = _request(config, cloud, "GET", f"/v1/models/{name}/{version}")
    if as_json:
        print_json(detail)
        return
    for key, value in detail.items():
        console.print(f"[bold]{key}[/]: {value}")


def promote(
    name: str,
    version: str,
    fleet: str = FleetOption,
    config: Path | None = ConfigOption,
    cloud: str | None = CloudOption,
    as_json: bool = JsonOption,
) -> None:
    """Announce a version to the whole fleet (signed, retained)."""
    serving = _request(
        config, cloud, "POST", f"/v1/models/{name}/{version}/promote", {"fleet": fleet}
    )
    if as_json:
        print_json(serving)
    else:
        console.print(f"{fleet} now serves {name} {version}")


def rollback(
    name: str,
    fleet: str = FleetOption,
    config: Path | None = ConfigOption,
    cloud: str | None = CloudOption,
    as_json: bool = JsonOption,
) -> None:
    """Announce the version the fleet served before the current one."""
    serving = _request(config, cloud, "POST", f"/v1/models/{name}/rollback", {"fleet": fleet})
    if as_json:
        print_json(serving)
    else:
        console.print(f"{fleet} rolled back to {name} {serving['version']}")


def pin(
    name: str,
    version: str,
    agents: list[str] = typer.Argument(..., help="Agent ids to hold on this version."),
    fleet: str = FleetOption,
    config: Path | None = ConfigOption,
    cloud: str | None = CloudOption,
    as_json: bool = JsonOption,
) -> None:
    """Hold agents on a version (per-agent announcement overriding the fleet's)."""
    result = _request(
        config,
        cloud,
        "POST",
        f"/v1/models/{name}/{version}/pin",
        {"fleet": fleet, "agents": agents},
    )
    if as_json:
        print_json(result)
    else:
        console.print(f"pinned {', '.join(agents)} to {version}")


def register_commands(app: typer.Typer) -> None:
    """Add the registry commands to ``edgeloop models``."""
    app.command("list")(list_models)
    app.command("show")(show_model)
    app.command("promote")(promote)
    app.command("rollback")(rollback)
    app.command("pin")(pin)
