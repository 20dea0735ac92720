"""Helpers every benchmark shares: repeated timing with medians, machine facts."""

from __future__ import annotations

import os
import platform
import statistics
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shared.thread_cpu import METRIC as THREAD_CPU


def median_seconds(fn: Callable[[], object], *, repeats: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def ready(port: int) -> bool:
    """Whether the service on a local ``port`` answers ``/readyz`` with 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def cpu_model() -> str:
    """The CPU as results are grouped by: its name, family and model, and its widest
    vector instructions (hosts sold under one name differ in those, and in speed)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown"
    if "cpu family" not in fields:
        return name
    flags = set(fields.get("flags", "").split())
    isa = [
        label
        for label, flag in (("AMX", "amx_tile"), ("AVX-512 VNNI", "avx512_vnni"))
        if flag in flags
    ]
    if not isa:
        isa = ["AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE"]
    family, model = fields["cpu family"], fields.get("model", "?")
    return f"{name} (family {family}, model {model}; {', '.join(isa)})"


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    import numpy
    import onnxruntime

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": numpy.__version__,
        "onnxruntime": onnxruntime.__version__,
        "ort_providers": onnxruntime.get_available_providers(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.is_available()
    except ImportError:
        info["torch"] = None
    return info


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-flavoured markdown table."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Scrape:
    """What services' ``/metrics`` say so far: CPU seconds by thread name
    (``edgeloop_thread_cpu_seconds``; empty for a checkout without it), and an agent's
    inference batches (the frames in them, and how many)."""

    threads: dict[str, float] = field(default_factory=dict)
    batch_frames: float = 0.0
    batches: float = 0.0

    def since(self, before: Scrape) -> Scrape:
        """What happened between ``before`` and this scrape."""
        return Scrape(
            {t: max(v - before.threads.get(t, 0.0), 0.0) for t, v in self.threads.items()},
            self.batch_frames - before.batch_frames,
            self.batches - before.batches,
        )


def scrape(urls: list[str]) -> Scrape:
    """The processes whose ``/metrics`` are ``urls``, added up (threads by name)."""
    threads: dict[str, float] = {}
    batch_frames = batches = 0.0
    with httpx.Client(timeout=10.0) as http:
        for url in urls:
            for family in text_string_to_metric_families(http.get(url).text):
                for sample in family.samples:
                    if sample.name == f"{THREAD_CPU}_total":
                        name = sample.labels["thread"]
                        threads[name] = threads.get(name, 0.0) + sample.value
                    elif sample.name == "edgeloop_agent_batch_size_sum":
                        batch_frames += sample.value
                    elif sample.name == "edgeloop_agent_batch_size_count":
                        batches += sample.value
    return Scrape(threads, batch_frames, batches)


def by_stage(seconds: dict[str, float]) -> dict[str, float]:
    """Thread CPU by stage: a pool's threads (``decode_0``, ``decode_1``; ``inference-loop``,
    ``inference-loop-1``) added up under the name without its number."""
    stages: dict[str, float] = {}
    for name, value in seconds.items():
        stage = name.rstrip("0123456789").rstrip("_-")
        stages[stage] = stages.get(stage, 0.0) + value
    return stages
