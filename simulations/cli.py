"""``edgeloop``: the umbrella command (demo, models, jobs)."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer

from shared.console import (
    ConfigOption,
    JsonOption,
    add_settings_command,
    load_settings,
    print_json,
)
from shared.settings import EdgeLoopSettings
from simulations.cli_engine import register_engine_command
from simulations.cli_import import register_import_command
from simulations.cli_jobs import jobs_app
from simulations.cli_models import models_app
from simulations.cli_registry import register_commands
from simulations.cli_sim import sim_app

app = typer.Typer(
    help="EdgeLoop: edge-cloud hybrid inference that gets better on its own.",
    no_args_is_help=True,
)
add_settings_command(app, EdgeLoopSettings)
register_commands(models_app)
register_engine_command(models_app)
register_import_command(models_app)
app.add_typer(models_app, name="models")
app.add_typer(jobs_app, name="jobs")
app.add_typer(sim_app, name="sim")


# The drift each task's loop shows by default: blur blinds the teacher detector as
# much as the student at 320 px, a new belt texture does not.
DEFAULT_DRIFT = {"classification": "blur:0.8", "detection": "background:1.0"}
DriftOption = typer.Option(
    None,
    help="Drift injected after the clean phase (NAME:SEVERITY[,...]); default blur:0.8,"
    " or background:1.0 with --task detection.",
)


class LoopTask(StrEnum):
    classification = "classification"
    detection = "detection"


TaskOption = typer.Option(
    LoopTask.classification,
    "--task",
    help="classification (the digits) or detection (several digits per conveyor frame).",
)


def _detection_loop(
    settings: EdgeLoopSettings, *, quick: bool, drift: str, rounds: int, as_json: bool
) -> dict[str, Any]:
    """``edgeloop loop --task detection`` (``simulations.loop_detection``)."""
    from simulations.loop_detection import DetectionLoopConfig, run_detection_loop

    report = run_detection_loop(
        DetectionLoopConfig(quick=quick, drift=drift, rounds=rounds),
        work_dir=settings.data_dir,
    )
    if as_json:
        print_json(report)
    return report


@app.command("demo")
def demo(
    config: Path | None = ConfigOption,
    frames: int = typer.Option(300, min=50, max=100_000, help="Frames per phase per agent."),
    agents: int = typer.Option(3, min=1, max=32, help="Edge agents on the reference stream."),
    drift: str | None = DriftOption,
    threshold: float = typer.Option(
        0.85, min=0.0, max=1.0, help="Forward frames whose student confidence is below this."
    ),
    out: Path | None = typer.Option(
        None, help="Folder for the plot and the HTML report (default: DATA_DIR/demo)."
    ),
    rounds: int = typer.Option(
        2, min=1, max=10, help="Distillation rounds (the last one is the steady state)."
    ),
    quick: bool = typer.Option(False, "--quick", help="Small, fast-trained reference models."),
    task: LoopTask = TaskOption,
    as_json: bool = JsonOption,
) -> None:
    """The closed loop on embedded defaults: drift, trigger, jobs, delivery, recovery."""
    from simulations.demo import run_demo

    settings = load_settings(EdgeLoopSettings, config)
    if task is LoopTask.detection:
        report = _detection_loop(
            settings,
            quick=quick,
            drift=drift or DEFAULT_DRIFT["detection"],
            rounds=rounds,
            as_json=as_json,
        )
        out_dir = out or settings.data_dir / "demo"
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "loop-detection.json").write_text(json.dumps(report, indent=1, default=str))
        return
    run_demo(
        settings,
        quick=quick,
        frames=frames,
        agents=agents,
        drift=drift or DEFAULT_DRIFT["classification"],
        threshold=threshold,
        out_dir=out,
        as_json=as_json,
        rounds=rounds,
    )


@app.command("loop")
def closed_loop(
    config: Path | None = ConfigOption,
    frames: int = typer.Option(400, min=50, max=100_000, help="Frames per phase per agent."),
    agents: int = typer.Option(3, min=1, max=32, help="Edge agents on the stream."),
    drift: str | None = DriftOption,
    threshold: float = typer.Option(0.85, min=0.0, max=1.0, help="Student forwarding threshold."),
    max_samples: int = typer.Option(500, min=20, help="Teacher-labelled frames the round uses."),
    threads: int = typer.Option(2, min=1, max=64, help="Thread limit of the distill job."),
    plot: Path | None = typer.Option(None, help="Where to save the SVG plot."),
    report: Path | None = typer.Option(None, help="Where to write the HTML report."),
    rounds: int = typer.Option(
        2, min=1, max=10, help="Distillation rounds (the last one is the steady state)."
    ),
    stream_renders: int = typer.Option(
        16, min=1, max=64, help="Renders of each stream scan (distinct camera frames)."
    ),
    quick: bool = typer.Option(False, "--quick", help="Small, fast-trained reference models."),
    task: LoopTask = TaskOption,
    as_json: bool = JsonOption,
) -> None:
    """The closed loop: drift, trigger, distillation rounds, delivery, recovery; a table."""
    from simulations.closed_loop import run_closed_loop

    settings = load_settings(EdgeLoopSettings, config)
    if task is LoopTask.detection:
        _detection_loop(
            settings,
            quick=quick,
            drift=drift or DEFAULT_DRIFT["detection"],
            rounds=rounds,
            as_json=as_json,
        )
        return
    result = run_closed_loop(
        settings,
        quick=quick,
        frames=frames,
        agents=agents,
        drift=drift or DEFAULT_DRIFT["classification"],
        threshold=threshold,
        max_samples=max_samples,
        threads=threads,
        plot=plot,
        report_html=report,
        rounds=rounds,
        stream_renders=stream_renders,
    )
    if as_json:
        print_json({k: v for k, v in result.items() if k != "timeline"})


if __name__ == "__main__":
    app()
