"""The agent's MQTT link: how soon a forwarded sample leaves the agent.

    python -m bench.run --only uplink        # or: python -m bench.uplink [--quick]

Latency from ``publish`` to arrival at a subscriber on the local Mosquitto, QoS 1,
20 KB payloads published one at a time with pauses between them (an agent that
forwards a sample now and then, the usual case), for the agent's ``MqttLink``
against a plain paho client running its own loop thread (``loop_start``), which
wakes its select on every publish. The two take turns, round by round; medians
and p99 over all rounds.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.common import markdown_table

BROKER = "mqtt://127.0.0.1:1883"
PAYLOAD_BYTES = 20_000
PAUSE_S = 0.02


def _round(publish: Callable[[str, bytes], object], broker: str, topic: str, n: int) -> list[float]:
    """Latencies (ms) of ``n`` publishes on ``topic``, each awaited before the next."""
    from shared.mqtt import MqttTarget, make_client

    target = MqttTarget.parse(broker)
    arrived: dict[int, float] = {}
    landed = threading.Condition()

    def on_message(client: Any, userdata: Any, message: Any) -> None:
        with landed:
            arrived[int(bytes(message.payload[:8]))] = time.perf_counter()
            landed.notify_all()

    sub = make_client(target, client_id=f"bench-uplink-sub-{uuid.uuid4().hex[:6]}")
    sub.on_message = on_message
    sub.connect(target.host, target.port)
    sub.subscribe(topic, qos=1)
    sub.loop_start()
    time.sleep(0.3)
    latencies = []
    try:
        for i in range(n):
            time.sleep(PAUSE_S)
            sent = time.perf_counter()
            publish(topic, b"%08d" % i + bytes(PAYLOAD_BYTES - 8))
            with landed:
                if not landed.wait_for(lambda: i in arrived, 5.0):  # noqa: B023
                    raise RuntimeError(f"publish {i} did not arrive within 5 s")
            latencies.append((arrived[i] - sent) * 1e3)
    finally:
        sub.disconnect()
        sub.loop_stop()
    return latencies


def run(quick: bool = False, *, broker: str = BROKER) -> dict[str, Any]:
    from edge_agent.uplink import MqttLink
    from shared.mqtt import MqttTarget, make_client, negotiate_protocol

    target = MqttTarget.parse(broker)
    try:
        negotiate_protocol(target)
    except Exception as exc:  # no broker here: nothing to measure
        return {"figures": {"skipped": f"no broker: {exc}"}, "tables": []}
    rounds, per_round = (3, 30) if quick else (5, 60)
    link = MqttLink(target, client_id=f"bench-uplink-link-{uuid.uuid4().hex[:6]}", subscriptions=[])
    link.start()
    paho = make_client(target, client_id=f"bench-uplink-paho-{uuid.uuid4().hex[:6]}")
    paho.connect(target.host, target.port)
    paho.loop_start()
    deadline = time.monotonic() + 10
    while not (link.connected and paho.is_connected()):
        if time.monotonic() > deadline:
            raise RuntimeError("the link or the paho client did not connect")
        time.sleep(0.01)
    results: dict[str, list[float]] = {"link": [], "paho": []}
    try:
        for _ in range(rounds):
            topic = f"bench-uplink/{uuid.uuid4().hex[:8]}"
            results["link"] += _round(
                lambda t, p: link.publish(t, p, qos=1), broker, topic, per_round
            )
            results["paho"] += _round(
                lambda t, p: paho.publish(t, p, qos=1), broker, topic, per_round
            )
    finally:
        link.stop()
        paho.disconnect()
        paho.loop_stop()
    figures: dict[str, Any] = {}
    for name, values in results.items():
        figures[f"{name}_p50_ms"] = round(statistics.median(values), 3)
        figures[f"{name}_p99_ms"] = round(float(np.percentile(values, 99)), 3)
    figures["link_vs_paho_p50"] = round(figures["link_p50_ms"] / figures["paho_p50_ms"], 3)
    tables = [
        markdown_table(
            ["client", "p50 ms", "p99 ms"],
            [
                ["agent's MqttLink", figures["link_p50_ms"], figures["link_p99_ms"]],
                ["paho, loop_start", figures["paho_p50_ms"], figures["paho_p99_ms"]],
            ],
        ),
        f"Publish to arrival at a subscriber, local Mosquitto, QoS 1, {PAYLOAD_BYTES // 1000} KB"
        f" payloads, one at a time {PAUSE_S * 1e3:.0f} ms apart; {rounds} rounds of"
        f" {per_round} per client, taking turns.",
    ]
    return {"figures": figures, "tables": tables}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print("\n\n".join(run(args.quick)["tables"]))
