"""Fuzz targets and input strategies, run by the short fuzz tests and ``scripts/fuzz.py``.

Each ``check_*`` takes one input and returns the outcome's name; it raises only if
the code under test crashed (an exception outside the documented error tree) or, for
HTTP, answered 5xx. Inputs are a mix of raw bytes and mutations of a valid message
(byte flips, truncation, splices), which reach far deeper than random bytes alone.
"""

from __future__ import annotations

import base64
import hashlib
import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from hypothesis import strategies as st

from shared.envelope import EnvelopeLimits, decode_envelope, encode_envelope
from shared.errors import EdgeLoopError
from shared.images import MAX_JPEG_SCANS
from shared.manifest import FleetSigningKey, ModelManifest
from shared.messages import encode_message, sign_manifest, verify_manifest_bytes
from shared.topics import Topics
from simulations.samples import image_bytes, progressive_jpeg, sample_header, scan_bomb


def manifest_fields() -> dict[str, Any]:
    """A valid manifest of a small student (2x2 RGB input, three labels, one golden case)."""
    return {
        "name": "resnet18-student",
        "version": "1.4.0",
        "format": "int8",
        "sha256": hashlib.sha256(b"model").hexdigest(),
        "size_bytes": 11_534_336,
        "url": "https://cloud.example/models/resnet18-student/1.4.0/model.onnx",
        "input": {
            "name": "images",
            "shape": ["batch", 2, 2, 3],
            "dtype": "uint8",
            "layout": "NHWC",
            "color": "RGB",
            "mean": [0.485, 0.456, 0.406],
            "std": [0.229, 0.224, 0.225],
            "scale": 1 / 255,
        },
        "output_name": "scores",
        "labels": ["cat", "dog", "café"],
        "opset": 17,
        "min_runtime_version": "1.18.0",
        "golden": [
            {
                "input": base64.b64encode(bytes(range(12))).decode(),
                "shape": [1, 2, 2, 3],
                "expected": [[0.1, 0.2, 0.7]],
                "atol": 0.001,
            }
        ],
        "created_at": datetime(2025, 6, 1, 12, 0, tzinfo=UTC),
        "parent_version": "1.3.2",
        "metrics": {"top1": 0.912, "agreement": 0.95},
    }


LIMITS = EnvelopeLimits(max_header_bytes=4096, max_image_bytes=200_000, max_pixels=1_000_000)
TOPICS = Topics(prefix="edgeloop/v1")
_IMAGE = image_bytes(32)
_PNG = image_bytes(32, fmt="PNG", seed=3)
VALID_ENVELOPE = encode_envelope(sample_header(_IMAGE), _IMAGE)
KEY = FleetSigningKey.generate()
VALID_ANNOUNCEMENT = encode_message(sign_manifest(ModelManifest(**manifest_fields()), KEY))


@st.composite
def mutated(draw: Any, seed: bytes) -> bytes:
    data = bytearray(seed)
    for _ in range(draw(st.integers(0, 8))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "splice"]))
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            data[at : at + draw(st.integers(1, 64))] = draw(st.binary(max_size=64))
    return bytes(data)


def payloads(seed: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=4096), mutated(seed), st.just(seed))


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(children, max_size=4) | st.dictionaries(
        st.text(max_size=10), children, max_size=4
    )


ENVELOPES = payloads(VALID_ENVELOPE)
ANNOUNCEMENTS = st.one_of(
    payloads(VALID_ANNOUNCEMENT),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
        _containers,
        max_leaves=10,
    ).map(lambda v: json.dumps(v).encode()),
)
INGEST_TOPICS = st.one_of(
    st.sampled_from(
        [
            TOPICS.samples("fleet-a", "cam-1"),
            TOPICS.samples("fleet-a", "cam-2"),
            TOPICS.status("fleet-a", "cam-1"),
            TOPICS.model_status("fleet-a", "cam-1"),
            TOPICS.verdicts("fleet-a", "cam-1"),
            "edgeloop/v1/Fleet/../samples",
            "edgeloop/v1/fleet-a/cam-1/samples/extra",
            "other/prefix/fleet-a/cam-1/samples",
        ]
    ),
    st.text(max_size=80),
)
INGEST_PAYLOADS = st.one_of(
    ENVELOPES,
    payloads(b'{"schema":"agent-status","v":1,"fleet":"fleet-a","agent":"cam-1","state":"online"}'),
)
FRAME_TYPES = st.sampled_from(
    ["image/jpeg", "image/png", "application/octet-stream", "text/plain", "", "image/gif"]
)
# JPEG bombs: over the scan limit (refused before decoding), at it, and mutated.
_BOMBS = [scan_bomb(MAX_JPEG_SCANS + 1, size=32), scan_bomb(MAX_JPEG_SCANS * 8, size=32)]
FRAMES = st.one_of(
    payloads(_IMAGE),
    payloads(_PNG),
    st.sampled_from(_BOMBS),
    payloads(_BOMBS[0]),
    payloads(progressive_jpeg(32)),
    st.binary(max_size=2048),
)
# Paths and query strings with every latin-1 character, NUL and the other controls included.
URL_TEXT = st.text(alphabet=st.characters(codec="latin-1"), max_size=40)


def check_envelope(data: bytes) -> str:
    try:
        decode_envelope(data, LIMITS)
    except EdgeLoopError as exc:
        return f"refused:{exc.reason}"
    return "accepted"


def check_manifest(data: bytes) -> str:
    try:
        verify_manifest_bytes(data, KEY.public_key_b64)
    except EdgeLoopError as exc:
        return f"refused:{exc.reason}"
    return "accepted"


def check_ingest(topic: str, payload: bytes) -> str:
    from cloud_service.ingest import DeadLetterRow, classify

    outcome = classify(topic, payload, topics=TOPICS, limits=LIMITS, input_size=(32, 32))
    if isinstance(outcome, DeadLetterRow):
        return f"refused:{outcome.reason}"
    return type(outcome).__name__


@contextmanager
def frame_client(agent: Any) -> Iterator[Any]:
    """A TestClient on the edge agent's HTTP app (in-process, no socket)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Starlette wants httpx2; the httpx we have works
        from fastapi.testclient import TestClient
    from edge_agent.sources.http import create_app

    with TestClient(create_app(agent), raise_server_exceptions=False) as client:
        yield client


def check_request_line(client: Any, path: str, query: str) -> str:
    """GET the agent's API at an arbitrary path and query: a 4xx or an answer, never a 5xx."""
    url = "/v1/" + quote(path, safe="/") + "?q=" + quote(query, safe="")
    response = client.get(url)
    if response.status_code >= 500:
        raise AssertionError(f"5xx from GET {url!r}: {response.status_code}")
    return str(response.status_code)


def check_frame(client: Any, body: bytes, content_type: str) -> str:
    headers = {"Content-Type": content_type} if content_type else {}
    response = client.post("/v1/frames", content=body, headers=headers)
    if response.status_code >= 500:
        raise AssertionError(f"5xx from /v1/frames: {response.status_code} {response.text[:200]}")
    return str(response.status_code)
