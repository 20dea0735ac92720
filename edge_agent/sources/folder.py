"""A watched folder: each new JPEG/PNG is answered, then moved with its result.

Polling (not inotify) so it works the same on every filesystem a device mounts,
including network shares. A file is taken once its size has stopped changing
between two polls, so a half-copied file is not read. Answered files go to
``done/`` with a ``.json`` beside them; refused ones to ``failed/`` with the reason.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from edge_agent.intake import FrameSink
from edge_agent.settings import FolderSource
from shared.errors import EdgeLoopError
from shared.lifecycle import Workers

__all__ = ["FolderWatcher"]

log = logging.getLogger(__name__)
_SUFFIXES = {".jpg", ".jpeg", ".png"}


class FolderWatcher:
    """Polls one folder in its own thread."""

    def __init__(self, config: FolderSource, agent: FrameSink) -> None:
        self.config = config
        self.agent = agent
        self.name = config.name
        self.path = config.path
        self.done_dir = config.done_dir or self.path / "done"
        self.failed_dir = self.path / "failed"
        self._sizes: dict[Path, int] = {}
        self._workers = Workers("folder")
        self._stopping = self._workers.stopping
        self.state = "starting"
        self.answered = 0
        self.refused = 0
        self.last_error: str | None = None

    def start(self) -> FolderWatcher:
        self._workers.spawn(self.name, self._run)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._workers.stop(timeout)
        self.state = "stopped"

    def health(self) -> dict[str, object]:
        """The polling thread's state."""
        return dict(self._workers.health())

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": "folder",
            "path": str(self.path),
            "state": self.state,
            "answered": self.answered,
            "refused": self.refused,
            "last_error": self.last_error,
        }

    def ready_files(self) -> list[Path]:
        """Image files whose size did not change since the previous poll."""
        try:
            entries = [
                p for p in self.path.iterdir() if p.is_file() and p.suffix.lower() in _SUFFIXES
            ]
        except OSError as exc:
            self.state = "unavailable"
            self.last_error = str(exc)
            return []
        self.state = "running"
        ready = []
        sizes = {}
        for path in sorted(entries, key=lambda p: p.stat().st_mtime):
            size = path.stat().st_size
            sizes[path] = size
            if self._sizes.get(path) == size:
                ready.append(path)
        self._sizes = sizes
        return ready

    def _run(self) -> None:
        period = 1.0 / self.config.max_fps
        while not self._stopping.is_set():
            for path in self.ready_files():
                if self._stopping.is_set():
                    break
                started = time.monotonic()
                self._handle(path)
                self._stopping.wait(max(0.0, period - (time.monotonic() - started)))
            self._stopping.wait(self.config.poll_s)

    def _handle(self, path: Path) -> None:
        try:
            body = path.read_bytes()
            result = self.agent.process_upload(body, source=self.name)
        except EdgeLoopError as exc:
            self.refused += 1
            self.last_error = f"{path.name}: {exc}"
            self.agent.telemetry.bad_input.labels(self.name, exc.reason).inc()
            self._move(path, self.failed_dir, {"error": str(exc), "reason": exc.reason})
            return
        except (OSError, TimeoutError) as exc:
            self.last_error = f"{path.name}: {exc}"
            log.warning("folder %s: %s", self.name, self.last_error)
            return
        self.answered += 1
        self._move(path, self.done_dir, result.as_dict())

    def _move(self, path: Path, target: Path, info: dict[str, Any]) -> None:
        try:
            target.mkdir(parents=True, exist_ok=True)
            shutil.move(str(path), target / path.name)
            (target / (path.name + ".json")).write_text(json.dumps(info, indent=2))
        except OSError as exc:
            self.last_error = f"cannot move {path.name}: {exc}"
            log.warning("folder %s: %s", self.name, self.last_error)
        self._sizes.pop(path, None)
