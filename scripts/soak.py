"""Soak: a simulated fleet publishes samples at a steady rate for a long time.

    .venv/bin/python scripts/soak.py [--minutes 10] [--rate 50] [--agents 4] [--window-s 60]
                                       [--json]

One process, loopback only: a private Mosquitto on a free port, the real verifier
(``VerifierWorker``: ingest, teacher batching, verdicts) on SQLite in a temp dir,
and ``--agents`` simulated agents (paho clients at QoS 1, each subscribed to its own
verdicts). Per window (a minute by default) it records the process's resident memory
and the publish-to-verdict latency percentiles, and prints one line per window as it
closes. Pass: RSS growth from the first to the last window <= 10 %, the last window's
p99 within 2x the first's (or under 100 ms), nothing lost, exactly one stored verdict
per sample. Verdicts that reach an agent twice are counted and shown apart
(QoS 1 delivers at least once). The summary states each figure against its limit. The
RSS is the whole process's: the verifier plus the simulated fleet, whose per-sample
bookkeeping (the ids it sent and saw answered) grows with every sample, so the figure
is an upper bound on the verifier's own growth.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import psutil

from cloud_service.demo_teacher import build_demo_teacher
from shared.broker import MosquittoProcess
from shared.envelope import encode_envelope
from shared.messages import decode_verdicts
from shared.mqtt import MqttTarget, make_client
from shared.topics import Topics
from simulations.samples import image_bytes, sample_header
from simulations.stack import Stack


class SimFleet:
    """``agents`` publishers; verdict latency per sample id, measured on arrival."""

    def __init__(self, url: str, topics: Topics, agents: int) -> None:
        self.topics = topics
        self.sent: dict[str, float] = {}
        self.latency: list[tuple[float, float]] = []  # (arrival time, seconds)
        self.verdicts: dict[str, int] = {}
        self.lock = threading.Lock()
        target = MqttTarget.parse(url)
        self.clients = []
        for i in range(agents):
            client = make_client(target, client_id=f"soak-agent-{i}-{uuid.uuid4().hex[:6]}")
            client.on_message = self._on_message
            client.connect(target.host, target.port)
            client.loop_start()
            client.subscribe(topics.verdicts("fleet-soak", f"cam-{i}"), qos=1)
            self.clients.append(client)
        self.images = [image_bytes(seed=s) for s in range(16)]

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        verdicts = decode_verdicts(message.payload)
        now = time.monotonic()
        with self.lock:
            for verdict in verdicts:
                self.verdicts[verdict.sample_id] = self.verdicts.get(verdict.sample_id, 0) + 1
                sent = self.sent.get(verdict.sample_id)
                if sent is not None and self.verdicts[verdict.sample_id] == 1:
                    self.latency.append((now, now - sent))

    def publish(self, n: int) -> None:
        i = n % len(self.clients)
        image = self.images[n % len(self.images)]
        header = sample_header(image, fleet="fleet-soak", agent=f"cam-{i}", priority=n % 10)
        with self.lock:
            self.sent[header.sample_id] = time.monotonic()
        self.clients[i].publish(
            self.topics.samples("fleet-soak", f"cam-{i}"), encode_envelope(header, image), qos=1
        )

    def close(self) -> None:
        for client in self.clients:
            client.disconnect()
            client.loop_stop()


def run(minutes: float, rate: float, agents: int, window_s: float = 60.0) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="edgeloop-soak-"))
    stack = Stack(
        folder,
        broker=MosquittoProcess(folder, persistence=False),
        verifier="in-process",
        teacher=build_demo_teacher(folder / "teacher.onnx", size=32, classes=10),
        topic_prefix="edgeloop-soak/v1",
        cloud={
            "blob_fsync": False,
            "review_audit_share": 0.0,
            "verifier_client_id": f"soak-verifier-{uuid.uuid4().hex[:6]}",
        },
        name="soak",
    )
    me = psutil.Process()
    windows: list[dict[str, Any]] = []
    try:
        with stack:
            assert stack.broker is not None
            url, topics, worker = stack.broker.url, stack.topics, stack.worker
            fleet = SimFleet(url, topics, agents)
            start = time.monotonic()
            end = start + minutes * 60
            n = 0
            next_window = start + window_s
            window_from = start
            while True:
                target = int((min(time.monotonic(), end) - start) * rate)
                while n < target:
                    fleet.publish(n)
                    n += 1
                now = time.monotonic()
                # The run's last window closes at the end unless it is under half a window.
                closing = now >= end and now - window_from >= window_s / 2
                if now >= next_window or closing:
                    with fleet.lock:
                        lat = [s for t, s in fleet.latency if window_from <= t < now]
                        fleet.latency = [(t, s) for t, s in fleet.latency if t >= now]
                    windows.append(
                        {
                            "window": len(windows) + 1,
                            "at_s": round(now - start),
                            "rss_mb": round(me.memory_info().rss / 2**20, 1),
                            "verdicts": len(lat),
                            "p50_ms": round(float(np.percentile(lat, 50)) * 1000, 1)
                            if lat
                            else None,
                            "p99_ms": round(float(np.percentile(lat, 99)) * 1000, 1)
                            if lat
                            else None,
                        }
                    )
                    print(json.dumps(windows[-1]), file=sys.stderr, flush=True)
                    window_from, next_window = now, now + window_s
                if now >= end:
                    break
                time.sleep(0.005)
            deadline = time.monotonic() + 60  # let the tail drain
            while time.monotonic() < deadline and len(fleet.verdicts) < len(fleet.sent):
                time.sleep(0.2)
            fleet.close()
            counts = dict(worker.counts)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if not windows:
        raise SystemExit("the soak ended before its first window closed: raise --minutes")
    first, last = windows[0], windows[-1]
    growth = (last["rss_mb"] - first["rss_mb"]) / first["rss_mb"]
    lost = len(set(fleet.sent) - set(fleet.verdicts))
    duplicated = sum(1 for c in fleet.verdicts.values() if c > 1)
    p99s = [w["p99_ms"] for w in windows if w["p99_ms"] is not None]
    p99_limit = 2 * max(first["p99_ms"] or 0, 50)
    return {
        "minutes": minutes,
        "rate_per_s": rate,
        "agents": agents,
        "published": len(fleet.sent),
        "verdicts": len(fleet.verdicts),
        "lost": lost,
        "stored_verdicts": counts["verdicts"],
        "duplicate_verdicts": duplicated,
        "worker_counts": counts,
        "rss_first_mb": first["rss_mb"],
        "rss_last_mb": last["rss_mb"],
        "rss_max_mb": max(w["rss_mb"] for w in windows),
        "rss_growth": round(growth, 4),
        "p99_first_ms": first["p99_ms"],
        "p99_last_ms": last["p99_ms"],
        "p99_max_ms": max(p99s) if p99s else None,
        "p99_limit_ms": p99_limit,
        "windows": windows,
        "pass": growth <= 0.10
        and lost == 0
        and counts["verdicts"] == len(fleet.sent)
        and (last["p99_ms"] or 0) <= p99_limit,
    }


def report(result: dict[str, Any]) -> str:
    """The soak's figures as text: one row per window, then each figure against its limit."""
    lines = [f"{'window':>6} {'at_s':>6} {'rss_mb':>8} {'verdicts':>8} {'p50_ms':>8} {'p99_ms':>8}"]
    for w in result["windows"]:
        lines.append(
            f"{w['window']:>6} {w['at_s']:>6} {w['rss_mb']:>8} {w['verdicts']:>8} "
            f"{w['p50_ms']!s:>8} {w['p99_ms']!s:>8}"
        )
    r = result
    lines += [
        f"ran {r['minutes']} min at {r['rate_per_s']}/s over {r['agents']} agents",
        f"published {r['published']}, answered {r['verdicts']}, lost {r['lost']}",
        f"verdicts stored {r['stored_verdicts']} (must equal published)",
        f"verdict messages received twice {r['duplicate_verdicts']} (QoS 1: at least once)",
        f"RSS first {r['rss_first_mb']} MB, last {r['rss_last_mb']} MB, max {r['rss_max_mb']} MB: "
        f"growth {r['rss_growth'] * 100:.1f}% (limit 10%)",
        f"p99 first {r['p99_first_ms']} ms, last {r['p99_last_ms']} ms, max {r['p99_max_ms']} ms "
        f"(last must be <= {r['p99_limit_ms']} ms)",
        f"worker counts {r['worker_counts']}",
        "PASS" if r["pass"] else "FAIL",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=50.0, help="samples per second, fleet-wide")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--window-s", type=float, default=60.0, help="seconds per window")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.minutes, args.rate, args.agents, args.window_s)
    print(json.dumps(result, indent=2) if args.json else report(result), flush=True)
    sys.exit(0 if result["pass"] else 1)


if __name__ == "__main__":
    main()
