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
from edge_agent.localauth import local_api_token
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
    # The local API token exists before the API answers, so `edge-agent rollback` finds it.
    local_api_token(settings, create=True)
    with (
        Agent(settings) as agent,
        ApiServer(create_app(agent), host=settings.http_host, port=settings.http_port) as server,
    ):
        log.info("agent API on %s", server.url)
        stop.wait()


# Device groups (/proc/devices) the agent may open: cameras (V4L2), NVIDIA GPUs
# (nvidia0, nvidiactl, nvidia-uvm, nvidia-caps) and Jetson's integrated GPU (nvhost-*,
# nvmap, nvgpu). Every other device node is refused (DevicePolicy=closed).
_DEVICE_GROUPS = ("video4linux", "nvidia*", "nvhost*", "nvmap", "nvgpu*")
_HOMES = (Path("/home"), Path("/root"), Path("/run/user"))


def _under_home(path: Path) -> bool:
    return any(path == home or home in path.parents for home in _HOMES)


def systemd_unit(
    *,
    user: str,
    config: Path,
    data_dir: Path,
    executable: str | None = None,
    description: str = "EdgeLoop edge agent",
) -> str:
    """A hardened systemd unit that restarts the agent on failure, as ``user``, with its paths."""
    python = executable or sys.executable
    command = " ".join(
        shlex.quote(part)
        for part in (python, "-m", "edge_agent.cli", "run", "--config", str(config))
    )
    # The agent's own files may sit in a home folder (a venv, an enrolled config): then
    # homes are an empty tmpfs with only those paths bound in, else they are hidden.
    if executable is None:
        environments = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}
    else:
        environments = {Path(python).parent.parent}  # {venv}/bin/python: the whole venv
    # The config's folder, not only the file: enrollment puts the broker's CA beside it.
    readable = [p for p in (*sorted(environments), config.parent) if _under_home(p)]
    if readable or _under_home(data_dir):
        homes = "ProtectHome=tmpfs\n"
        homes += "".join(f"BindReadOnlyPaths={p}\n" for p in readable)
        homes += f"BindPaths={data_dir}\n" if _under_home(data_dir) else ""
    else:
        homes = "ProtectHome=true\n"
    devices = "".join(f"DeviceAllow=char-{group} rw\n" for group in _DEVICE_GROUPS)
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

# Frames and the spool stay on this device; the agent writes its data dir and no more.
UMask=0077
NoNewPrivileges=true
ProtectSystem=strict
ReadWritePaths={data_dir}
{homes}PrivateTmp=true
PrivateMounts=true
RemoveIPC=true

# Cameras and GPUs are device files the agent opens (group video); nothing else.
SupplementaryGroups=video
DevicePolicy=closed
{devices}
# No privileges, no kernel, clock, hostname or cgroup changes, no namespaces.
CapabilityBoundingSet=
AmbientCapabilities=
ProtectKernelTunables=true
ProtectKernelModules=true
ProtectKernelLogs=true
ProtectControlGroups=true
ProtectClock=true
ProtectHostname=true
ProtectProc=invisible
RestrictNamespaces=true
RestrictRealtime=true
RestrictSUIDSGID=true
LockPersonality=true
# IP to the broker, the cloud and its clients; Unix sockets for the resolver.
RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged
SystemCallErrorNumber=EPERM
# MemoryDenyWriteExecute stays off: the CUDA driver compiles PTX into executable
# memory at run time and TensorRT builds its engines there.

[Install]
WantedBy=multi-user.target
"""
