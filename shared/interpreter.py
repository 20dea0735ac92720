"""Process-wide settings a service holds while it runs, given back when it stops.

``ProcessSetting`` saves the process's own value, sets the service's, and puts the
saved one back. Three are in use:

- ``switch_interval``: CPython's thread switch interval. The agent and the verifier
  each run threads that give the interpreter lock up for a moment (a socket call, an
  image decode, an ONNX Runtime run, a SQLite statement) and must win it back from
  threads running Python. CPython makes such a thread wait up to its switch
  interval, 5 ms by default, before it asks for the lock.
- ``young_collections``: how often CPython's cyclic garbage collector runs. It
  collects its youngest generation every 700 allocations of container objects by
  default, a pause of every thread, and a service's hot path allocates several
  hundred of them per sample (messages, rows, answers) while hardly any become
  cyclic garbage. Applied once the service has started, it also freezes what the
  process holds by then (modules, models, settings, pools), so the collections of
  the oldest generation no longer walk them.
- OpenCV's thread count (``edge_agent.imaging.opencv_threads``).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["ProcessSetting", "switch_interval", "young_collections"]

T = TypeVar("T")


class ProcessSetting(Generic[T]):
    """``apply()`` sets ``value`` through ``write`` (a falsy value leaves the process's
    own), saving what ``read`` gives first; ``restore()`` writes the saved value back.
    Also a context manager. Applying twice keeps the first saved."""

    def __init__(self, value: T, *, read: Callable[[], T], write: Callable[[T], object]) -> None:
        self.value = value
        self._read, self._write = read, write
        self._saved: T | None = None

    def apply(self) -> None:
        if self.value and self._saved is None:
            self._saved = self._read()
            self._write(self.value)

    def restore(self) -> None:
        if self._saved is not None:
            self._write(self._saved)
            self._saved = None

    def __enter__(self) -> ProcessSetting[T]:
        self.apply()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def switch_interval(ms: float) -> ProcessSetting[float]:
    """CPython's switch interval at ``ms`` milliseconds while applied (0: left alone)."""
    return ProcessSetting(ms / 1000, read=sys.getswitchinterval, write=sys.setswitchinterval)


def young_collections(every: int) -> ProcessSetting[int]:
    """CPython's youngest generation collected every ``every`` allocations while applied
    (0: left alone); applying freezes the objects the process holds, restoring thaws them."""
    frozen = False

    def write(threshold: int) -> None:
        nonlocal frozen  # ProcessSetting writes the new value, then the saved one back
        if frozen:
            gc.unfreeze()
        else:
            gc.freeze()
        frozen = not frozen
        _, middle, oldest = gc.get_threshold()
        gc.set_threshold(threshold, middle, oldest)

    return ProcessSetting(every, read=lambda: gc.get_threshold()[0], write=write)
