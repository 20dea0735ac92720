"""Fuzzing, short forms (hundreds of cases per target; scripts/fuzz.py runs 10,000+ each)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from simulations.fuzz_targets import (
    ANNOUNCEMENTS,
    ENVELOPES,
    FRAME_TYPES,
    FRAMES,
    INGEST_PAYLOADS,
    INGEST_TOPICS,
    URL_TEXT,
    check_envelope,
    check_frame,
    check_ingest,
    check_manifest,
    check_request_line,
    frame_client,
)

QUICK = settings(max_examples=400, deadline=None, derandomize=True)


@QUICK
@given(ENVELOPES)
def test_envelope_decoding_never_crashes(data: bytes) -> None:
    check_envelope(data)


@QUICK
@given(ANNOUNCEMENTS)
def test_manifest_verification_never_crashes(data: bytes) -> None:
    assert check_manifest(data) != "accepted" or data  # a valid one may pass unchanged


@QUICK
@given(INGEST_TOPICS, INGEST_PAYLOADS)
def test_mqtt_ingest_never_crashes(topic: str, payload: bytes) -> None:
    check_ingest(topic, payload)


@pytest.fixture
def frames_client(tmp_path: Any, student_path: Any) -> Iterator[Any]:
    from edge_agent.agent import Agent
    from edge_agent.engine import EngineOptions, OrtEngine
    from edge_agent.settings import AgentSettings
    from edge_agent.testing import MemoryPublisher

    settings_ = AgentSettings(
        data_dir=tmp_path, model_path=student_path, fleet="f", agent_id="a", warmup_runs=1
    )
    engine = OrtEngine(student_path, EngineOptions(intra_op_threads=1, warmup_runs=1))
    publisher = MemoryPublisher()
    with (
        Agent(settings_, engine=engine, publisher=publisher) as agent,
        frame_client(agent) as client,
    ):
        yield client


@pytest.fixture
def student_path(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from edge_agent.testing import make_tiny_student

    return make_tiny_student(tmp_path_factory.mktemp("fuzz") / "student.onnx", size=32)


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(body=FRAMES, content_type=FRAME_TYPES)
def test_frame_upload_never_5xx(frames_client: Any, body: bytes, content_type: str) -> None:
    check_frame(frames_client, body, content_type)


def test_targets_reach_both_outcomes() -> None:
    from simulations.fuzz_targets import VALID_ANNOUNCEMENT, VALID_ENVELOPE

    assert check_envelope(VALID_ENVELOPE) == "accepted"
    assert check_manifest(VALID_ANNOUNCEMENT) == "accepted"
    assert check_envelope(b"nope").startswith("refused")


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(path=URL_TEXT, query=URL_TEXT)
def test_agent_request_lines_never_5xx(frames_client: Any, path: str, query: str) -> None:
    check_request_line(frames_client, path, query)


def test_control_characters_in_a_query_answer_400(frames_client: Any) -> None:
    assert check_request_line(frames_client, "samples/x", "a\x00b") == "400"
