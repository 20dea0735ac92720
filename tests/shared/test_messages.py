"""Message schemas: round trips, the refusal order of decode_message, garbage."""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from shared.errors import (
    ContractError,
    MessageError,
    MessageValidationError,
    UnknownSchemaError,
    UnsupportedVersionError,
)
from shared.ids import new_sample_id
from shared.messages import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MESSAGE_TYPES,
    AgentStatus,
    Message,
    ModelStatus,
    Receipt,
    SampleHeader,
    Verdict,
    Verdicts,
    decode_any,
    decode_message,
    decode_verdicts,
    encode_message,
    encode_verdicts,
)

NOW = datetime(2025, 6, 1, 12, 0, 0, 250000, tzinfo=UTC)


def sample_header(**overrides: Any) -> SampleHeader:
    fields: dict[str, Any] = {
        "sample_id": new_sample_id(),
        "fleet": "plant-3",
        "agent": "cam-017",
        "captured_at": NOW,
        "model_name": "resnet18-student",
        "model_version": "1.4.0",
        "scores": [0.05, 0.6, 0.35],
        "predicted": 1,
        "confidence": 0.6,
        "route_reason": "margin",
        "priority": 2,
        "image_format": "jpeg",
        "image_width": 640,
        "image_height": 480,
        "image_bytes": 48_211,
        "meta": {"source": "rtsp"},
    }
    fields.update(overrides)
    return SampleHeader(**fields)


def _agent_verdict(
    agent: str, label: int = 1, boxes: int = 0, fleet: str = "f", sample_id: str | None = None
) -> Verdict:
    answer: dict[str, Any] = {"scores": [0.1, 0.9], "label": label}
    if boxes:
        answer = {
            "scores": [0.9] * boxes,
            "label": 0,
            "boxes": [[0.1, 0.1, 0.5, 0.5, 0.9, i % 3] for i in range(boxes)],
        }
    return Verdict(
        sample_id=sample_id or new_sample_id(),
        fleet=fleet,
        agent=agent,
        teacher_model="teacher",
        teacher_version="7",
        confidence=0.9,
        agrees_with_edge=True,
        verified_at=NOW,
        **answer,
    )


def examples() -> list[Message]:
    sid = new_sample_id()
    verdict = _agent_verdict("cam-017", label=0, fleet="plant-3")
    return [
        sample_header(),
        Receipt(sample_ids=[sid, new_sample_id()], stored_at=NOW),
        Verdict(
            sample_id=sid,
            fleet="plant-3",
            agent="cam-017",
            teacher_model="vit-b16-teacher",
            teacher_version="2025.05",
            scores=[0.01, 0.02, 0.97],
            label=2,
            confidence=0.97,
            agrees_with_edge=False,
            review=True,
            review_reasons=["disagreement", "low teacher margin"],
            verified_at=NOW,
        ),
        AgentStatus(fleet="plant-3", agent="cam-017", state="offline", sent_at=NOW),
        AgentStatus(
            fleet="plant-3",
            agent="cam-017",
            state="online",
            sent_at=NOW,
            model_version="1.4.0",
            provider="TensorrtExecutionProvider",
            frames_per_s=29.7,
            latency_p50_ms=3.1,
            latency_p99_ms=9.8,
            forward_rate=0.04,
            spool_depth=12,
            dropped_frames=0,
            agreement_rate=0.93,
            cpu_percent=141.5,
            memory_mb=812.0,
            gpu={"util_percent": 37.0, "memory_mb": 1024.0},
        ),
        ModelStatus(
            fleet="plant-3",
            agent="cam-017",
            model_name="resnet18-student",
            model_version="1.5.0",
            state="rejected",
            reason="golden case 0 differs by 0.2",
            at=NOW,
        ),
        Verdicts(verdicts=[verdict, _agent_verdict("cam-017", fleet="plant-3", sample_id=sid)]),
    ]


@pytest.mark.parametrize("message", examples(), ids=lambda m: type(m).__name__)
def test_round_trip_every_message(message: Message) -> None:
    data = encode_message(message)
    assert decode_message(data, type(message)) == message
    assert decode_any(data) == message
    assert decode_message(data.decode(), type(message)) == message
    assert decode_message(json.loads(data), type(message)) == message
    obj = json.loads(data)
    assert obj["schema"] == type(message).SCHEMA and obj["v"] == 1


def test_registry_holds_every_message_type() -> None:
    assert set(MESSAGE_TYPES) == {
        "edgeloop.sample",
        "edgeloop.receipt",
        "edgeloop.verdict",
        "edgeloop.verdicts",
        "edgeloop.status",
        "edgeloop.model-status",
        "edgeloop.model-announcement",
    }
    for name, cls in MESSAGE_TYPES.items():
        assert name == cls.SCHEMA
        assert cls.VERSION == 1


def test_encoding_is_compact_sorted_and_leaves_out_none() -> None:
    status = AgentStatus(fleet="f", agent="a", state="offline", sent_at=NOW)
    data = encode_message(status)
    assert data == (
        b'{"agent":"a","fleet":"f","schema":"edgeloop.status",'
        b'"sent_at":"2025-06-01T12:00:00.250000Z","state":"offline","v":1}'
    )


def test_schema_and_version_are_filled_in_and_checked() -> None:
    header = sample_header()
    assert header.schema_name == "edgeloop.sample" and header.v == 1
    with pytest.raises(ValidationError):
        sample_header(schema="edgeloop.verdict")
    with pytest.raises(ValidationError):
        sample_header(v=2)


def test_timestamps_are_utc_and_need_a_zone() -> None:
    plus_two = timezone(timedelta(hours=2))
    header = sample_header(captured_at=datetime(2025, 6, 1, 14, 0, tzinfo=plus_two))
    assert header.captured_at == datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
    assert header.captured_at.tzinfo is UTC
    assert b'"captured_at":"2025-06-01T12:00:00Z"' in encode_message(header)
    with pytest.raises(ValidationError, match="time zone"):
        sample_header(captured_at=datetime(2025, 6, 1, 12, 0))
    obj = json.loads(encode_message(sample_header()))
    for bad in ("2025-06-01T12:00:00", 1748779200, "soon"):
        obj["captured_at"] = bad
        with pytest.raises(MessageValidationError, match="captured_at"):
            decode_message(obj, SampleHeader)


def test_scores_are_rounded_to_four_significant_digits() -> None:
    header = sample_header(scores=[0.123456789, 6.1415085e-05, 1 / 3], predicted=0)
    assert header.scores == [0.1235, 6.142e-05, 0.3333]
    again = sample_header(scores=header.scores, predicted=0)
    assert again.scores == header.scores
    assert sample_header(confidence=0.87654321).confidence == 0.8765


def test_numpy_values_are_accepted_when_building_in_code() -> None:
    probs = np.array([0.25, 0.75], dtype=np.float32)
    header = sample_header(scores=probs, predicted=np.int64(1), confidence=probs[1])
    assert header.scores == [0.25, 0.75] and header.predicted == 1
    assert type(header.predicted) is int and type(header.confidence) is float


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("scores", []),
        ("scores", [0.1] * 1001),
        ("scores", [float("nan")]),
        ("scores", [float("inf")]),
        ("scores", [1.7976931348623157e308]),  # rounds up to infinity
        ("predicted", 3),
        ("predicted", -1),
        ("confidence", 1.5),
        ("priority", 10),
        ("route_reason", "because"),
        ("image_format", "gif"),
        ("image_width", 0),
        ("image_bytes", 0),
        ("fleet", "Plant 3"),
        ("agent", ""),
        ("sample_id", "not-an-id"),
        ("model_name", ""),
        ("model_name", "x\n"),
        ("model_version", "v" * 129),
        ("meta", {f"k{i}": "v" for i in range(17)}),
        ("meta", {"k": "v" * 257}),
        ("meta", {"": "v"}),
    ],
)
def test_sample_header_field_limits(field: str, value: Any) -> None:
    with pytest.raises(ValidationError):
        sample_header(**{field: value})
    obj = json.loads(encode_message(sample_header()))
    obj[field] = value
    with pytest.raises(MessageValidationError):
        decode_message(json.dumps(obj), SampleHeader)


def test_verdict_label_must_index_the_scores() -> None:
    obj = json.loads(encode_message(examples()[2]))
    obj["label"] = 3
    with pytest.raises(MessageValidationError, match="label"):
        decode_message(obj, Verdict)


def test_receipt_limits() -> None:
    with pytest.raises(ValidationError):
        Receipt(sample_ids=[], stored_at=NOW)
    ids = [new_sample_id() for _ in range(1000)]
    receipt = Receipt(sample_ids=ids, stored_at=NOW)
    assert len(encode_message(receipt)) < 65536
    assert decode_message(encode_message(receipt), Receipt) == receipt
    with pytest.raises(ValidationError):
        Receipt(sample_ids=[*ids, new_sample_id()], stored_at=NOW)


@pytest.mark.parametrize(
    ("field", "value"),
    [("predicted", "1"), ("predicted", True), ("predicted", 1.0), ("confidence", "0.5")],
)
def test_decoding_is_strict_about_types(field: str, value: Any) -> None:
    obj = json.loads(encode_message(sample_header()))
    obj[field] = value
    with pytest.raises(MessageValidationError, match=field):
        decode_message(obj, SampleHeader)


def test_unknown_fields_are_ignored() -> None:
    header = sample_header()
    obj = json.loads(encode_message(header))
    obj["added_in_a_later_minor"] = {"x": [1, 2]}
    assert decode_message(json.dumps(obj), SampleHeader) == header


# --- the refusal order ---------------------------------------------------------


def test_too_large_comes_first() -> None:
    with pytest.raises(MessageError) as info:
        decode_message(b"x" * 101, SampleHeader, max_bytes=100)
    assert info.value.reason == "too_large"
    assert type(info.value) is MessageError
    with pytest.raises(MessageError, match="over the limit"):
        decode_message("é" * 60, SampleHeader, max_bytes=100)  # 120 bytes as UTF-8


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"\xff\xfe{}",
        b"[1, 2]",
        b'"edgeloop.sample"',
        b"null",
        b'{"schema": "edgeloop.sample", "v": 1,',
        b'{"schema":"edgeloop.sample","v":1,"scores":[NaN]}',
        b'{"schema":"edgeloop.sample","v":1,"scores":[Infinity]}',
        b'{"schema":"edgeloop.sample","v":1,"fleet":"a\\ud800b"}',
        b'{"schema":"edgeloop.sample","v":1,"n":' + b"9" * 5000 + b"}",
        b"[" * 5000 + b"]" * 5000,
    ],
)
def test_not_a_json_object(data: bytes) -> None:
    with pytest.raises(MessageValidationError):
        decode_message(data, SampleHeader)
    with pytest.raises(MessageValidationError):
        decode_any(data)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b'{"schema":"edgeloop.sample","v":1,"scores":[NaN]}', "not a finite number"),
        (b'{"schema":"edgeloop.sample","v":1,"fleet":"a\\ud800b"}', "not valid Unicode"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"schema": "edgeloop.sample", "v": 1,', "not valid JSON"),
        (b"[1, 2]", "JSON list, not an object"),
    ],
)
def test_refused_json_says_why(data: bytes, words: str) -> None:
    with pytest.raises(MessageValidationError, match=words):
        decode_message(data, SampleHeader)


def test_an_integer_past_64_bits_is_refused_where_an_integer_is_due() -> None:
    text = encode_message(sample_header()).decode()
    data = text.replace('"predicted":1', '"predicted":' + "9" * 30).encode()
    assert data != text.encode()
    with pytest.raises(MessageValidationError, match="predicted"):
        decode_message(data, SampleHeader)


def test_deep_nesting_is_refused_cleanly() -> None:
    data = b'{"schema":"edgeloop.sample","v":1,"meta":' + b"[" * 30000 + b"]" * 30000 + b"}"
    with pytest.raises(MessageValidationError):
        decode_message(data, SampleHeader, max_bytes=100_000)


def test_unknown_schema_names_expected_and_received() -> None:
    data = encode_message(examples()[1])  # a receipt
    with pytest.raises(UnknownSchemaError) as info:
        decode_message(data, SampleHeader)
    assert "'edgeloop.sample'" in str(info.value) and "'edgeloop.receipt'" in str(info.value)
    with pytest.raises(UnknownSchemaError, match="no 'schema'"):
        decode_message(b'{"v": 1}', SampleHeader)
    with pytest.raises(UnknownSchemaError, match=r"unknown schema 'edgeloop\.other'"):
        decode_any(b'{"schema": "edgeloop.other", "v": 1}')
    with pytest.raises(UnknownSchemaError):
        decode_any(b'{"schema": ["edgeloop.sample"], "v": 1}')


def test_schema_is_checked_before_version_and_fields() -> None:
    with pytest.raises(UnknownSchemaError):
        decode_message(b'{"schema": "edgeloop.other", "v": "x"}', SampleHeader)


@pytest.mark.parametrize("v", [None, "1", 1.0, True, [1]])
def test_version_must_be_an_integer(v: Any) -> None:
    obj = json.loads(encode_message(sample_header()))
    obj["v"] = v
    with pytest.raises(MessageValidationError, match="integer 'v'"):
        decode_message(obj, SampleHeader)
    del obj["v"]
    with pytest.raises(MessageValidationError, match="integer 'v'"):
        decode_message(obj, SampleHeader)


def test_newer_version_is_refused_naming_the_newest_supported() -> None:
    obj = json.loads(encode_message(sample_header()))
    obj["v"] = 2
    obj["fleet"] = "INVALID"  # the version is checked before the fields
    with pytest.raises(UnsupportedVersionError, match=r"newest supported: 1") as info:
        decode_message(json.dumps(obj), SampleHeader)
    assert info.value.reason == "unsupported_version"
    with pytest.raises(UnsupportedVersionError):
        decode_any(json.dumps(obj))
    obj["v"] = 0
    with pytest.raises(MessageValidationError, match="versions start at 1"):
        decode_message(json.dumps(obj), SampleHeader)


def test_validation_errors_are_wrapped_once_with_a_short_summary() -> None:
    obj = json.loads(encode_message(sample_header()))
    for field in ("fleet", "agent", "scores", "predicted", "image_width"):
        del obj[field]
    with pytest.raises(MessageValidationError) as info:
        decode_message(obj, SampleHeader)
    text = str(info.value)
    assert text.startswith("edgeloop.sample message is not valid: ")
    assert "(and 2 more)" in text
    assert isinstance(info.value.__cause__, ValidationError)
    assert "https://errors.pydantic.dev" not in text


# --- hypothesis ---------------------------------------------------------------


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.data())
def test_sample_header_round_trip(
    data: st.DataObject, header_strategy: st.SearchStrategy[dict[str, Any]]
) -> None:
    fields = data.draw(header_strategy)
    header = SampleHeader(
        **fields, image_format="png", image_width=640, image_height=480, image_bytes=1234
    )
    encoded = encode_message(header)
    assert decode_message(encoded, SampleHeader) == header
    assert decode_any(encoded) == header
    assert encode_message(decode_any(encoded)) == encoded


@settings(max_examples=200, deadline=None, database=None)
@given(data=st.data(), review=st.booleans(), agrees=st.booleans())
def test_verdict_round_trip(
    data: st.DataObject,
    review: bool,
    agrees: bool,
    scores_strategy: st.SearchStrategy[tuple[list[float], int]],
) -> None:
    scores, label = data.draw(scores_strategy)
    verdict = Verdict(
        sample_id=new_sample_id(),
        fleet="f",
        agent="a",
        teacher_model="teacher",
        teacher_version="7",
        scores=scores,
        label=label,
        confidence=data.draw(st.floats(0, 1)),
        agrees_with_edge=agrees,
        review=review,
        verified_at=NOW,
    )
    assert decode_message(encode_message(verdict), Verdict) == verdict


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


@settings(max_examples=500, deadline=None, database=None)
@given(data=st.binary(max_size=300))
def test_garbage_bytes_only_raise_message_errors(data: bytes) -> None:
    with contextlib.suppress(MessageError):
        decode_any(data)
    with contextlib.suppress(MessageError):
        decode_message(data, SampleHeader)


@settings(max_examples=500, deadline=None, database=None)
@given(data=st.data())
def test_mutated_messages_only_raise_message_errors(data: st.DataObject) -> None:
    message = data.draw(st.sampled_from(examples()))
    obj = json.loads(encode_message(message))
    key = data.draw(st.sampled_from(sorted(obj)))
    if data.draw(st.booleans()):
        del obj[key]
    else:
        obj[key] = data.draw(json_values)
    try:
        text = json.dumps(obj)
    except ValueError:
        return
    try:
        decoded = decode_any(text)
    except ContractError as exc:
        assert isinstance(exc, MessageError)
        return
    assert isinstance(decoded, Message)


def test_verdicts_go_out_per_agent_in_batches_that_decode_back_in_order() -> None:
    verdicts = [_agent_verdict("a") for _ in range(5)] + [_agent_verdict("b")]
    verdicts.insert(2, _agent_verdict("b", label=0))
    messages = encode_verdicts(verdicts, per_message=2)
    assert [(fleet, agent) for fleet, agent, _ in messages] == [("f", "a")] * 3 + [("f", "b")]
    back = {
        agent: [v for _, a, p in messages if a == agent for v in decode_verdicts(p)]
        for agent in ("a", "b")
    }
    assert back["a"] == [v for v in verdicts if v.agent == "a"]
    assert back["b"] == [v for v in verdicts if v.agent == "b"]
    assert all(json.loads(p)["schema"] == "edgeloop.verdicts" for _, _, p in messages)


def test_one_verdict_per_message_when_asked_and_either_form_decodes() -> None:
    verdicts = [_agent_verdict("a"), _agent_verdict("a")]
    messages = encode_verdicts(verdicts, per_message=1)
    assert [json.loads(p)["schema"] for _, _, p in messages] == ["edgeloop.verdict"] * 2
    assert [v for _, _, p in messages for v in decode_verdicts(p)] == verdicts


def test_a_batch_too_large_for_one_message_is_split() -> None:
    verdicts = [_agent_verdict("a", boxes=100) for _ in range(20)]
    messages = encode_verdicts(verdicts, per_message=100)
    assert len(messages) > 1
    assert all(len(p) <= DEFAULT_MAX_MESSAGE_BYTES for _, _, p in messages)
    assert [v for _, _, p in messages for v in decode_verdicts(p)] == verdicts


def test_a_batch_mixing_agents_or_of_another_schema_is_refused() -> None:
    mixed = {
        "schema": "edgeloop.verdicts",
        "v": 1,
        "verdicts": [
            json.loads(encode_message(_agent_verdict("a"))),
            json.loads(encode_message(_agent_verdict("b"))),
        ],
    }
    with pytest.raises(MessageValidationError, match="one agent's verdicts"):
        decode_verdicts(json.dumps(mixed).encode())
    with pytest.raises(MessageValidationError):
        decode_verdicts(json.dumps({**mixed, "verdicts": []}).encode())
    with pytest.raises(UnsupportedVersionError):
        decode_verdicts(json.dumps({**mixed, "v": 2}).encode())
    with pytest.raises(UnknownSchemaError):
        decode_verdicts(b'{"schema": "edgeloop.receipt", "v": 1}')


def test_encoded_messages_are_the_canonical_layout_of_their_values() -> None:
    from shared.manifest import canonical_json

    # (An announcement is canonical_json itself: test_announcement_freshness verifies
    # one end to end, signature and canonical manifest bytes included.)
    for message in examples():
        fields = message.model_dump(mode="json", by_alias=True, exclude_none=True)
        encoded = encode_message(message)
        assert json.loads(encoded) == fields
        # Sorted keys, compact, UTF-8: the bytes canonical_json gives for these values.
        assert encoded == canonical_json(fields)
