"""Prometheus metrics of the cloud processes: one registry per process object, no globals."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.imdecode import DecodeFallbackCollector
from shared.thread_cpu import ThreadCpuCollector

__all__ = ["DISTILL_QUEUE_GAUGES", "CloudMetrics"]

log = logging.getLogger(__name__)

# Figures of the distillation queue, read from the database at scrape time.
DISTILL_QUEUE_GAUGES = {
    "queued": ("edgeloop_distill_jobs_queued", "Distillation jobs waiting for a worker"),
    "running": ("edgeloop_distill_jobs_running", "Distillation jobs running"),
    "live_workers": (
        "edgeloop_distill_workers_live",
        "Distill workers whose registration beat is current",
    ),
    "waiting_without_worker": (
        "edgeloop_distill_jobs_waiting_without_worker",
        "Queued distillation jobs while no distill worker is live (nothing will run them)",
    ),
    "oldest_queued_s": (
        "edgeloop_distill_oldest_queued_seconds",
        "Age of the oldest queued distillation job (0 when none)",
    ),
}


class _DistillQueueCollector(Collector):
    """Asks its source for the queue's figures at each scrape; nothing while it has none."""

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, float]] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.source is None:
            return
        try:
            figures = self.source()
        except Exception as exc:  # a scrape must not fail with the database away
            log.warning("distill queue figures unavailable: %s", exc)
            return
        for key, (name, doc) in DISTILL_QUEUE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(figures.get(key) or 0.0))

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class CloudMetrics:
    """Every metric the verifier and the API export, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        r.register(ThreadCpuCollector())
        r.register(DecodeFallbackCollector())
        self.ingested = Counter(
            "edgeloop_ingest_samples", "Samples stored (new ones)", ["fleet"], registry=r
        )
        self.duplicates = Counter(
            "edgeloop_ingest_duplicates", "Samples received again and already stored", registry=r
        )
        self.images_discarded = Counter(
            "edgeloop_ingest_images_discarded",
            "Images of samples not stored (a redelivered sample's second copy), deleted",
            registry=r,
        )
        self.abandoned_batches = Counter(
            "edgeloop_blob_abandoned_batches",
            "Image batches a dead verifier process wrote but never settled, swept",
            registry=r,
        )
        self.forwarded = Counter(
            "edgeloop_agent_forwarded_samples",
            "Samples received per agent (its forward rate)",
            ["fleet", "agent"],
            registry=r,
        )
        self.dead_letters = Counter(
            "edgeloop_dead_letters", "Messages refused at ingest", ["reason"], registry=r
        )
        self.receipts = Counter(
            "edgeloop_receipt_ids", "Sample ids acknowledged to agents", registry=r
        )
        self.store_errors = Counter(
            "edgeloop_store_errors", "Failed database or blob writes (retried)", registry=r
        )
        self.queue_depth = Gauge(
            "edgeloop_verifier_queue_depth", "Samples waiting for the teacher", registry=r
        )
        self.queue_delay = Histogram(
            "edgeloop_verifier_queue_delay_seconds",
            "Time a sample waited in the batcher",
            buckets=_SECONDS,
            registry=r,
        )
        self.batch_size = Histogram(
            "edgeloop_verifier_batch_size",
            "Teacher batch sizes",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.compute = Histogram(
            "edgeloop_verifier_compute_seconds",
            "Teacher time per batch",
            buckets=_SECONDS,
            registry=r,
        )
        self.capture_to_verdict = Histogram(
            "edgeloop_capture_to_verdict_seconds",
            "From the edge's capture time to the stored verdict",
            buckets=_SECONDS,
            registry=r,
        )
        self.verdicts = Counter(
            "edgeloop_verdicts", "Verdicts stored", ["agrees", "review"], registry=r
        )
        self.agreement = Gauge(
            "edgeloop_agreement_rate",
            "Share of verdicts agreeing with the edge (since start)",
            registry=r,
        )
        self.http_requests = Counter(
            "edgeloop_http_requests", "HTTP requests", ["method", "route", "status"], registry=r
        )
        self.rate_limited = Counter(
            "edgeloop_http_rate_limited", "Requests refused with 429", ["group"], registry=r
        )
        self.isolated_agents = Gauge(
            "edgeloop_isolated_agents", "Agents isolated by the malformed-data breaker", registry=r
        )
        self.isolations = Counter(
            "edgeloop_agent_isolations",
            "Times an agent's breaker opened",
            ["fleet", "agent"],
            registry=r,
        )
        self.shed = Counter(
            "edgeloop_verifier_shed",
            "Samples stored but left pending under overload (verified later)",
            ["priority"],
            registry=r,
        )
        # The verifier's inbox: what it holds between the broker and its store.
        self.inbox_messages = Gauge(
            "edgeloop_verifier_inbox_messages",
            "Messages held between the broker and the store",
            registry=r,
        )
        self.inbox_bytes = Gauge(
            "edgeloop_verifier_inbox_bytes",
            "Payload bytes held between the broker and the store",
            registry=r,
        )
        self.inbox_dropped = Counter(
            "edgeloop_verifier_inbox_dropped",
            "Messages dropped at the inbox (QoS 0 while it was full)",
            ["reason"],
            registry=r,
        )
        self.inbox_waits = Counter(
            "edgeloop_verifier_inbox_waits",
            "Times the MQTT thread waited for room in a full inbox (back-pressure)",
            registry=r,
        )
        self._distill_queue = _DistillQueueCollector()
        r.register(self._distill_queue)
        self._agreed = 0
        self._verified = 0

    def watch_distill_queue(self, source: Callable[[], Mapping[str, float]]) -> None:
        """Export the distillation queue's figures (``DISTILL_QUEUE_GAUGES``) from
        ``source``, called at each scrape."""
        self._distill_queue.source = source

    def observe_verdicts(self, agreed: int, total: int) -> None:
        self._agreed += agreed
        self._verified += total
        if self._verified:
            self.agreement.set(self._agreed / self._verified)

    def render(self) -> bytes:
        return generate_latest(self.registry)
