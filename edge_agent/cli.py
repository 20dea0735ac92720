"""``edge-agent``: the command line of the agent that runs on each device."""

from __future__ import annotations

import getpass
import json
import logging
import secrets
import sqlite3
import tomllib
from pathlib import Path
from typing import Any

import typer

from edge_agent.settings import AgentSettings, default_config_path
from shared.console import (
    JsonOption,
    fail,
    load_settings,
    print_json,
)
from shared.errors import EdgeLoopError

app = typer.Typer(
    help="EdgeLoop edge agent: quantized student on camera frames.", no_args_is_help=True
)

AgentConfigOption = typer.Option(
    None,
    "--config",
    "-c",
    help="TOML settings file (default: the one `edge-agent enroll` wrote,"
    " $XDG_CONFIG_HOME/edgeloop/agent.toml, when it exists); EDGELOOP_* variables win.",
)


def _agent_config(config: Path | None) -> Path | None:
    """The file to read: ``--config``, else the enrolled config when there is one."""
    if config is not None:
        return config
    enrolled = default_config_path()
    return enrolled if enrolled.is_file() else None


@app.command("settings")
def show_settings(config: Path | None = AgentConfigOption, as_json: bool = JsonOption) -> None:
    """Print the effective settings (the enrolled config + environment), secrets redacted."""
    from shared.console import settings_view

    view = settings_view(load_settings(AgentSettings, _agent_config(config)))
    if as_json:
        print_json(view)
        return
    for key in sorted(view):
        typer.echo(f"{key} = {view[key]}")


@app.command("run")
def run(
    config: Path | None = AgentConfigOption,
    host: str | None = typer.Option(
        None, "--host", help="HTTP API address (default from settings)."
    ),
    port: int | None = typer.Option(None, "--port", help="HTTP API port (default from settings)."),
) -> None:
    """Run the agent: sources, student, spool, uplink and the local HTTP API."""
    from edge_agent.service import run_agent

    overrides: dict[str, Any] = {}
    if host is not None:
        overrides["http_host"] = host
    if port is not None:
        overrides["http_port"] = port
    settings = load_settings(AgentSettings, _agent_config(config), **overrides)
    try:
        run_agent(settings)
    except EdgeLoopError as exc:
        fail(exc.message)


def _spool_summary(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"path": str(path), "exists": False}
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        depth, size = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM samples").fetchone()
        counters = dict(db.execute("SELECT name, value FROM counters").fetchall())
    finally:
        db.close()
    return {"path": str(path), "exists": True, "depth": depth, "bytes": size, **counters}


def _fmt(value: Any, digits: int) -> str:
    """A figure rounded for reading; '-' where the agent has none yet."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value is None else str(value)
    return f"{value:.{digits}f}"


@app.command("status")
def status(
    config: Path | None = AgentConfigOption,
    port: int | None = typer.Option(
        None, "--port", help="The agent's HTTP API port (default from settings)."
    ),
    as_json: bool = JsonOption,
    timeout: float = typer.Option(2.0, help="Seconds to wait for the running agent."),
    threads: float = typer.Option(
        0.0,
        "--threads",
        metavar="SECONDS",
        help="Also watch the agent's threads for this many seconds: each one's share of a"
        " core (from its /metrics), busiest first.",
        min=0.0,
        max=60.0,
    ),
) -> None:
    """Show the running agent's status (its local API), else what its spool holds."""
    import httpx

    overrides: dict[str, Any] = {} if port is None else {"http_port": port}
    settings = load_settings(AgentSettings, _agent_config(config), **overrides)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # its request lines are not status
    base = f"http://{settings.http_host}:{settings.http_port}"
    url = f"{base}/v1/status"
    data: dict[str, Any]
    try:
        response = httpx.get(url, timeout=timeout)
        response.raise_for_status()
        data = {"running": True, **response.json()}
        if threads:
            data["threads"] = _thread_shares(f"{base}/metrics", threads, timeout)
    except httpx.HTTPError as exc:
        data = {
            "running": False,
            "error": f"no agent answered at {url}: {exc}",
            "spool": _spool_summary(settings.resolved_spool_path),
        }
    if as_json:
        print_json(data)
        return
    if not data["running"]:
        typer.echo(data["error"])
        typer.echo(f"spool: {json.dumps(data['spool'])}")
        raise typer.Exit(1)
    model = data["model"]
    typer.echo(
        f"agent {data['fleet']}/{data['agent']}: ready={data['ready']}"
        f" connected={data['connected']}"
    )
    typer.echo(f"model {model['name']} {model['version']} on {model['provider']}")
    typer.echo(
        f"frames/s {_fmt(data['frames_per_s'], 1)}  p50 {_fmt(data['latency_p50_ms'], 2)} ms"
        f"  p99 {_fmt(data['latency_p99_ms'], 2)} ms"
        f"  forward rate {_fmt(data['forward_rate'], 3)}"
    )
    typer.echo(
        f"spool {data['spool']['depth']} samples, {data['spool']['bytes']} bytes;"
        f" dropped frames {data['dropped_frames']}"
    )
    uplink = data.get("uplink") or {}
    if "connects" in uplink:
        typer.echo(
            f"uplink {uplink['broker']} as {uplink['client_id']}: {uplink['connects']} connects,"
            f" {uplink['disconnects']} disconnects; last error: {uplink['last_error'] or '-'}"
        )
    for source in data["sources"]:
        typer.echo(
            f"source {source['name']} ({source['kind']}): {source['state']}"
            f" {source.get('last_error') or ''}"
        )
    if "threads" in data:
        typer.echo(f"threads over {threads:g} s (share of a core):")
        for name, share in data["threads"].items():
            typer.echo(f"  {name:<28} {share:6.1%}")


def _thread_shares(metrics_url: str, seconds: float, timeout: float) -> dict[str, float]:
    """Each thread's share of a core over ``seconds``, from two scrapes of ``metrics_url``,
    busiest first (raises httpx.HTTPError when the agent does not answer)."""
    import time

    import httpx

    from shared.thread_cpu import scraped_thread_seconds

    def scrape() -> tuple[float, dict[str, float]]:
        response = httpx.get(metrics_url, timeout=timeout)
        response.raise_for_status()
        return time.monotonic(), scraped_thread_seconds(response.text)

    started, first = scrape()
    time.sleep(seconds)
    ended, second = scrape()
    elapsed = max(ended - started, 1e-9)
    shares = {
        name: max(value - first.get(name, 0.0), 0.0) / elapsed for name, value in second.items()
    }
    return dict(sorted(shares.items(), key=lambda item: -item[1]))


@app.command("tune")
def tune_command(
    frames: Path = typer.Argument(
        ...,
        help="Frames like the ones this agent will serve: a folder of JPEG/PNG images"
        " (subfolders too), sent as uploads, or a video file, read as a camera is.",
    ),
    config: Path | None = AgentConfigOption,
    seconds: float = typer.Option(3.0, help="Seconds timed per layout and round.", min=0.5),
    rounds: int = typer.Option(3, help="Rounds; the layouts alternate in each.", min=1, max=20),
    batches: str = typer.Option(
        "",
        "--batches",
        help="Batch sizes to try, comma-separated (default: the configured max_batch).",
    ),
    write: bool = typer.Option(
        False, "--write", help="Save the fastest layout's settings in the config file."
    ),
    as_json: bool = JsonOption,
) -> None:
    """Time the agent's whole pipeline on this device in each inference layout (how
    batches spread over the cores, and their size) and print the fastest first."""
    from edge_agent.enroll import set_config_values
    from edge_agent.tuning import candidate_layouts, check_clip, default_cores, load_frames, tune

    config_path = _agent_config(config)
    settings = load_settings(AgentSettings, config_path)
    logging.getLogger("edge_agent.agent").setLevel(logging.WARNING)  # a start per window
    try:
        sizes = [int(b) for b in batches.split(",") if b.strip()] or [settings.max_batch]
    except ValueError:
        fail(f"--batches takes whole numbers separated by commas, not {batches!r}")
    if any(not 1 <= size <= 1024 for size in sizes):
        fail("--batches: each batch size is between 1 and 1024")
    layouts = candidate_layouts(default_cores(), sizes)
    try:
        loaded: list[bytes] | Path = load_frames(frames) if frames.is_dir() else check_clip(frames)
        if not as_json:
            shown = (
                f"{len(loaded)} images sent as uploads"
                if isinstance(loaded, list)
                else f"{frames.name} read as a camera"
            )
            typer.echo(f"{len(layouts)} layouts, {rounds} rounds of {seconds:g} s each, on {shown}")
        trials = tune(
            settings,
            loaded,
            layouts=layouts,
            seconds=seconds,
            rounds=rounds,
            progress=None
            if as_json
            else lambda r, layout, fps: typer.echo(
                f"  round {r + 1}: {layout.label}: {fps:.0f} fps"
            ),
        )
    except EdgeLoopError as exc:
        fail(exc.message)
    best = trials[0]
    written: str | None = None
    if write:
        target = config_path or default_config_path()
        try:
            written = str(set_config_values(target, dict(best.layout.settings())))
        except EdgeLoopError as exc:
            fail(exc.message)
    if as_json:
        print_json(
            {
                "trials": [{**trial.layout.settings(), **trial.figures()} for trial in trials],
                "best": best.layout.settings(),
                "written": written,
            }
        )
        return
    typer.echo(f"{'layout':<52} {'frames/s':>9} {'CPU ms/frame':>13} {'p50 ms':>8} {'p99 ms':>8}")
    for trial in trials:
        typer.echo(
            f"{trial.layout.label:<52} {trial.frames_per_s:9.0f} {trial.cpu_ms_per_frame:13.3f}"
            f" {trial.p50_ms:8.1f} {trial.p99_ms:8.1f}"
        )
    settings_line = " ".join(f"{k}={v}" for k, v in best.layout.settings().items())
    typer.echo(f"fastest: {settings_line} (forward rate {best.forward_rate:.3f})")
    if written:
        typer.echo(f"written to {written}; restart the agent to use it")
    else:
        typer.echo("set these (or run again with --write) and restart the agent to use them")


@app.command("rollback")
def rollback_command(
    config: Path | None = AgentConfigOption,
    as_json: bool = JsonOption,
    timeout: float = typer.Option(30.0, help="Seconds to wait for the running agent."),
) -> None:
    """Serve the previous model version again (the running agent, else at its next start)."""
    import httpx

    from edge_agent.localauth import local_api_token
    from edge_agent.updates import offline_rollback

    settings = load_settings(AgentSettings, _agent_config(config))
    url = f"http://{settings.http_host}:{settings.http_port}/v1/model/rollback"
    try:
        token = local_api_token(settings)
    except EdgeLoopError as exc:
        fail(exc.message)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.post(url, headers=headers, timeout=timeout)
    except httpx.TransportError:
        try:
            previous = offline_rollback(settings)
        except EdgeLoopError as exc:
            fail(exc.message)
        data: dict[str, Any] = {
            "running": False,
            "result": "rolled-back",
            "version": previous.version,
            "note": "the agent is not running; it will start on this version",
        }
    else:
        if response.status_code != 200:
            fail(response.json().get("detail", response.text))
        data = {"running": True, **response.json()}
    if as_json:
        print_json(data)
    else:
        typer.echo(f"rolled back to {data['version']}" + ("" if data["running"] else " (offline)"))


@app.command("enroll")
def enroll_command(
    cloud: str = typer.Option(..., "--cloud", help="The cloud service's base URL."),
    token: str = typer.Option(..., "--token", help="One-time enrollment token."),
    config: Path | None = typer.Option(
        None,
        "--config",
        "-c",
        help="Config file to write (default: $XDG_CONFIG_HOME/edgeloop/agent.toml, which"
        " `edge-agent run` and `status` read without flags).",
    ),
    agent_id: str | None = typer.Option(None, "--agent-id", help="Ask for this agent id."),
    model_path: Path | None = typer.Option(None, "--model", help="Student model path to record."),
    as_json: bool = JsonOption,
) -> None:
    """Exchange an enrollment token for this agent's identity and write its config (0600)."""
    from edge_agent.enroll import enroll, write_config

    path = (config or default_config_path()).expanduser()
    keep: dict[str, Any] = {}
    if path.is_file():
        try:
            keep = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            fail(f"cannot read the existing config {path}: {exc}")
    try:
        answer = enroll(cloud, token, agent_id=agent_id)
    except EdgeLoopError as exc:
        fail(exc.message)
    fields = (
        "agent_id",
        "fleet",
        "mqtt_url",
        "mqtt_username",
        "mqtt_password",
        "topic_prefix",
        "fleet_public_key",
        "key_id",
        "api_token",
        "cloud_url",
    )
    values = {key: answer.get(key) for key in fields}
    # The token this agent's own API will require on its mutating routes (rollback);
    # kept across re-enrollment so scripts that hold it keep working.
    values["local_api_token"] = keep.get("local_api_token") or secrets.token_urlsafe(32)
    if answer.get("mqtt_ca_pem"):
        # The broker's CA beside the config: the agent verifies the broker with it.
        ca_path = path.with_name("broker-ca.crt")
        ca_path.parent.mkdir(parents=True, exist_ok=True)
        ca_path.write_text(answer["mqtt_ca_pem"])
        values["mqtt_ca_file"] = str(ca_path)
    if model_path is not None:
        values["model_path"] = str(model_path)
    write_config(path, values, keep=keep)
    try:
        AgentSettings.load(path)  # the file must be one the agent can run from
    except EdgeLoopError as exc:
        fail(f"wrote {path}, but it does not load: {exc.message}")
    summary = {
        "config": str(path),
        "agent_id": answer["agent_id"],
        "fleet": answer["fleet"],
        "mqtt_url": answer["mqtt_url"],
    }
    if as_json:
        print_json(summary)
    else:
        typer.echo(f"enrolled as {answer['fleet']}/{answer['agent_id']}; config written to {path}")


@app.command("install-service")
def install_service(
    config: Path = typer.Option(..., "--config", "-c", help="The agent's config file."),
    user: str = typer.Option(getpass.getuser(), "--user", help="User the service runs as."),
    output: Path = typer.Option(
        Path("/etc/systemd/system/edgeloop-agent.service"),
        "--output",
        "-o",
        help="Where to write the unit.",
    ),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Default: from the settings."),
) -> None:
    """Write a systemd unit (restart policy, user, paths); prints the commands to enable it."""
    from edge_agent.service import systemd_unit

    settings = load_settings(AgentSettings, config)
    unit = systemd_unit(
        user=user,
        config=config.expanduser().resolve(),
        data_dir=(data_dir or settings.data_dir).expanduser().resolve(),
    )
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(unit)
    except OSError as exc:
        fail(f"cannot write {output}: {exc} (run as root, or pass --output)")
    typer.echo(f"wrote {output}")
    typer.echo(f"next: sudo systemctl daemon-reload && sudo systemctl enable --now {output.stem}")


if __name__ == "__main__":
    app()
