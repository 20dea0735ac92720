"""Databases for runs on one machine: a fresh PostgreSQL database, or a private server.

    with fresh_database(fallback=folder / "run.db") as url:   # dropped on exit
        ...

``fresh_database`` creates a database on the local PostgreSQL server (``127.0.0.1:5432``
unless told otherwise) and drops it on exit; with ``fallback`` it yields a SQLite file
there when no server answers. ``PostgresProcess`` runs a private server (``initdb`` into
a temp folder, a free port) that a fault scenario can stop and start.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from shared.broker import free_port

__all__ = [
    "POSTGRES_ADMIN_URL",
    "PostgresProcess",
    "fresh_database",
    "postgres_binaries",
]

POSTGRES_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
POSTGRES_BIN = Path(os.environ.get("EDGELOOP_POSTGRES_BIN", "/usr/lib/postgresql/15/bin"))


@contextmanager
def fresh_database(
    admin_url: str = POSTGRES_ADMIN_URL,
    *,
    prefix: str = "edgeloop",
    fallback: Path | None = None,
) -> Iterator[str]:
    """A new database named ``{prefix}_{random}`` on ``admin_url``'s server, dropped on exit.

    With ``fallback``, a SQLite file at that path when no server answers; without it,
    the server's error stands.
    """
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    try:
        admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception:  # no PostgreSQL answering
        if fallback is None:
            raise
        yield f"sqlite:///{fallback}"
        return
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def postgres_binaries() -> Path | None:
    """The folder holding ``initdb`` and ``postgres``, or None when PostgreSQL is not installed."""
    for folder in (POSTGRES_BIN, *(Path(p) for p in os.get_exec_path())):
        if (folder / "initdb").exists() and (folder / "postgres").exists():
            return folder
    return None


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class PostgresProcess:
    """A private PostgreSQL on a free loopback port: ``start()``, ``stop()``, its ``url``.

    As root the server runs as the ``postgres`` user (PostgreSQL refuses root), so its
    data folder is made outside pytest's root-only temp tree.
    """

    def __init__(self, binaries: Path) -> None:
        self.binaries = binaries
        self.folder = Path(tempfile.mkdtemp(prefix="edgeloop-chaos-pg-"))
        self.data = self.folder / "data"
        self.port = free_port()
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = "postgres"
            entry = pwd.getpwnam(self.user)
            os.chown(self.folder, entry.pw_uid, entry.pw_gid)
        self.process: subprocess.Popen[bytes] | None = None
        initdb = [str(binaries / "initdb"), "-D", str(self.data), "-A", "trust"]
        subprocess.run(
            [*initdb, "-U", "postgres", "--no-sync", "-E", "UTF8"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            user=self.user,
        )

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self, timeout: float = 30.0) -> None:
        log = (self.folder / "postgres.log").open("ab")
        options = {
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self.folder),
            "fsync": "off",
            "max_connections": "40",
            "shared_buffers": "16MB",
        }
        command = [str(self.binaries / "postgres"), "-D", str(self.data), "-p", str(self.port)]
        for name, value in options.items():
            command += ["-c", f"{name}={value}"]
        self.process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            user=self.user,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not start: {self.log_tail()}")
            if _accepts(self.port):
                ready = subprocess.run(
                    [str(self.binaries / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                if ready.returncode == 0:
                    return
            time.sleep(0.1)

    def stop(self) -> None:
        """A fast shutdown: open connections are cut, as in a restart."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def log_tail(self) -> str:
        path = self.folder / "postgres.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
