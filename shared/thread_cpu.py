"""CPU time of each thread of this process, for ``/metrics``: which part of a service is busy.

``edgeloop_thread_cpu_seconds_total{thread=...}`` has one series per live Python
thread, by its name (threads of one name add up), and one named ``other`` for the
rest of the process's CPU: threads outside Python (ONNX Runtime's and OpenCV's
pools, the CUDA driver's) and threads that have ended. The series add up to the
process's CPU time.

Each thread's time is read by its kernel id from ``/proc/self/task/{id}/schedstat``
(nanoseconds on the CPU; ``stat``'s clock ticks where that file is missing), never
through a thread handle: a handle of a thread that ended meanwhile is undefined
behaviour to use, a task id that ended is only a missing file. Without ``/proc``
(not Linux) only ``other`` is exported.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = ["METRIC", "OTHER", "ThreadCpuCollector", "scraped_thread_seconds", "thread_cpu_seconds"]

OTHER = "other"
METRIC = "edgeloop_thread_cpu_seconds"
_HELP = (
    "CPU time of this process's threads by name; 'other': threads outside Python"
    " (ONNX Runtime, OpenCV) and ended threads"
)
_TASKS = "/proc/self/task"
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _task_seconds(task: int) -> float | None:
    """CPU seconds of kernel task ``task`` of this process; None once it has ended."""
    try:
        with open(f"{_TASKS}/{task}/schedstat", "rb") as schedstat:
            return int(schedstat.read().split(maxsplit=1)[0]) / 1e9
    except FileNotFoundError:
        if not os.path.isdir(f"{_TASKS}/{task}"):
            return None  # ended
    except (OSError, ValueError, IndexError):
        pass
    try:  # a kernel without schedstat: user and system clock ticks
        with open(f"{_TASKS}/{task}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * _TICK_S
    except (OSError, ValueError, IndexError):
        return None


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds by thread name, and ``other`` for the rest of the process."""
    by_name: dict[str, float] = {}
    if os.path.isdir(_TASKS):
        for thread in threading.enumerate():
            task = thread.native_id
            seconds = _task_seconds(task) if task is not None else None
            if seconds is not None:
                by_name[thread.name] = by_name.get(thread.name, 0.0) + seconds
    # The process's clock is read last, so it never reads less than its threads'.
    rest = time.process_time() - sum(by_name.values())
    by_name[OTHER] = by_name.get(OTHER, 0.0) + max(rest, 0.0)
    return by_name


class ThreadCpuCollector(Collector):
    """Exports :func:`thread_cpu_seconds` at each scrape."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(METRIC, _HELP, labels=["thread"])
        for name, seconds in sorted(thread_cpu_seconds().items()):
            family.add_metric([name], seconds)
        yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter(())


def scraped_thread_seconds(text: str) -> dict[str, float]:
    """CPU seconds by thread name from a ``/metrics`` page (Prometheus text); empty when
    the page has none (a service from before this metric)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        sample.labels["thread"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == METRIC
        for sample in family.samples
        if sample.name == f"{METRIC}_total"
    }
