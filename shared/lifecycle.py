"""One lifecycle for every long-running part: start, stop, named threads, health.

Each process part (the agent's intake and uplink pump, the verifier's transport and
recovery, the announcer, the job worker, the scheduler) owns a :class:`Workers`
set. A worker is a named thread; it runs either a loop body every ``every``
seconds until stop, or a function that watches :attr:`Workers.stopping` itself.
Stopping sets one event, wakes every sleeper at once, and joins each thread
within a shared deadline; a thread still alive after it is named in the log and
in :meth:`Workers.health`, never silently leaked. ``docs/architecture.md``
("Layers") places this in the runtime layer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = ["Lifecycle", "WorkerHealth", "Workers"]

log = logging.getLogger(__name__)


@runtime_checkable
class Lifecycle(Protocol):
    """What every long-running part offers its owner."""

    def start(self) -> object: ...

    def stop(self) -> None: ...

    def health(self) -> dict[str, object]: ...


@dataclass
class WorkerHealth:
    """One worker's state, as :meth:`Workers.health` reports it."""

    alive: bool
    iterations: int = 0
    errors: int = 0
    last_error: str | None = None


@dataclass
class _Worker:
    name: str
    thread: threading.Thread
    health: WorkerHealth = field(default_factory=lambda: WorkerHealth(alive=True))


class Workers:
    """Named threads that start together, stop together and report their health.

    ``spawn(name, body, every=s)`` calls ``body()`` every ``s`` seconds until stop (an
    exception is logged and counted, the loop goes on); ``spawn(name, run)`` calls
    ``run()`` once, and ``run`` returns when :attr:`stopping` is set. Threads are
    daemons so a crashed owner cannot hang interpreter exit, but :meth:`stop` joins
    them: a clean stop leaves no thread behind.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.stopping = threading.Event()
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()

    def spawn(
        self,
        name: str,
        body: Callable[[], object],
        *,
        every: float | None = None,
        wait_first: bool = False,
    ) -> threading.Thread:
        """Start ``body`` on a thread named ``{owner}-{name}`` (with ``every``: the first
        call after one interval when ``wait_first``, else at once)."""
        if self.stopping.is_set():
            raise RuntimeError(f"{self.owner}: cannot start {name!r} while stopping")
        health = WorkerHealth(alive=True)
        target = (
            self._loop(body, every, health, wait_first)
            if every is not None
            else self._once(body, health)
        )
        thread = threading.Thread(target=target, name=f"{self.owner}-{name}", daemon=True)
        with self._lock:
            self._workers.append(_Worker(name, thread, health))
        thread.start()
        return thread

    def _once(self, run: Callable[[], object], health: WorkerHealth) -> Callable[[], None]:
        def target() -> None:
            try:
                run()
                health.iterations += 1
            except Exception as exc:  # the owner's health shows it; the process goes on
                health.errors += 1
                health.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("%s: worker failed", threading.current_thread().name)
            finally:
                health.alive = False

        return target

    def _loop(
        self, body: Callable[[], object], every: float, health: WorkerHealth, wait_first: bool
    ) -> Callable[[], None]:
        def target() -> None:
            try:
                if wait_first and self.stopping.wait(every):
                    return
                while not self.stopping.is_set():
                    try:
                        body()
                        health.iterations += 1
                    except Exception as exc:
                        health.errors += 1
                        health.last_error = f"{type(exc).__name__}: {exc}"
                        log.exception("%s: iteration failed", threading.current_thread().name)
                    if self.stopping.wait(every):
                        break
            finally:
                health.alive = False

        return target

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True when stopping (a loop's exit test)."""
        return self.stopping.wait(seconds)

    def stop(self, timeout: float = 5.0) -> list[str]:
        """Signal stop and join every thread within ``timeout`` in all; returns the names left."""
        self.stopping.set()
        deadline = time.monotonic() + timeout
        with self._lock:
            workers = list(self._workers)
        left: list[str] = []
        for worker in workers:
            if worker.thread is threading.current_thread():
                continue
            worker.thread.join(max(0.0, deadline - time.monotonic()))
            if worker.thread.is_alive():
                left.append(worker.thread.name)
        if left:
            log.warning("%s: threads still running after %.1f s: %s", self.owner, timeout, left)
        return left

    def health(self) -> dict[str, WorkerHealth]:
        """Each worker's state by name."""
        with self._lock:
            return {w.name: w.health for w in self._workers}

    @property
    def alive(self) -> bool:
        """True while every worker is running (a stopped set is not alive)."""
        with self._lock:
            return not self.stopping.is_set() and all(w.thread.is_alive() for w in self._workers)
