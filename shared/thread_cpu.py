"""CPU time of each thread of this process, for ``/metrics``: which part of a service is busy.

``edgeloop_thread_cpu_seconds_total{thread=...}`` has one series per live Python
thread, by its name (threads of one name add up), and one named ``other`` for the
rest of the process's CPU: threads outside Python (ONNX Runtime's and OpenCV's
pools, the CUDA driver's) and threads that have ended. The series add up to the
process's CPU time. Where per-thread clocks are missing (not POSIX) only ``other``
is exported.

Each thread's clock is its own POSIX CPU clock (``pthread_getcpuclockid``): exact to
the nanosecond, read without a system-wide lock, about a microsecond per thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = ["OTHER", "ThreadCpuCollector", "thread_cpu_seconds"]

OTHER = "other"
_HELP = (
    "CPU time of this process's threads by name; 'other': threads outside Python"
    " (ONNX Runtime, OpenCV) and ended threads"
)
_thread_clock: Callable[[int], int] | None = getattr(time, "pthread_getcpuclockid", None)


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds by thread name, and ``other`` for the rest of the process."""
    by_name: dict[str, float] = {}
    if _thread_clock is not None:
        for thread in threading.enumerate():
            ident = thread.ident
            if ident is None:
                continue  # not started yet
            try:
                seconds = time.clock_gettime(_thread_clock(ident))
            except OSError:  # ended between enumerate() and here
                continue
            by_name[thread.name] = by_name.get(thread.name, 0.0) + seconds
    # The process's clock is read last, so it never reads less than its threads'.
    rest = time.process_time() - sum(by_name.values())
    by_name[OTHER] = by_name.get(OTHER, 0.0) + max(rest, 0.0)
    return by_name


class ThreadCpuCollector(Collector):
    """Exports :func:`thread_cpu_seconds` at each scrape."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("edgeloop_thread_cpu_seconds", _HELP, labels=["thread"])
        for name, seconds in sorted(thread_cpu_seconds().items()):
            family.add_metric([name], seconds)
        yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter(())
