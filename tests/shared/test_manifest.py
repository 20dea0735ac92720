"""Model manifests: validation, canonical bytes, ed25519 signing and verification."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import stat
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from shared.errors import (
    ConfigError,
    ContractError,
    MessageError,
    SignatureError,
    UnknownSchemaError,
)
from shared.manifest import (
    FleetSigningKey,
    GoldenCase,
    InputSpec,
    ModelManifest,
    agent_refusal,
    canonical_json,
    canonical_manifest_bytes,
    key_id_for,
    sha256_file,
)
from shared.messages import (
    ModelAnnouncement,
    decode_any,
    decode_message,
    encode_message,
    sign_manifest,
    verify_announcement,
    verify_manifest_bytes,
)
from simulations.fuzz_targets import manifest_fields

GOLDEN_INPUT = bytes(range(12))  # one 2x2 RGB frame


def small_manifest(**overrides: Any) -> ModelManifest:
    return ModelManifest(**{**manifest_fields(), **overrides})


@pytest.fixture(scope="module")
def key() -> FleetSigningKey:
    return FleetSigningKey.generate()


@pytest.fixture(scope="module")
def other_key() -> FleetSigningKey:
    return FleetSigningKey.generate()


# --- the manifest ---------------------------------------------------------------


def test_manifest_fields() -> None:
    manifest = small_manifest()
    assert manifest.input == InputSpec(
        name="images",
        shape=["batch", 2, 2, 3],
        dtype="uint8",
        mean=[0.485, 0.456, 0.406],
        std=[0.229, 0.224, 0.225],
        scale=1 / 255,
    )
    assert manifest.golden[0].input_bytes() == GOLDEN_INPUT
    assert isinstance(manifest.golden[0], GoldenCase)
    assert manifest.created_at.tzinfo is UTC


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", "ResNet"),
        ("version", "1.4.0 beta"),
        ("version", ".1"),
        ("version", "v" * 65),
        ("format", "fp16"),
        ("sha256", "AB" * 32),
        ("sha256", "ab" * 31),
        ("sha256", "ab" * 33),
        ("size_bytes", 0),
        ("url", "ftp://cloud.example/model.onnx"),
        ("url", "model.onnx"),
        ("url", "https://cloud.example/a b"),
        ("labels", ["only-one"]),
        ("labels", ["cat", "cat", "dog"]),
        ("labels", ["cat", "", "dog"]),
        ("opset", 0),
        ("min_runtime_version", "1.18-rc1"),
        ("min_runtime_version", "latest"),
        ("golden", []),
        ("created_at", datetime(2025, 6, 1, 12, 0)),
        ("parent_version", "Bad Version"),
        ("metrics", {"top1": float("nan")}),
    ],
)
def test_manifest_field_checks(field: str, value: Any) -> None:
    with pytest.raises(ValidationError):
        small_manifest(**{field: value})


@pytest.mark.parametrize(
    "change",
    [
        {"input": {"shape": [1, 2, 2, 3], "expected": [[0.1, 0.2]]}},  # 2 scores, 3 labels
        {"input": {"shape": [1, 2, 3, 2]}},  # axis 2 differs from the input's 2
        {"input": {"shape": [1, 2, 2]}, "data": bytes(4)},  # rank 3, input rank 4
        {"input": {"shape": [1, 2, 2, 3]}, "data": bytes(11)},  # 11 bytes for 12 values
        {"input": {"shape": [2, 2, 2, 3], "expected": [[0.1, 0.2, 0.7]]}, "data": bytes(24)},
    ],
)
def test_golden_cases_must_fit_the_input_and_labels(change: dict[str, Any]) -> None:
    fields = manifest_fields()
    golden = dict(fields["golden"][0], **change["input"])
    if "data" in change:
        golden["input"] = base64.b64encode(change["data"]).decode()
    with pytest.raises(ValidationError):
        small_manifest(golden=[golden])


def test_golden_input_must_be_canonical_base64() -> None:
    fields = manifest_fields()
    for bad in ("AAECAwQFBgcICQoL=", "AAEC AwQFBgcICQoL", "AAECAwQFBgcICQoM"[:-1] + "!"):
        with pytest.raises(ValidationError, match="base64"):
            small_manifest(golden=[dict(fields["golden"][0], input=bad)])


def test_input_spec_checks() -> None:
    with pytest.raises(ValidationError):
        InputSpec(name="x", shape=["batch size", 3], dtype="uint8")
    with pytest.raises(ValidationError):
        InputSpec(name="x", shape=[1, 3], dtype="uint8", mean=[0.5], std=[0.5, 0.5])
    with pytest.raises(ValidationError):
        InputSpec(name="x", shape=[1, 3], dtype="uint8", std=[1.0, 0.0, 1.0])
    with pytest.raises(ValidationError):
        InputSpec(name="x", shape=[0, 3], dtype="uint8")


# --- canonical bytes ----------------------------------------------------------------


def test_canonical_bytes_are_sorted_compact_utf8_and_use_z() -> None:
    data = canonical_manifest_bytes(small_manifest())
    obj = json.loads(data)
    assert data == json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")
    assert b" " not in data
    assert '"café"'.encode() in data
    assert b'"created_at":"2025-06-01T12:00:00Z"' in data
    assert list(obj) == sorted(obj)


def test_canonical_bytes_do_not_depend_on_how_the_manifest_was_built() -> None:
    fields = manifest_fields()
    reordered = dict(reversed(list(fields.items())))
    reordered["created_at"] = "2025-06-01T14:00:00+02:00"
    assert canonical_manifest_bytes(ModelManifest(**reordered)) == canonical_manifest_bytes(
        small_manifest()
    )
    assert canonical_manifest_bytes(small_manifest(parent_version=None)).find(b"parent") == -1


def test_canonical_bytes_are_the_same_in_another_process() -> None:
    manifest = small_manifest()
    script = (
        "import sys, json; from shared.manifest import ModelManifest, canonical_manifest_bytes;"
        "m = ModelManifest.model_validate(json.loads(sys.stdin.read()), strict=True);"
        "sys.stdout.write(canonical_manifest_bytes(m).hex())"
    )
    for seed in ("0", "12345"):
        result = subprocess.run(
            [sys.executable, "-c", script],
            input=manifest.model_dump_json(),
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
            cwd=Path(__file__).resolve().parents[2],
        )
        assert bytes.fromhex(result.stdout) == canonical_manifest_bytes(manifest)


# --- keys ----------------------------------------------------------------------------


def test_key_save_load(tmp_path: Path, key: FleetSigningKey) -> None:
    path = tmp_path / "keys" / "nested" / "fleet.pem"
    key.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    loaded = FleetSigningKey.load(path)
    assert loaded.public_key_b64 == key.public_key_b64
    assert loaded.key_id == key.key_id
    assert [p.name for p in path.parent.iterdir()] == ["fleet.pem"]  # no temp file left


def test_key_save_refuses_to_overwrite(tmp_path: Path, key: FleetSigningKey) -> None:
    path = tmp_path / "fleet.pem"
    FleetSigningKey.generate().save(path)
    with pytest.raises(ConfigError, match="overwrite"):
        key.save(path)
    key.save(path, overwrite=True)
    assert FleetSigningKey.load(path).key_id == key.key_id


def test_key_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        FleetSigningKey.load(tmp_path / "missing.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"not a key")
    with pytest.raises(ConfigError, match="PEM"):
        FleetSigningKey.load(garbage)
    ec_path = tmp_path / "ec.pem"
    ec_path.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(ConfigError, match="not an ed25519 key"):
        FleetSigningKey.load(ec_path)


def test_key_identity_and_repr(tmp_path: Path, key: FleetSigningKey) -> None:
    raw = base64.b64decode(key.public_key_b64)
    assert len(raw) == 32 and raw == key.public_key_raw
    assert key.key_id == hashlib.sha256(raw).hexdigest()[:16]
    assert key_id_for(key.public_key_b64) == key.key_id
    path = tmp_path / "fleet.pem"
    key.save(path)
    pem_body = "".join(path.read_text().splitlines()[1:-1])
    text = repr(key)
    assert text == f"FleetSigningKey(key_id={key.key_id!r})"
    assert pem_body not in text and pem_body[:16] not in text
    assert key.public_key_b64 not in text
    with pytest.raises(TypeError):
        pickle.dumps(key)


def test_sha256_file(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(os.urandom(3_000_000))
    assert sha256_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()


# --- signing and verifying ---------------------------------------------------------------


def test_sign_and_verify(key: FleetSigningKey) -> None:
    manifest = small_manifest()
    announcement = sign_manifest(manifest, key)
    assert announcement.key_id == key.key_id
    assert len(base64.b64decode(announcement.signature)) == 64
    assert verify_announcement(announcement, key.public_key_b64) == manifest
    raw = encode_message(announcement)
    assert canonical_manifest_bytes(manifest) in raw  # the wire carries the canonical form
    assert verify_manifest_bytes(raw, key.public_key_b64) == manifest
    decoded = decode_message(raw, ModelAnnouncement)
    assert decoded == announcement
    assert decode_any(raw) == announcement
    assert verify_announcement(decoded, key.public_key_b64) == manifest


@pytest.mark.parametrize("mask", [0x01, 0x20])
def test_any_changed_byte_of_an_announcement_is_refused(key: FleetSigningKey, mask: int) -> None:
    raw = encode_message(sign_manifest(small_manifest(), key))
    start = raw.index(canonical_manifest_bytes(small_manifest()))
    kinds: dict[str, int] = {}
    for position in range(len(raw)):
        damaged = bytearray(raw)
        damaged[position] ^= mask
        with pytest.raises(ContractError) as info:
            verify_manifest_bytes(bytes(damaged), key.public_key_b64)
        assert isinstance(info.value, MessageError | SignatureError)
        kinds[type(info.value).__name__] = kinds.get(type(info.value).__name__, 0) + 1
    # Flips inside the manifest that still parse are caught by the signature.
    assert kinds.get("SignatureError", 0) > 0
    assert start > 0


def test_every_flipped_signature_bit_is_refused(key: FleetSigningKey) -> None:
    announcement = sign_manifest(small_manifest(), key)
    signature = base64.b64decode(announcement.signature)
    for position in range(len(signature)):
        for bit in range(8):
            damaged = bytearray(signature)
            damaged[position] ^= 1 << bit
            forged = ModelAnnouncement(
                manifest=announcement.manifest,
                signature=base64.b64encode(damaged).decode(),
                key_id=announcement.key_id,
            )
            with pytest.raises(SignatureError, match="does not verify"):
                verify_announcement(forged, key.public_key_b64)


def test_every_flipped_manifest_byte_fails_the_signature(key: FleetSigningKey) -> None:
    """Sign the canonical bytes, change one byte, and splice them back into the wire form."""
    manifest = small_manifest()
    canonical = canonical_manifest_bytes(manifest)
    raw = encode_message(sign_manifest(manifest, key))
    start = raw.index(canonical)
    for position in range(len(canonical)):
        damaged = bytearray(raw)
        damaged[start + position] ^= 0x04
        with pytest.raises(ContractError):
            verify_manifest_bytes(bytes(damaged), key.public_key_b64)


def test_wrong_key_is_refused(key: FleetSigningKey, other_key: FleetSigningKey) -> None:
    announcement = sign_manifest(small_manifest(), key)
    with pytest.raises(SignatureError, match="trusts key"):
        verify_announcement(announcement, other_key.public_key_b64)
    # Signed by another key but claiming this fleet's key id.
    forged = ModelAnnouncement(
        manifest=announcement.manifest,
        signature=sign_manifest(small_manifest(), other_key).signature,
        key_id=key.key_id,
    )
    with pytest.raises(SignatureError, match="does not verify") as info:
        verify_announcement(forged, key.public_key_b64)
    assert info.value.__cause__ is not None  # cryptography's InvalidSignature, wrapped once


def test_changed_manifest_is_refused(key: FleetSigningKey) -> None:
    announcement = sign_manifest(small_manifest(), key)
    tampered = ModelAnnouncement(
        manifest=small_manifest(url="https://evil.example/model.onnx"),
        signature=announcement.signature,
        key_id=announcement.key_id,
    )
    with pytest.raises(SignatureError):
        verify_announcement(tampered, key.public_key_b64)


@pytest.mark.parametrize(
    ("signature", "match"),
    [
        ("not base64!", "not valid base64"),
        (base64.b64encode(b"x" * 63).decode(), "63 bytes"),
        (base64.b64encode(b"x" * 65).decode(), "65 bytes"),
        ("", "not valid base64|0 bytes"),
    ],
)
def test_malformed_signatures(key: FleetSigningKey, signature: str, match: str) -> None:
    announcement = sign_manifest(small_manifest(), key)
    forged = announcement.model_copy(update={"signature": signature})
    with pytest.raises(SignatureError, match=match):
        verify_announcement(forged, key.public_key_b64)


def test_non_canonical_base64_signature_is_refused(key: FleetSigningKey) -> None:
    announcement = sign_manifest(small_manifest(), key)
    text = announcement.signature
    assert text.endswith("==")  # 64 bytes: the last character carries 4 unused bits
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    last = alphabet.index(text[-3])
    same_bytes = text[:-3] + alphabet[last ^ 0x01] + "=="
    assert base64.b64decode(same_bytes) == base64.b64decode(text)
    forged = announcement.model_copy(update={"signature": same_bytes})
    with pytest.raises(SignatureError, match="not canonical"):
        verify_announcement(forged, key.public_key_b64)


@pytest.mark.parametrize(
    "public_key",
    ["", "abc", base64.b64encode(b"k" * 31).decode(), base64.b64encode(b"k" * 33).decode()],
)
def test_malformed_public_key_is_a_config_error(key: FleetSigningKey, public_key: str) -> None:
    announcement = sign_manifest(small_manifest(), key)
    with pytest.raises(ConfigError):
        verify_announcement(announcement, public_key)


def _announcement_bytes(manifest: dict[str, Any], key: FleetSigningKey, **dumps: Any) -> bytes:
    signature = base64.b64encode(key.sign(canonical_json(manifest))).decode()
    obj = {
        "schema": "edgeloop.model-announcement",
        "v": 1,
        "key_id": key.key_id,
        "signature": signature,
        "manifest": manifest,
    }
    return json.dumps(obj, ensure_ascii=False, **dumps).encode()


def test_fields_from_a_newer_cloud_still_verify(key: FleetSigningKey) -> None:
    manifest = json.loads(canonical_manifest_bytes(small_manifest()))
    manifest["quantization"] = {"scheme": "qdq", "per_channel": True}
    raw = _announcement_bytes(manifest, key, sort_keys=True, separators=(",", ":"))
    verified = verify_manifest_bytes(raw, key.public_key_b64)
    assert verified == small_manifest()
    # Re-encoding drops the unknown field, so the re-encoded form no longer verifies.
    with pytest.raises(SignatureError):
        verify_manifest_bytes(
            encode_message(decode_message(raw, ModelAnnouncement)), key.public_key_b64
        )


def test_manifest_not_in_canonical_form_is_refused(key: FleetSigningKey) -> None:
    manifest = json.loads(canonical_manifest_bytes(small_manifest()))
    raw = _announcement_bytes(manifest, key, indent=1)
    with pytest.raises(SignatureError, match="canonical form"):
        verify_manifest_bytes(raw, key.public_key_b64)
    # The signature itself is fine: it covers the content, not the layout.
    announcement = decode_message(raw, ModelAnnouncement)
    assert verify_announcement(announcement, key.public_key_b64) == small_manifest()


def test_other_messages_are_not_announcements(key: FleetSigningKey) -> None:
    raw = encode_message(sign_manifest(small_manifest(), key))
    obj = json.loads(raw)
    obj["schema"] = "edgeloop.sample"
    with pytest.raises(UnknownSchemaError):
        verify_manifest_bytes(json.dumps(obj).encode(), key.public_key_b64)


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.binary(max_size=400))
def test_garbage_announcements_only_raise_contract_errors(
    key: FleetSigningKey, data: bytes
) -> None:
    with pytest.raises(ContractError):
        verify_manifest_bytes(data, key.public_key_b64)


def test_a_manifest_names_its_task_and_an_agent_refuses_another_or_an_unknown_one() -> None:
    def refusal(manifest: ModelManifest, task: str | None) -> str | None:
        found = agent_refusal(
            manifest, input_hw=(2, 2), max_opset=21, runtime_version="1.20.0", task=task
        )
        return None if found is None else found[0]

    plain = small_manifest(input={**manifest_fields()["input"], "name": "frames"})
    assert plain.task is None  # a manifest from before tasks: its bytes leave it out
    assert b'"task"' not in canonical_manifest_bytes(plain)
    assert refusal(plain, None) is None
    assert refusal(plain, "classification") is None
    detector = plain.model_copy(update={"task": "detection", "output_name": "detections"})
    assert refusal(detector, "classification") == "incompatible_task"
    assert refusal(detector, "detection") is None
    # A detector's output is its task's, not a classifier's.
    misnamed = plain.model_copy(update={"task": "detection"})
    assert refusal(misnamed, "detection") == "incompatible_input"
    segmenter = plain.model_copy(update={"task": "segmentation"})
    assert refusal(segmenter, "classification") == "unsupported_task"  # unknown here
    classifier = plain.model_copy(update={"task": "classification"})
    assert refusal(classifier, "classification") is None
    with pytest.raises(ValidationError):
        small_manifest(task="Not A Task!")
