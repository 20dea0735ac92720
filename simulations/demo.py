"""``edgeloop demo`` (``make demo``): the closed loop on embedded defaults, in one process tree.

An embedded MQTT broker, SQLite and a local blob folder; the cloud service (verifier
and REST API); a distill worker; several edge agents on the reference stream. Drift
is injected, the drift trigger fires, a distillation job runs, the new student
reaches the agents, and accuracy recovers; then the drifted stream goes on and the
trigger fires again for the next round, until the last round (the steady state).
Progress is live in the terminal; at the
end the table is printed, a plot saved, and a self-contained HTML report written
(see ``simulations.closed_loop`` for what is measured and how).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from shared.settings import EdgeLoopSettings

__all__ = ["run_demo"]


def run_demo(
    settings: EdgeLoopSettings,
    *,
    quick: bool,
    frames: int = 300,
    agents: int = 3,
    drift: str = "blur:0.8",
    threshold: float = 0.85,
    out_dir: Path | None = None,
    as_json: bool = False,
    console: Console | None = None,
    models: Any = None,
    rounds: int = 2,
    job_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the closed loop (``rounds`` rounds), write ``loop.svg`` and ``loop.html``.

    Returns the figures; ``job_params`` adds parameters to every round's job.
    """
    from simulations.closed_loop import run_closed_loop

    console = console or Console(stderr=as_json)
    out = Path(out_dir) if out_dir is not None else settings.data_dir / "demo"
    out.mkdir(parents=True, exist_ok=True)
    console.print(
        "[bold]EdgeLoop demo[/]: the closed loop on embedded defaults"
        + (" (quick models)" if quick else "")
    )
    report = run_closed_loop(
        settings,
        quick=quick,
        frames=frames,
        agents=agents,
        drift=drift,
        threshold=threshold,
        plot=out / "loop.svg",
        report_html=out / "loop.html",
        console=console,
        models=models,
        rounds=rounds,
        job_params=job_params,
    )
    if as_json:
        print(json.dumps({k: v for k, v in report.items() if k != "timeline"}, default=str))
    return report
