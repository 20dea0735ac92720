"""Model manifests, their canonical bytes, and ed25519 fleet signatures.

A manifest names one model artifact and everything an agent checks before it
installs it (docs/architecture.md, "Model artifacts"). The cloud signs the manifest's
canonical bytes with the fleet's private key; an agent verifies them against the
public key it was enrolled with.

Canonical bytes: the manifest as JSON with sorted keys, separators ``,`` and
``:``, no ASCII escaping, UTF-8, field aliases, ``None`` fields left out,
timestamps as ISO 8601 UTC with ``Z`` and numbers as Python's ``json`` writes
them. ``encode_message`` writes an announcement's manifest in exactly this form,
and ``verify_manifest_bytes`` requires it, so changing any byte of a received
announcement makes it fail.

Signatures cover the manifest object as received, not this receiver's parsed view
of it, so a manifest with fields added by a newer cloud still verifies here. The
announcement that carries a manifest and its signature is a message:
``sign_manifest``, ``verify_announcement`` and ``verify_manifest_bytes`` live in
``shared.messages``, which imports this module (never the other way round).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from shared.errors import ConfigError, EdgeLoopError, SignatureError
from shared.ids import UtcDatetime
from shared.tasks import Task, task_for
from shared.topics import validate_id

__all__ = [
    "FleetSigningKey",
    "GoldenCase",
    "InputSpec",
    "ModelCard",
    "ModelManifest",
    "ModelSource",
    "agent_refusal",
    "canonical_json",
    "canonical_manifest_bytes",
    "key_id_for",
    "sha256_file",
    "verify_manifest_signature",
    "version_tuple",
]

# Frozen, finite floats, and unknown fields ignored: a newer sender may add
# optional fields without a new major version, and an older receiver keeps working.
# Announcements are decoded with strict=True (no "3" for 3, no numbers for times).
_CONFIG = ConfigDict(
    frozen=True,
    extra="ignore",
    populate_by_name=True,
    protected_namespaces=(),
    allow_inf_nan=False,
)

_VERSION_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_RUNTIME_RE = re.compile(r"[0-9]{1,6}(\.[0-9]{1,6}){0,3}")
_AXIS_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")
_URL_RE = re.compile(r"(https?://[^\s/]+)?/\S*")
_SIGNATURE_BYTES = 64
_PUBLIC_KEY_BYTES = 32


def _pydantic_check(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Adapt a validator that raises our errors to pydantic, which wants ValueError."""

    def run(value: Any) -> Any:
        try:
            return check(value)
        except EdgeLoopError as exc:
            raise ValueError(exc.message) from None

    return run


def _check_version(value: str) -> str:
    if not _VERSION_RE.fullmatch(value):
        raise ValueError(
            "version must be 1-64 characters of a-z, 0-9, '.', '_' and '-',"
            " starting with a letter or digit"
        )
    return value


def _check_text(value: str) -> str:
    if any(ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F for ch in value):
        raise ValueError("text must not contain control characters")
    return value


def _check_b64(value: str) -> str:
    _strict_b64decode(value)  # raises ValueError
    return value


ModelName = Annotated[str, AfterValidator(_pydantic_check(lambda v: validate_id(v, "model")))]
FleetName = Annotated[str, AfterValidator(_pydantic_check(lambda v: validate_id(v, "fleet")))]
AgentName = Annotated[str, AfterValidator(_pydantic_check(lambda v: validate_id(v, "agent")))]
Version = Annotated[str, AfterValidator(_check_version)]
Text = Annotated[str, Field(min_length=1, max_length=128), AfterValidator(_check_text)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


def _strict_b64decode(value: str) -> bytes:
    """Decode standard base64, refusing any text but the one canonical encoding."""
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not valid base64") from None
    if base64.b64encode(raw).decode("ascii") != value:
        raise ValueError("not canonical base64")
    return raw


class InputSpec(BaseModel):
    """The model input: name, shape (dynamic axes named), dtype, layout, preprocessing.

    Preprocessing per channel: ``(pixel * scale - mean) / std``.
    """

    model_config = _CONFIG

    name: Text
    shape: list[Annotated[int, Field(ge=1, le=2**31 - 1)] | str] = Field(min_length=1, max_length=8)
    dtype: Literal["uint8", "int8", "float16", "float32"]
    layout: Literal["NHWC", "NCHW"] = "NHWC"
    color: Literal["RGB", "BGR", "GRAY"] = "RGB"
    mean: list[FiniteFloat] = Field(default_factory=lambda: [0.0, 0.0, 0.0], max_length=4)
    std: list[Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(
        default_factory=lambda: [1.0, 1.0, 1.0], max_length=4
    )
    scale: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0

    @model_validator(mode="after")
    def _check(self) -> InputSpec:
        for axis in self.shape:
            if isinstance(axis, str) and not _AXIS_RE.fullmatch(axis):
                raise ValueError(f"dynamic axis name {axis!r} is not an identifier")
        if not self.mean or len(self.mean) != len(self.std):
            raise ValueError("mean and std need one value per channel, the same number of each")
        return self


class GoldenCase(BaseModel):
    """A golden input (raw uint8 array, base64) and what the model must answer for it:
    one row per input, as the manifest's task writes it (``Task.golden_rows``)."""

    model_config = _CONFIG

    input: Annotated[str, AfterValidator(_check_b64)]
    shape: list[Annotated[int, Field(ge=1)]] = Field(min_length=1, max_length=8)
    expected: list[list[FiniteFloat]] = Field(min_length=1, max_length=64)
    atol: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1e-3

    @model_validator(mode="after")
    def _check(self) -> GoldenCase:
        if len(self.input_bytes()) != math.prod(self.shape):
            raise ValueError(
                f"input holds {len(self.input_bytes())} bytes but shape {self.shape}"
                f" needs {math.prod(self.shape)}"
            )
        if len(self.expected) != self.shape[0]:
            raise ValueError("expected needs one row of scores per input in the batch")
        return self

    def input_bytes(self) -> bytes:
        """The raw uint8 input array, in row-major order."""
        return base64.b64decode(self.input)


class ModelSource(BaseModel):
    """Where an imported model came from and the preprocessing wrapped in front of it.

    ``input`` is the original graph's input as the user described it (its name, dtype,
    layout, size and ``(pixel * scale - mean) / std``); the wrapped model takes camera
    bytes and applies exactly that in its graph.
    """

    model_config = _CONFIG

    file: Text
    sha256: Annotated[str, Field(pattern=f"^{_SHA256_RE.pattern}$")]
    input: InputSpec
    output_name: Text
    outputs: Literal["logits", "probabilities"]


class ModelCard(BaseModel):
    """The JSON written beside an imported model: its contract, labels and origin."""

    model_config = _CONFIG

    name: ModelName
    version: Version
    role: Literal["teacher", "student"]
    sha256: Annotated[str, Field(pattern=f"^{_SHA256_RE.pattern}$")]
    input: InputSpec
    output_name: Text
    scores: Literal["probabilities"] = "probabilities"
    labels: list[Text] = Field(min_length=2, max_length=1000)
    opset: Annotated[int, Field(ge=1, le=1000)]
    source: ModelSource
    created_at: UtcDatetime


class ModelManifest(BaseModel):
    """What an announcement says about one model artifact."""

    model_config = _CONFIG

    name: ModelName
    version: Version
    format: Literal["fp32", "int8"]
    sha256: Annotated[str, Field(pattern=f"^{_SHA256_RE.pattern}$")]
    size_bytes: Annotated[int, Field(gt=0)]
    url: Annotated[str, Field(min_length=1, max_length=2048, pattern=f"^{_URL_RE.pattern}$")]
    input: InputSpec
    output_name: Text
    labels: list[Text] = Field(min_length=2, max_length=1000)
    opset: Annotated[int, Field(ge=1, le=1000)]
    min_runtime_version: Annotated[str, Field(pattern=f"^{_RUNTIME_RE.pattern}$")]
    golden: list[GoldenCase] = Field(min_length=1, max_length=16)
    created_at: UtcDatetime
    parent_version: Version | None = None
    metrics: dict[Annotated[str, Field(min_length=1, max_length=64)], FiniteFloat] = Field(
        default_factory=dict, max_length=64
    )
    # An imported model's origin and wrapped preprocessing; absent for models trained
    # here (left out of the canonical bytes when None, so older manifests verify as before).
    source: ModelSource | None = None
    # Freshness, set when the cloud announces (not when it registers) and covered by the
    # signature: ``sequence`` grows with every announcement of the fleet, ``expires_at``
    # bounds how long a retained copy may be acted on, and ``fleet``/``agent`` name whom
    # it is for (``agent`` only on per-agent announcements). An agent refuses a sequence
    # not above the highest it accepted for that topic, a past expiry, another audience.
    sequence: Annotated[int, Field(ge=1, le=2**63 - 1)] | None = None
    expires_at: UtcDatetime | None = None
    fleet: FleetName | None = None
    agent: AgentName | None = None
    # What the model answers (shared.tasks); None is classification, left out of the
    # canonical bytes so manifests from before tasks verify as before.
    task: (
        Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z][a-z0-9_-]*$")] | None
    ) = None

    @model_validator(mode="after")
    def _check(self) -> ModelManifest:
        if len(set(self.labels)) != len(self.labels):
            raise ValueError("labels must be unique")
        try:
            task: Task | None = task_for(self.task)
        except ValueError:  # an unknown task is agent_refusal's to name (unsupported_task)
            task = None
        for index, case in enumerate(self.golden):
            if len(case.shape) != len(self.input.shape):
                raise ValueError(f"golden[{index}] has shape {case.shape}, not the input's rank")
            for axis, (got, want) in enumerate(zip(case.shape, self.input.shape, strict=True)):
                if isinstance(want, int) and got != want:
                    raise ValueError(
                        f"golden[{index}] axis {axis} is {got}, the input needs {want}"
                    )
            for row in case.expected:
                if task is None:
                    break
                try:
                    task.check_golden_width(len(row), len(self.labels))
                except ValueError as exc:
                    raise ValueError(f"golden[{index}] expects {exc}") from None
        return self


def version_tuple(text: str) -> tuple[int, ...]:
    """The leading numeric parts of a version string: '1.18.0rc1' -> (1, 18, 0)."""
    parts = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts)


def agent_refusal(
    manifest: ModelManifest,
    *,
    input_hw: tuple[int, int],
    max_opset: int,
    runtime_version: str,
    task: str | None = None,
) -> tuple[str, str] | None:
    """Why an agent would refuse ``manifest``, as (reason slug, message); None if it would not.

    The agent feeds uint8 NHWC frames of ``input_hw`` (its serving model's size) and runs
    onnxruntime ``runtime_version``, which runs ai.onnx opsets up to ``max_opset``. The
    agent applies this before it downloads; the registry applies it to the agents'
    heartbeats before it accepts or announces a version. ``task`` is the serving model's
    task, when known: a model of another task (or of one this code does not know) is
    refused before anything is fetched.
    """
    try:
        offered = task_for(manifest.task).name
    except ValueError as exc:
        return ("unsupported_task", str(exc))
    if task is not None and offered != task_for(task).name:
        return (
            "incompatible_task",
            f"model answers the {offered} task; the agent serves a {task_for(task).name} model",
        )
    if manifest.opset > max_opset:
        return (
            "incompatible_opset",
            f"model needs opset {manifest.opset}; onnxruntime {runtime_version} runs up to"
            f" {max_opset}",
        )
    if version_tuple(runtime_version) < version_tuple(manifest.min_runtime_version):
        return (
            "incompatible_runtime",
            f"model needs onnxruntime {manifest.min_runtime_version} or newer; the agent has"
            f" {runtime_version}",
        )
    spec = manifest.input
    expected = f"[batch, {input_hw[0]}, {input_hw[1]}, 3]"
    shape_ok = len(spec.shape) == 4 and spec.shape[1:] == [input_hw[0], input_hw[1], 3]
    if spec.dtype != "uint8" or spec.layout != "NHWC" or not shape_ok:
        return (
            "incompatible_input",
            f"model takes {spec.dtype} {spec.layout} [{', '.join(map(str, spec.shape))}];"
            f" the agent feeds uint8 NHWC {expected}",
        )
    output = task_for(manifest.task).output_name
    if spec.name != "frames" or manifest.output_name != output:
        return (
            "incompatible_input",
            f"model's tensors are {spec.name!r} -> {manifest.output_name!r};"
            f" the student contract is 'frames' -> {output!r}",
        )
    return None


def canonical_json(value: Any) -> bytes:
    """JSON-compatible ``value`` as canonical bytes: sorted keys, compact, UTF-8."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def canonical_manifest_bytes(manifest: ModelManifest) -> bytes:
    """The bytes a manifest's signature covers; the same in every process."""
    return canonical_json(manifest.model_dump(mode="json", by_alias=True, exclude_none=True))


def _key_id(public_raw: bytes) -> str:
    return hashlib.sha256(public_raw).hexdigest()[:16]


def _public_key_bytes(public_key_b64: str) -> bytes:
    try:
        raw = _strict_b64decode(public_key_b64)
    except (ValueError, TypeError):
        raw = b""
    if len(raw) != _PUBLIC_KEY_BYTES:
        raise ConfigError(
            "fleet public key is not valid: expected the base64 of a raw 32-byte ed25519 key"
        )
    return raw


def key_id_for(public_key_b64: str) -> str:
    """The key id (16 hex digits of the key's sha256) of a base64 ed25519 public key."""
    return _key_id(_public_key_bytes(public_key_b64))


class FleetSigningKey:
    """A fleet's ed25519 private key, which signs model manifests."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self._public_raw = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @classmethod
    def generate(cls) -> FleetSigningKey:
        """A new random key."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> FleetSigningKey:
        """Read a key saved by ``save`` (unencrypted PKCS#8 PEM)."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read the fleet signing key {path}: {exc.strerror}") from exc
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise ConfigError(f"{path} is not an unencrypted PEM (PKCS#8) private key") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"{path} holds a {type(key).__name__}, not an ed25519 key")
        return cls(key)

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the key as PKCS#8 PEM, readable by the owner only (mode 0600)."""
        path = Path(path)
        if path.exists() and not overwrite:
            # Replacing a fleet key locks out every agent enrolled with the old one.
            raise ConfigError(f"{path} exists; pass overwrite=True to replace the fleet key")
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = self._private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # mkstemp creates the file with mode 0600, so the key is never readable by
        # others, not even between the write and the rename.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(pem)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @property
    def public_key_raw(self) -> bytes:
        """The raw 32-byte public key."""
        return self._public_raw

    @property
    def public_key_b64(self) -> str:
        """The public key as base64 of its raw 32 bytes (what agents are enrolled with)."""
        return base64.b64encode(self._public_raw).decode("ascii")

    @property
    def key_id(self) -> str:
        """The first 16 hex digits of the sha256 of the raw public key."""
        return _key_id(self._public_raw)

    def sign(self, data: bytes) -> bytes:
        """The 64-byte ed25519 signature of ``data``."""
        return self._private_key.sign(data)

    def __repr__(self) -> str:
        return f"FleetSigningKey(key_id={self.key_id!r})"

    def __reduce__(self) -> Any:
        # Keep private keys out of pickles (multiprocessing, caches) by accident.
        raise TypeError("FleetSigningKey cannot be pickled; save() it to a file instead")


def verify_manifest_signature(
    manifest: ModelManifest,
    signed: bytes,
    *,
    signature: str,
    key_id: str,
    public_key_b64: str,
) -> ModelManifest:
    """Return ``manifest`` if ``signature`` (base64, made with key ``key_id``) over the
    ``signed`` bytes verifies against the fleet's public key, else raise SignatureError.

    A malformed ``public_key_b64`` is this receiver's configuration, so ConfigError.
    """
    public_raw = _public_key_bytes(public_key_b64)
    trusted_id = _key_id(public_raw)
    if key_id != trusted_id:
        raise SignatureError(
            f"announcement is signed with key {key_id[:32]!r}, but this fleet"
            f" trusts key {trusted_id!r}"
        )
    try:
        raw_signature = _strict_b64decode(signature)
    except ValueError as exc:
        raise SignatureError(f"announcement signature is {exc}") from None
    if len(raw_signature) != _SIGNATURE_BYTES:
        raise SignatureError(
            f"announcement signature has {len(raw_signature)} bytes; ed25519 signatures have 64"
        )
    try:
        Ed25519PublicKey.from_public_bytes(public_raw).verify(raw_signature, signed)
    except InvalidSignature as exc:
        raise SignatureError(
            f"signature of model {manifest.name} {manifest.version}"
            " does not verify against the fleet key"
        ) from exc
    return manifest


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's contents, as 64 lowercase hex digits."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
