"""Running the agent as a process: HTTP API + agent, signals, and the systemd unit."""

from __future__ import annotations

import logging
import shlex
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from edge_agent.sources.http import ApiServer, create_app

__all__ = ["run_agent", "systemd_unit"]

log = logging.getLogger(__name__)


def run_agent(settings: AgentSettings, *, stop: threading.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or ``stop``): agent, sources and the local HTTP API."""
    stop = stop or threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    with (
        Agent(settings) as agent,
        ApiServer(create_app(agent), host=settings.http_host, port=settings.http_port) as server,
    ):
        log.info("agent API on %s", server.url)
        stop.wait()


def systemd_unit(
    *,
    user: str,
    config: Path,
    data_dir: Path,
    executable: str | None = None,
    description: str = "EdgeLoop edge agent",
) -> str:
    """A systemd unit that restarts the agent on failure, as ``user``, with its paths."""
    python = executable or sys.executable
    command = " ".join(
        shlex.quote(part)
        for part in (python, "-m", "edge_agent.cli", "run", "--config", str(config))
    )
    return f"""[Unit]
Description={description}
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
User={user}
Group={user}
WorkingDirectory={data_dir}
Environment=EDGELOOP_DATA_DIR={data_dir}
ExecStart={command}
Restart=always
RestartSec=5
# Give the agent time to publish "offline" and close its spool.
TimeoutStopSec=20
KillSignal=SIGTERM
# Frames and the spool stay on this device; the agent needs no more than its data dir.
NoNewPrivileges=true
ProtectSystem=strict
ProtectHome=read-only
ReadWritePaths={data_dir}
PrivateTmp=true
# Cameras (/dev/video*) and GPUs (/dev/nvidia*) are device files the agent must open.
SupplementaryGroups=video

[Install]
WantedBy=multi-user.target
"""
