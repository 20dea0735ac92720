"""What every EdgeLoop command line shares: loading settings, printing, failing cleanly."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.logging import RichHandler

from shared.errors import EdgeLoopError
from shared.settings import EdgeLoopSettings

__all__ = [
    "ConfigOption",
    "JsonOption",
    "add_settings_command",
    "console",
    "fail",
    "load_settings",
    "print_json",
]

S = TypeVar("S", bound=EdgeLoopSettings)

console = Console(stderr=False)
err_console = Console(stderr=True)

ConfigOption = typer.Option(
    None, "--config", "-c", help="TOML settings file; EDGELOOP_* variables win over it."
)
JsonOption = typer.Option(False, "--json", help="Print the result as JSON.")


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one clear line to stderr and exit with ``code`` (no traceback)."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def load_settings(cls: type[S], config: Path | None, **overrides: Any) -> S:
    """Load a process's settings or exit with the reason; also sets up logging."""
    try:
        settings = cls.load(config, **overrides)
    except EdgeLoopError as exc:
        fail(exc.message)
    configure_logging(settings.log_level)
    return settings


def configure_logging(level: str) -> None:
    """Log to stderr through rich, as every command line does (also in a spawned worker)."""
    logging.basicConfig(
        level=level,
        format="%(message)s",
        handlers=[RichHandler(console=err_console, show_path=False, rich_tracebacks=True)],
    )


def print_json(data: Any) -> None:
    """Print JSON to stdout (plain, so scripts can parse it)."""
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def settings_view(settings: EdgeLoopSettings) -> dict[str, Any]:
    """The effective settings as JSON-able values, secrets redacted."""
    data = settings.model_dump(mode="json")
    for key, value in list(data.items()):
        if value is not None and ("password" in key or "secret" in key or "token" in key):
            data[key] = "***"
    data["database_url"] = settings.resolved_database_url
    return data


def add_settings_command(app: typer.Typer, cls: type[EdgeLoopSettings]) -> None:
    """Give ``app`` a ``settings`` command printing ``cls``'s effective values."""

    def show_settings(config: Path | None = ConfigOption, as_json: bool = JsonOption) -> None:
        """Print the effective settings (file + environment), secrets redacted."""
        view = settings_view(load_settings(cls, config))
        if as_json:
            print_json(view)
            return
        for key in sorted(view):
            typer.echo(f"{key} = {view[key]}")

    app.command("settings")(show_settings)
