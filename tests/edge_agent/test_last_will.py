"""A killed agent: the broker publishes its last will, "offline", on the status topic."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt

from shared.broker import free_port
from shared.messages import AgentStatus, decode_message
from shared.mqtt import MqttTarget, make_client
from shared.topics import Topics


def test_sigkill_fires_the_last_will(
    mosquitto: object,
    topics: Topics,
    student_path: Path,
    tmp_path: Path,
    until: Callable[..., bool],
) -> None:
    url = mosquitto.url  # type: ignore[attr-defined]
    config = tmp_path / "agent.toml"
    config.write_text(
        f'data_dir = "{tmp_path}"\nmodel_path = "{student_path}"\n'
        f'mqtt_url = "{url}"\ntopic_prefix = "{topics.prefix}"\n'
        f"http_port = {free_port()}\n"
        'fleet = "test-fleet"\nagent_id = "agent-kill"\n'
        "intra_op_threads = 1\nwarmup_runs = 1\nheartbeat_s = 1.0\n"
    )
    status_topic = topics.status("test-fleet", "agent-kill")
    seen: list[AgentStatus] = []

    def on_message(client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        seen.append(decode_message(message.payload, AgentStatus))

    watcher = make_client(MqttTarget.parse(url), client_id="will-watcher")
    watcher.on_message = on_message
    watcher.on_connect = lambda c, *a: c.subscribe(status_topic, qos=1)
    watcher.connect("127.0.0.1", mosquitto.port)  # type: ignore[attr-defined]
    watcher.loop_start()
    log = tmp_path / "agent.log"
    with log.open("wb") as output:
        agent = subprocess.Popen(
            [sys.executable, "-m", "edge_agent.cli", "run", "--config", str(config)],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        online = until(lambda: any(s.state == "online" for s in seen), timeout=60)
        assert online, log.read_text()
        os.kill(agent.pid, signal.SIGKILL)  # no chance to say "offline" itself
        agent.wait(10)
        assert agent.returncode == -signal.SIGKILL
        assert until(lambda: seen[-1].state == "offline", timeout=15)
        offline = seen[-1]
        assert offline.agent == "agent-kill" and offline.fleet == "test-fleet"
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        watcher.disconnect()
        watcher.loop_stop()

    # Retained: a watcher that arrives later still learns the agent is offline.
    late: list[AgentStatus] = []
    second = make_client(MqttTarget.parse(url), client_id="late-watcher")
    second.on_message = lambda c, u, m: late.append(decode_message(m.payload, AgentStatus))
    second.on_connect = lambda c, *a: c.subscribe(status_topic, qos=1)
    second.connect("127.0.0.1", mosquitto.port)  # type: ignore[attr-defined]
    second.loop_start()
    try:
        assert until(lambda: bool(late), timeout=10)
        assert late[0].state == "offline"
    finally:
        second.disconnect()
        second.loop_stop()
