"""A monotonic clock that a test moves, for code that takes ``clock=`` (batchers)."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["FakeClock"]

SAFETY_NET_S = 60.0
"""How long a wait on the clock's readers may take before the test gives up."""


class FakeClock:
    """Seconds that pass only when the test calls ``advance`` (or ``step`` per read).

    Every read is counted, with the name of the thread that made it, so a test can
    wait until the code under test has looked at the time (``wait_for``) instead of
    sleeping and hoping it has.
    """

    def __init__(self, start: float = 0.0, *, step: float = 0.0) -> None:
        self.now = start
        self.step = step
        self.reads = 0
        self.readers: set[str] = set()
        self._changed = threading.Condition()

    def __call__(self) -> float:
        with self._changed:
            now = self.now
            self.now += self.step
            self.reads += 1
            self.readers.add(threading.current_thread().name)
            self._changed.notify_all()
            return now

    def advance(self, seconds: float) -> None:
        with self._changed:
            self.now += seconds
            self._changed.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float = SAFETY_NET_S) -> bool:
        """Until ``predicate`` holds, checked at each read (``timeout`` is a safety net)."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    def wait_for_reads(self, count: int, timeout: float = SAFETY_NET_S) -> bool:
        """Until the clock has been read ``count`` times in all."""
        return self.wait_for(lambda: self.reads >= count, timeout)
