"""An embedded MQTT broker for demos, first tries and tests on a laptop.

Production points at Mosquitto or an EMQX/HiveMQ cluster by URL. The embedded
broker is amqtt (pure Python, MQTT 3.1.1) running on its own event loop in a
daemon thread, bound to loopback on a free port, so nothing has to be installed
by hand. It speaks 3.1.1 only: clients fall back from MQTT v5 automatically
(see ``shared.mqtt``), and ``$share`` subscriptions are not available on it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from types import TracebackType
from typing import Any

from shared.errors import TransportError

__all__ = ["EmbeddedBroker", "free_port"]

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
        from amqtt.broker import Broker  # imported here: only the embedded mode needs it

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
            self._broker = Broker(config, loop=loop)
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
            loop.close()
