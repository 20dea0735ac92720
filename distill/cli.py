"""``edgeloop``: the umbrella command (demo, models, jobs)."""

from __future__ import annotations

from pathlib import Path

import typer

from distill.cli_models import models_app
from distill.cli_registry import register_commands
from shared.console import ConfigOption, JsonOption, load_settings, print_json, settings_view
from shared.settings import EdgeLoopSettings

app = typer.Typer(
    help="EdgeLoop: edge-cloud hybrid inference that gets better on its own.",
    no_args_is_help=True,
)
register_commands(models_app)
app.add_typer(models_app, name="models")


@app.command("demo")
def demo(
    config: Path | None = ConfigOption,
    frames: int = typer.Option(400, min=10, max=100_000, help="Camera frames to stream."),
    drift: str = typer.Option(
        "blur:0.8", help="Drift the stream ramps into halfway through (NAME:SEVERITY[,...])."
    ),
    threshold: float = typer.Option(
        0.9, min=0.0, max=1.0, help="Forward frames whose student confidence is below this."
    ),
    quick: bool = typer.Option(False, "--quick", help="Small, fast-trained reference models."),
    as_json: bool = JsonOption,
) -> None:
    """Run the loop on embedded defaults: broker, student on the edge, teacher in the cloud."""
    from simulations.demo import run_demo

    settings = load_settings(EdgeLoopSettings, config)
    run_demo(
        settings,
        frames=frames,
        drift=drift,
        threshold=threshold,
        quick=quick,
        as_json=as_json,
    )


@app.command("settings")
def show_settings(config: Path | None = ConfigOption, as_json: bool = JsonOption) -> None:
    """Print the effective shared settings, secrets redacted."""
    view = settings_view(load_settings(EdgeLoopSettings, config))
    if as_json:
        print_json(view)
        return
    for key in sorted(view):
        typer.echo(f"{key} = {view[key]}")


if __name__ == "__main__":
    app()
