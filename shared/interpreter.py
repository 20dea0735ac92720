"""CPython's thread switch interval, set for as long as a service runs.

The agent and the verifier each run threads that give the interpreter lock up for a
moment (a socket call, an image decode, an ONNX Runtime run, a SQLite statement)
and must win it back from threads running Python. CPython makes such a thread wait
up to its switch interval, 5 ms by default, before it asks for the lock.
"""

from __future__ import annotations

import sys

__all__ = ["SwitchInterval"]


class SwitchInterval:
    """``apply()`` sets the interval to ``ms`` (0: leave it); ``restore()`` puts the
    process's own back. Also a context manager. Applying twice keeps the first saved."""

    def __init__(self, ms: float) -> None:
        self.ms = ms
        self._saved: float | None = None

    def apply(self) -> None:
        if self.ms and self._saved is None:
            self._saved = sys.getswitchinterval()
            sys.setswitchinterval(self.ms / 1000)

    def restore(self) -> None:
        if self._saved is not None:
            sys.setswitchinterval(self._saved)
            self._saved = None

    def __enter__(self) -> SwitchInterval:
        self.apply()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
