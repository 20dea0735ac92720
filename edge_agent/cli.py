"""``edge-agent``: the command line of the agent that runs on each device."""

from __future__ import annotations

from pathlib import Path

import typer

from edge_agent.settings import AgentSettings
from shared.console import ConfigOption, JsonOption, load_settings, print_json, settings_view

app = typer.Typer(
    help="EdgeLoop edge agent: quantized student on camera frames.", no_args_is_help=True
)


@app.command("settings")
def show_settings(config: Path | None = ConfigOption, as_json: bool = JsonOption) -> None:
    """Print the effective settings (file + environment), secrets redacted."""
    settings = load_settings(AgentSettings, config)
    view = settings_view(settings)
    if as_json:
        print_json(view)
        return
    for key in sorted(view):
        typer.echo(f"{key} = {view[key]}")


if __name__ == "__main__":
    app()
