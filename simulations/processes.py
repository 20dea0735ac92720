"""``cloud-service verifier`` and ``cloud-service api`` as processes on loopback.

    process = ServiceProcess("verifier", settings_env(values), workers=2, log=folder / "v.log")
    process.start()   # returns once every worker's /readyz answers 200
    process.kill()    # SIGKILL
    process.start()   # again, on the same port

The settings go in as ``EDGELOOP_*`` variables (``settings_env``), the output to a log
file appended across restarts (or this process's own output). A verifier with
``workers`` processes serves ``/readyz`` on ``port + i`` for worker ``i``; the API serves
``/healthz`` on ``port``. ``close()`` stops every process ``start()`` launched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import SecretStr

from shared.broker import free_port
from shared.errors import TransportError

__all__ = ["ServiceKind", "ServiceProcess", "settings_env"]

ServiceKind = Literal["verifier", "api"]


def settings_env(values: Mapping[str, Any]) -> dict[str, str]:
    """``CloudSettings`` fields as the ``EDGELOOP_*`` variables the service reads."""
    env: dict[str, str] = {}
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, SecretStr):
            text = value.get_secret_value()
        else:
            text = str(value)
        env[f"EDGELOOP_{name.upper()}"] = text
    return env


class ServiceProcess:
    """One ``cloud-service`` command on a fixed free loopback port, started on demand."""

    def __init__(
        self,
        kind: ServiceKind,
        env: Mapping[str, str],
        *,
        workers: int = 1,
        log: Path | None = None,
        ready_timeout_s: float = 90.0,
        stop_timeout_s: float = 30.0,
        checkout: Path | None = None,
    ) -> None:
        self.kind = kind
        self.workers = workers
        self.port = free_port()
        self.env = {**os.environ, **env}
        # Another checkout of the project (a base to compare with): the command runs in
        # it, and imports from it (``python -m`` puts the working directory first).
        self.checkout = checkout
        if checkout is not None:
            self.env["PYTHONPATH"] = str(checkout)
        self.log = log
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self._launched: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _command(self) -> list[str]:
        command = [sys.executable, "-m", "cloud_service", self.kind]
        if self.kind == "api":
            command += ["--host", "127.0.0.1"]
        if self.workers > 1:
            command += ["--workers", str(self.workers)]
        return [*command, "--port", str(self.port)]

    def _ready(self, http: httpx.Client) -> bool:
        if self.kind == "api":
            urls = [f"{self.url}/healthz"]
        else:
            urls = [f"http://127.0.0.1:{self.port + i}/readyz" for i in range(self.workers)]
        try:
            return all(http.get(url).status_code == 200 for url in urls)
        except httpx.HTTPError:
            return False

    def start(self) -> ServiceProcess:
        """Launch the command and wait until it answers its health check.

        The port is free_port()'s, in the ephemeral range: between a kill and the restart
        on the same port, a client socket of any process on the host may hold it for a
        moment. A launch that fails to bind it is tried again until ``ready_timeout_s``.
        """
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            logged = self.log.stat().st_size if self.log is not None and self.log.exists() else 0
            process = self._launch()
            with httpx.Client(timeout=1.0) as http:
                while process.poll() is None and time.monotonic() < deadline:
                    if self._ready(http):
                        return self
                    time.sleep(0.1)
            self._end(process)
            said = self.log.read_bytes()[logged:] if self.log is not None else b""
            if b"address already in use" not in said or time.monotonic() >= deadline:
                raise TransportError(
                    f"cloud-service {self.kind} did not become ready: {self.log_tail()}"
                )
            time.sleep(0.5)

    def _launch(self) -> subprocess.Popen[bytes]:
        if self.log is None:
            process = subprocess.Popen(self._command(), env=self.env, cwd=self.checkout)
        else:
            with self.log.open("ab") as handle:
                process = subprocess.Popen(
                    self._command(),
                    env=self.env,
                    cwd=self.checkout,
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                )
        self.process = process
        self._launched.append(process)
        return process

    def kill(self) -> None:
        """SIGKILL the running process and reap it."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``."""
        if self.process is not None:
            self._end(self.process)

    def restart(self) -> ServiceProcess:
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop every process this launcher started."""
        for process in self._launched:
            self._end(process)
        self._launched.clear()

    def _end(self, process: subprocess.Popen[bytes]) -> None:
        if process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

    def log_tail(self, chars: int = 2000) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")[-chars:]

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
