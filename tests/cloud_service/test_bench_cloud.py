"""The cloud benchmark's pacing and CPU accounting."""

from __future__ import annotations

import time
from typing import Any

from bench import cloud as bench_cloud


class _Recorder:
    """Stands in for a paho client: records what was published, and when."""

    def __init__(self) -> None:
        self.published: list[bytes] = []

    def publish(self, topic: str, payload: bytes, qos: int) -> None:
        assert qos == 1
        self.published.append(payload)


def test_a_paced_publisher_never_runs_more_than_its_lead_ahead() -> None:
    client = _Recorder()
    done = [0]
    leads: list[int] = []

    def arrived() -> int:
        # The receiving side takes one message each time the publisher looks.
        done[0] = min(done[0] + 1, len(client.published))
        leads.append(len(client.published) - done[0])
        return done[0]

    payloads = [bytes([i]) for i in range(50)]
    bench_cloud._publish_paced(client, "t", payloads, arrived, lead=5)  # type: ignore[arg-type]
    assert client.published == payloads
    assert max(leads) <= 5


def test_machine_cpu_counts_this_process_and_the_machine_per_message() -> None:
    cpu = bench_cloud.MachineCpu()
    cpu.start()
    # Half a second of CPU: /proc/stat's ticks (10 ms per core) stay within the margin
    # below however busy the other cores are.
    deadline = time.process_time() + 0.5
    spin: Any = 0
    while time.process_time() < deadline:
        spin += 1
    used = cpu.stop(10)
    assert set(used) == {
        "this process",
        "mosquitto",
        "postgresql",
        "machine",
        "cores busy",
        "cores",
    }
    assert used["this process"] >= 49.0  # 500 ms of CPU over 10 messages
    assert used["machine"] >= 0.9 * used["this process"]
    assert 0 < used["cores busy"] <= used["cores"] + 0.1
    assert used["mosquitto"] >= 0 and used["postgresql"] >= 0


# One run's CPU per message (ms) and cores busy, and the figures the goal rows show.
PER_MESSAGE = {
    "this process": 3.0,
    "mosquitto": 0.1,
    "postgresql": 0.2,
    "machine": 3.4,
    "cores busy": 1.5,
    "cores": 2.0,
}
GOAL_FIGURES = {
    "teacher_cpu_ms_per_sample": 0.5,
    "decode_cpu_ms_per_sample": 0.4,
    "decode_cpu_ms_per_sample_one_thread": 0.35,
    "goal_cpu_budget_ms_per_sample": 1.8,
}


def test_the_cpu_table_shows_the_goal_budget_beside_the_teacher() -> None:
    table = bench_cloud._cpu_table(
        {
            "e2e_cpu_ms_per_sample": PER_MESSAGE,
            "raw_cpu_ms_per_msg": PER_MESSAGE,
            **GOAL_FIGURES,
        }
    )
    assert "| cores busy | 1.50 of 2 | 1.50 of 2 |" in table
    assert "0.5 of the raw rate allows" in table and "| 1.8 | - |" in table
    assert "verifier processes" not in table  # not run: no column
    assert "beyond the teacher" not in table


def test_the_cpu_table_has_a_column_per_verifier_run_and_its_own_cpu_beyond_the_teacher() -> None:
    verifier = {**PER_MESSAGE, "verifier": 2.9}
    table = bench_cloud._cpu_table(
        {
            "e2e_cpu_ms_per_sample": PER_MESSAGE,
            "deployed_1_cpu_ms_per_sample": verifier,
            "e2e_workers_cpu_ms_per_sample": {**verifier, "cores busy": 1.9},
            "raw_cpu_ms_per_msg": PER_MESSAGE,
            "verifier_overhead_ms_per_sample_1p": 2.0,
            "verifier_overhead_ms_per_sample_2p": 2.2,
            **GOAL_FIGURES,
        }
    )
    header = table.splitlines()[0]
    assert f"| one verifier process | {bench_cloud.WORKERS} verifier processes |" in header
    assert "| verifier (ms per message) | - | 2.9 | 2.9 | - |" in table
    assert "| cores busy | 1.50 of 2 | 1.50 of 2 | 1.90 of 2 | 1.50 of 2 |" in table
    assert "(ms per sample; goal <= 0.5) | - | 2 | 2.2 | - |" in table
    assert "| 1.8 | - | - | - |" in table


def test_the_latency_table_shows_each_load_beside_the_raw_round_trip() -> None:
    row = {
        "rate_per_s": 12.5,
        "samples": 50,
        "p50_ms": 30.0,
        "p99_ms": 80.0,
        "unanswered": 0,
        "raw_p50_ms": 1.5,
        "raw_p99_ms": 4.0,
        "raw_unanswered": 0,
    }
    table = bench_cloud._latency_table({"10%": row}, 125.0)
    assert "| 10% | 12.5 | 30 | 80 | 1.5 | 4 | 0; 0 |" in table


def test_envelope_and_verdict_ids_are_read_from_their_payloads() -> None:
    envelope = bench_cloud._envelopes(1, "bench", "cam-1")[0]
    sample_id = bench_cloud._envelope_id(envelope)
    assert sample_id
    single = b'{"sample_id": "%s"}' % sample_id.encode()
    assert bench_cloud._verdict_ids(single) == [sample_id]
    batch = b'{"verdicts": [%s, {"sample_id": "other"}]}' % single
    assert bench_cloud._verdict_ids(batch) == [sample_id, "other"]


def test_the_decode_figure_is_the_verifiers_decode_of_the_payload_image() -> None:
    for threads in (1, 2):
        assert 0 < bench_cloud._decode_cpu_ms(threads, repeats=1, calls=3) < 1000


def test_the_teacher_figure_is_the_cpu_of_a_pass_per_frame() -> None:
    def busy_pass() -> None:
        deadline = time.process_time() + 0.02
        while time.process_time() < deadline:
            pass

    assert bench_cloud._teacher_cpu_ms(busy_pass, 10) >= 2.0  # 20 ms of CPU over 10 frames
