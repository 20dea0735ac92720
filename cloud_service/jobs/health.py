"""The distill worker's probes: ``/healthz`` (alive) and ``/readyz`` (ready), over HTTP.

A small threaded server from the standard library: the worker serves nothing else,
so a web framework would only add start-up time and memory.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["HealthServer"]

Probe = Callable[[], tuple[bool, bool, str]]


class HealthServer:
    """Serves ``probe()`` (alive, ready, why) on ``host:port`` in a daemon thread."""

    def __init__(self, probe: Probe, host: str = "0.0.0.0", port: int = 8082) -> None:
        self.probe = probe

        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                alive, ready, why = outer.probe()
                ok = {"/healthz": alive, "/readyz": ready}.get(self.path.split("?", 1)[0])
                if ok is None:
                    self._answer(404, {"detail": "probes: /healthz, /readyz"})
                    return
                self._answer(200 if ok else 503, {"ok": ok, "detail": why})

            def _answer(self, code: int, body: dict[str, object]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass  # probes every few seconds would flood the log

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="health", daemon=True
        )

    def __enter__(self) -> HealthServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
