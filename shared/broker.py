"""Brokers a process can own: an embedded one, and a private Mosquitto.

Production points at Mosquitto or an EMQX/HiveMQ cluster by URL. The embedded
broker is amqtt (pure Python, MQTT 3.1.1) running on its own event loop in a
daemon thread, bound to loopback on a free port, so nothing has to be installed
by hand. It speaks 3.1.1 only: clients fall back from MQTT v5 automatically
(see ``shared.mqtt``), and ``$share`` subscriptions are not available on it.

``MosquittoProcess`` runs an installed Mosquitto on a free loopback port, for the
outage tests, the fleet simulation and the soak: things that stop and start it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from shared.errors import TransportError

__all__ = ["EmbeddedBroker", "MosquittoProcess", "free_port"]

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _answers(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class MosquittoProcess:
    """An installed Mosquitto on a free loopback port, under ``workdir``.

    ``start()``, ``stop()``, ``restart()`` (the port stays), or ``with`` for one run.
    Raises TransportError when Mosquitto is not installed.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        persistence: bool = True,
        max_queued: int = 100_000,
        extra_config: str = "",
    ) -> None:
        binary = shutil.which("mosquitto") or (
            "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
        )
        if binary is None:
            raise TransportError("mosquitto is not installed (Debian: apt-get install mosquitto)")
        self.binary = binary
        self.port = free_port()
        self.workdir = workdir
        self.config = workdir / "mosquitto.conf"
        self.config.write_text(
            f"listener {self.port} 127.0.0.1\n"
            "allow_anonymous true\n"
            "set_tcp_nodelay true\n"
            + (
                f"persistence true\npersistence_location {workdir}/\n"
                if persistence
                else "persistence false\n"
            )
            + f"max_queued_messages {max_queued}\n"
            f"log_dest file {workdir}/mosquitto.log\n"
            # As root, Mosquitto drops to its own user and then cannot write its
            # persistence file here, so a restart would lose queued sessions.
             + ("user root\n" if os.geteuid() == 0 else "") + extra_config
        )
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self, timeout: float = 10.0) -> None:
        self.process = subprocess.Popen(
            [self.binary, "-c", str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while not _answers("127.0.0.1", self.port):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise TransportError(f"mosquitto did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> MosquittoProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmbeddedBroker:
    """amqtt in a background thread: ``with EmbeddedBroker() as broker: broker.url``."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: Any = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        # amqtt logs every refused v5 CONNECT (our protocol probe) as an error, and
        # its state machine library logs each session transition at INFO.
        logging.getLogger("amqtt").setLevel(logging.CRITICAL)
        logging.getLogger("transitions").setLevel(logging.WARNING)

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> EmbeddedBroker:
        """Start the broker; returns once it accepts connections."""
        self._thread = threading.Thread(target=self._run, name="embedded-broker", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise TransportError(f"embedded MQTT broker did not start within {timeout:.0f}s")
        if self._error is not None:
            raise TransportError(
                f"embedded MQTT broker failed to start on {self.host}:{self.port}: {self._error}"
            ) from self._error
        log.info("embedded MQTT broker listening on %s", self.url)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the broker and its thread."""
        loop, broker = self._loop, self._broker
        if loop is None or broker is None or not loop.is_running():
            return
        future = asyncio.run_coroutine_threadsafe(broker.shutdown(), loop)
        try:
            future.result(timeout)
        except Exception:  # a broker already half-down still has to release its thread
            log.warning("embedded MQTT broker did not shut down cleanly", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            # The $SYS and packet-logging plugins only add noise and CPU for our use.
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
            },
        }
        try:
            self._broker = _closing_broker()(config, loop=loop)
            loop.run_until_complete(self._broker.start())
        except BaseException as exc:  # reported to start() in the caller's thread
            self._error = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            _close_leftovers(loop)
            loop.close()


def _closing_broker() -> type[Any]:
    """amqtt's broker, closing each connection when its handler ends.

    amqtt leaves the connection open when it ends before a valid CONNECT (a port
    probe, a refused protocol version); its writer, garbage-collected later, warns
    ("unclosed StreamWriter", or "loop is closed" once the broker has stopped) in
    whatever code runs then. Imported here: only the embedded mode needs amqtt.
    """
    from amqtt.broker import Broker

    class ClosingBroker(Broker):
        async def stream_connected(
            self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, listener_name: str
        ) -> None:
            try:
                await super().stream_connected(reader, writer, listener_name)
            finally:
                if not writer.is_closing():
                    writer.close()

    return ClosingBroker


def _close_leftovers(loop: asyncio.AbstractEventLoop) -> None:
    """Before the broker's loop closes: end its tasks and close the connections still
    open (clients that never disconnected), so none is left for the garbage collector."""
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    # A selector loop's transports by file descriptor (CPython's; absent elsewhere).
    for transport in list(getattr(loop, "_transports", {}).values()):
        if transport is not None and not transport.is_closing():
            transport.close()
    loop.run_until_complete(asyncio.sleep(0))  # let the close callbacks run
