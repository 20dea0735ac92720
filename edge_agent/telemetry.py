"""What the agent counts and reports: Prometheus metrics, latency window, host stats.

One ``CollectorRegistry`` per agent (not the process-global one), so tests and a
process running several agents never collide. ``Telemetry.snapshot`` feeds the
heartbeat (``AgentStatus``) and ``/v1/status``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.imdecode import DecodeFallbackCollector
from shared.thread_cpu import ThreadCpuCollector

__all__ = ["Telemetry", "gpu_stats"]

log = logging.getLogger(__name__)


class Telemetry:
    """Counters and gauges of one agent, plus a sliding latency window."""

    def __init__(self, window: int = 2048, clock: Any = time.monotonic) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(ThreadCpuCollector())
        r.register(DecodeFallbackCollector())
        self.frames = Counter("edgeloop_agent_frames", "Frames answered", ["source"], registry=r)
        self.forwarded = Counter(
            "edgeloop_agent_forwarded", "Frames forwarded to the cloud", ["reason"], registry=r
        )
        self.over_budget = Counter(
            "edgeloop_agent_over_budget", "Frames routed but not forwarded: over budget", registry=r
        )
        self.dropped = Counter(
            "edgeloop_agent_dropped_frames",
            "Frames a source dropped (newest kept)",
            ["source"],
            registry=r,
        )
        self.bad_input = Counter(
            "edgeloop_agent_bad_input", "Frames refused", ["source", "reason"], registry=r
        )
        self.malformed = Counter(
            "edgeloop_agent_malformed_messages",
            "Incoming MQTT messages refused",
            ["kind", "reason"],
            registry=r,
        )
        self.receipted = Counter("edgeloop_agent_receipted", "Samples receipted", registry=r)
        self.verdicts = Counter(
            "edgeloop_agent_verdicts", "Verdicts received", ["agrees"], registry=r
        )
        self.latency = Histogram(
            "edgeloop_agent_latency_seconds",
            "Frame latency from submit to answer",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
            registry=r,
        )
        self.batch_size = Histogram(
            "edgeloop_agent_batch_size",
            "Frames per inference batch",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.webhook = Counter(
            "edgeloop_agent_webhook_verdicts",
            "Verdicts for the webhook: delivered, retried (each retry), failed, dropped",
            ["outcome"],
            registry=r,
        )
        self.webhook_pending = Gauge(
            "edgeloop_agent_webhook_pending", "Verdicts waiting for the webhook", registry=r
        )
        self.spool_depth = Gauge("edgeloop_agent_spool_depth", "Samples in the spool", registry=r)
        self.spool_bytes = Gauge("edgeloop_agent_spool_bytes", "Bytes in the spool", registry=r)
        self.evicted = Gauge(
            "edgeloop_agent_spool_evicted", "Samples evicted from the spool", ["kind"], registry=r
        )
        self.connected = Gauge(
            "edgeloop_agent_connected", "1 when the broker link is up", registry=r
        )
        self.source_up = Gauge(
            "edgeloop_agent_source_up",
            "1 when a source is delivering frames",
            ["source"],
            registry=r,
        )
        self._clock = clock
        self._lock = threading.Lock()  # guards the windows below
        self._latencies: collections.deque[float] = collections.deque(maxlen=window)
        self._events: collections.deque[tuple[float, bool]] = collections.deque(maxlen=window)
        self.agreements = 0
        self.verdict_count = 0
        self.frames_total = 0
        self.forwarded_total = 0
        self.dropped_total = 0
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # the first call only primes the counter
        # Labelled children by label value: ``labels()`` takes a lock and builds a key
        # on every call, and the answer path counts thousands of frames a second.
        self._frames_by_source: dict[str, Any] = {}
        self._forwarded_by_reason: dict[str, Any] = {}

    def record_frame(
        self, source: str, latency_s: float, forwarded: bool, reason: str | None
    ) -> None:
        self.record_frames([(source, latency_s, forwarded, reason)])

    def record_frames(self, answers: Iterable[tuple[str, float, bool, str | None]]) -> None:
        """Count answered frames, each as (source, latency seconds, forwarded, route reason)."""
        now = self._clock()
        per_source: dict[str, int] = {}
        per_reason: dict[str, int] = {}
        latencies: list[float] = []
        events: list[tuple[float, bool]] = []
        forwarded_count = 0
        observe = self.latency.observe
        for source, latency_s, forwarded, reason in answers:
            per_source[source] = per_source.get(source, 0) + 1
            if forwarded and reason:
                per_reason[reason] = per_reason.get(reason, 0) + 1
            forwarded_count += forwarded
            observe(latency_s)
            latencies.append(latency_s)
            events.append((now, forwarded))
        for source, count in per_source.items():
            self._child(self.frames, self._frames_by_source, source).inc(count)
        for reason, count in per_reason.items():
            self._child(self.forwarded, self._forwarded_by_reason, reason).inc(count)
        with self._lock:
            self._latencies.extend(latencies)
            self._events.extend(events)
            self.frames_total += len(latencies)
            self.forwarded_total += forwarded_count

    @staticmethod
    def _child(metric: Counter, cache: dict[str, Any], label: str) -> Any:
        child = cache.get(label)
        if child is None:
            child = cache[label] = metric.labels(label)
        return child

    def record_dropped(self, source: str, count: int = 1) -> None:
        self.dropped.labels(source).inc(count)
        with self._lock:
            self.dropped_total += count

    def record_verdict(self, agrees: bool) -> None:
        self.verdicts.labels(str(agrees).lower()).inc()
        with self._lock:
            self.verdict_count += 1
            self.agreements += int(agrees)

    @property
    def agreement_rate(self) -> float | None:
        with self._lock:
            return self.agreements / self.verdict_count if self.verdict_count else None

    def snapshot(self) -> dict[str, Any]:
        """Rates and percentiles over the recent window, and host stats."""
        with self._lock:
            latencies = np.array(self._latencies, dtype=np.float64)
            events = list(self._events)
        now = self._clock()
        recent = [e for e in events if e[0] >= now - 60.0]
        fps = 0.0
        if len(recent) >= 2:
            span = max(1e-6, now - recent[0][0])
            fps = len(recent) / span
        forward_rate = (sum(f for _, f in recent) / len(recent)) if recent else None
        memory_mb = self._process.memory_info().rss / 2**20
        return {
            "frames_per_s": round(fps, 3),
            "latency_p50_ms": float(np.percentile(latencies, 50) * 1e3) if latencies.size else None,
            "latency_p99_ms": float(np.percentile(latencies, 99) * 1e3) if latencies.size else None,
            "forward_rate": forward_rate,
            "cpu_percent": self._process.cpu_percent(None),
            "memory_mb": round(memory_mb, 1),
            "agreement_rate": self.agreement_rate,
            "frames_total": self.frames_total,
            "forwarded_total": self.forwarded_total,
            "dropped_frames": self.dropped_total,
            "gpu": gpu_stats(),
        }


_NVML: Any = None
_NVML_TRIED = False


def gpu_stats() -> dict[str, float] | None:
    """GPU utilisation and memory through NVML when pynvml is importable, else None."""
    global _NVML, _NVML_TRIED
    if not _NVML_TRIED:
        _NVML_TRIED = True
        try:
            import pynvml

            pynvml.nvmlInit()
            _NVML = pynvml
        except Exception:  # no library, no driver, no GPU: all mean "no GPU stats"
            _NVML = None
    if _NVML is None:
        return None
    try:
        handle = _NVML.nvmlDeviceGetHandleByIndex(0)
        util = _NVML.nvmlDeviceGetUtilizationRates(handle)
        mem = _NVML.nvmlDeviceGetMemoryInfo(handle)
        return {"util_percent": float(util.gpu), "memory_mb": mem.used / 2**20}
    except Exception:
        log.debug("NVML query failed", exc_info=True)
        return None
