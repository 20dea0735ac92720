"""The JSON messages that travel over MQTT, and how they are encoded and checked.

Every message carries ``schema`` (its name, such as ``edgeloop.sample``) and ``v``
(an integer major version). ``decode_message`` refuses, in this order and before
pydantic runs: an oversized payload, bytes that are not a JSON object, another or
a missing ``schema``, a ``v`` that is not an integer, and a ``v`` newer than this
receiver's; then the fields are validated.

Choices worth knowing:

* Unknown fields are ignored, not refused, so a sender may add optional fields
  within a major version and older receivers keep working. A change that older
  receivers would misread bumps ``v``. Re-encoding a decoded message drops the
  fields this receiver does not know; forward the bytes as received instead.
* Decoding is strict: no ``"3"`` for 3, no ``true`` for 1, no numbers for
  timestamps. Building a message in code is lax (numpy scalars and arrays are
  accepted and converted). Floats must be finite; timestamps need a time zone
  and are kept in UTC.
* Scores and confidences are carried with ``SCORE_DIGITS`` (4) significant
  digits, a relative error of at most 5e-4: enough to rank classes, compute
  margins and calibration, and to show; full-precision scores stay where they
  were computed. Ten scores at float64 precision would take ~200 bytes of a
  ~500-byte sample header; at four digits they take ~80. Values are rounded when
  a message is built, so decoding an encoded message gives an equal message.
* Encoding is compact JSON with sorted keys, UTF-8, aliases (``schema``), and
  ``None`` fields left out; the same function gives a manifest's canonical bytes
  (``shared.manifest``).

Constructing a message in code with bad values raises pydantic's
``ValidationError`` (a programming error); only untrusted input through
``decode_message``/``decode_any`` is turned into ``MessageError``.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from shared.errors import (
    ContractError,
    MessageError,
    MessageValidationError,
    SignatureError,
    UnknownSchemaError,
    UnsupportedVersionError,
)
from shared.ids import UtcDatetime
from shared.manifest import (
    FleetSigningKey,
    ModelManifest,
    canonical_json,
    canonical_manifest_bytes,
    verify_manifest_signature,
)
from shared.message_fields import (
    SCORE_DIGITS,
    AgentId,
    Boxes,
    Confidence,
    Count,
    Dimension,
    FleetId,
    NonNegative,
    Rate,
    SampleId,
    Scores,
    ShortText,
    check_answer,
)

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_VERDICTS_PER_MESSAGE",
    "MESSAGE_TYPES",
    "SCORE_DIGITS",
    "AgentStatus",
    "Message",
    "MessageData",
    "ModelAnnouncement",
    "ModelStatus",
    "Receipt",
    "RouteReason",
    "SampleHeader",
    "Verdict",
    "Verdicts",
    "decode_any",
    "decode_message",
    "decode_verdicts",
    "encode_message",
    "encode_verdicts",
    "sign_manifest",
    "verify_announcement",
    "verify_manifest_bytes",
]

DEFAULT_MAX_MESSAGE_BYTES = 65536
M = TypeVar("M", bound="Message")
# What decode_message reads: JSON as bytes or text, or an already parsed object.
MessageData = bytes | bytearray | memoryview | str | Mapping[str, Any]

# Frozen; finite floats; unknown fields ignored (see the module docstring). Not
# strict here: decode_message validates with strict=True, code may pass numpy values.
_CONFIG = ConfigDict(
    frozen=True,
    extra="ignore",
    populate_by_name=True,
    protected_namespaces=(),
    allow_inf_nan=False,
)

RouteReason = Literal[
    "low_confidence",
    "margin",
    "entropy",
    "class_threshold",
    "mean_score",
    "low_score_share",
    "near_threshold",
    "box_count",
    "empty_audit",
    "audit",
    "manual",
]


class Message(BaseModel):
    """Base of every message: ``schema`` (name) and ``v`` (major version), filled in by default."""

    model_config = _CONFIG

    SCHEMA: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1

    schema_name: str = Field(default="", alias="schema")
    v: int = 0

    @model_validator(mode="before")
    @classmethod
    def _fill_schema_and_version(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            has_schema = "schema" in data or "schema_name" in data
            if not has_schema or "v" not in data:
                data = dict(data)
                if not has_schema:
                    data["schema"] = cls.SCHEMA
                data.setdefault("v", cls.VERSION)
        return data

    @field_validator("schema_name")
    @classmethod
    def _check_schema(cls, value: str) -> str:
        if value != cls.SCHEMA:
            raise ValueError(f"schema must be {cls.SCHEMA!r}")
        return value

    @field_validator("v")
    @classmethod
    def _check_v(cls, value: int) -> int:
        if not 1 <= value <= cls.VERSION:
            raise ValueError(f"v must be between 1 and {cls.VERSION}")
        return value


class SampleHeader(Message):
    """What the cloud needs to know about a sample, sent ahead of its image bytes."""

    SCHEMA: ClassVar[str] = "edgeloop.sample"
    VERSION: ClassVar[int] = 1

    sample_id: SampleId
    fleet: FleetId
    agent: AgentId
    captured_at: UtcDatetime
    model_name: ShortText
    model_version: ShortText
    scores: Scores
    predicted: Count
    confidence: Confidence
    boxes: Boxes | None = None  # a detector's answer (shared.tasks.detection)
    route_reason: RouteReason
    priority: Annotated[int, Field(ge=0, le=9)] = 5
    image_format: Literal["jpeg", "png"]
    image_width: Dimension
    image_height: Dimension
    image_bytes: Annotated[int, Field(ge=1)]
    meta: dict[
        Annotated[str, Field(min_length=1, max_length=256)],
        Annotated[str, Field(max_length=256)],
    ] = Field(default_factory=dict, max_length=16)

    @model_validator(mode="after")
    def _check_predicted(self) -> SampleHeader:
        check_answer(self.scores, self.predicted, self.boxes, "predicted")
        return self


class Receipt(Message):
    """The cloud has durably stored these samples; the agent may drop them from its spool."""

    SCHEMA: ClassVar[str] = "edgeloop.receipt"
    VERSION: ClassVar[int] = 1

    sample_ids: list[SampleId] = Field(min_length=1, max_length=1000)
    stored_at: UtcDatetime


class Verdict(Message):
    """The teacher's answer for one sample."""

    SCHEMA: ClassVar[str] = "edgeloop.verdict"
    VERSION: ClassVar[int] = 1

    sample_id: SampleId
    fleet: FleetId
    agent: AgentId
    teacher_model: ShortText
    teacher_version: ShortText
    scores: Scores
    label: Count
    confidence: Confidence
    boxes: Boxes | None = None  # the teacher detector's answer (shared.tasks.detection)
    agrees_with_edge: bool
    review: bool = False
    review_reasons: list[ShortText] = Field(default_factory=list, max_length=16)
    verified_at: UtcDatetime

    @model_validator(mode="after")
    def _check_label(self) -> Verdict:
        check_answer(self.scores, self.label, self.boxes, "label")
        return self


MAX_VERDICTS_PER_MESSAGE = 1000


class Verdicts(Message):
    """Several verdicts for one agent in one message (the verifier sends the verdicts
    it has for an agent at once: one publish and one acknowledgement instead of one
    per sample). Each element is a whole ``edgeloop.verdict``."""

    SCHEMA: ClassVar[str] = "edgeloop.verdicts"
    VERSION: ClassVar[int] = 1

    verdicts: list[Verdict] = Field(min_length=1, max_length=MAX_VERDICTS_PER_MESSAGE)

    @model_validator(mode="after")
    def _one_agent(self) -> Verdicts:
        first = self.verdicts[0]
        for verdict in self.verdicts[1:]:
            if (verdict.fleet, verdict.agent) != (first.fleet, first.agent):
                raise ValueError(
                    f"verdicts for {verdict.fleet}/{verdict.agent} and {first.fleet}/"
                    f"{first.agent} in one message: a message carries one agent's verdicts"
                )
        return self


class AgentStatus(Message):
    """An agent's heartbeat and telemetry (retained), or its last will ("offline")."""

    SCHEMA: ClassVar[str] = "edgeloop.status"
    VERSION: ClassVar[int] = 1

    fleet: FleetId
    agent: AgentId
    state: Literal["online", "offline"]
    sent_at: UtcDatetime
    model_version: ShortText | None = None
    provider: ShortText | None = None
    frames_per_s: NonNegative | None = None
    latency_p50_ms: NonNegative | None = None
    latency_p99_ms: NonNegative | None = None
    forward_rate: Rate | None = None
    spool_depth: Count | None = None
    dropped_frames: Count | None = None
    agreement_rate: Rate | None = None
    cpu_percent: NonNegative | None = None
    memory_mb: NonNegative | None = None
    gpu: dict[Annotated[str, Field(min_length=1, max_length=64)], float] | None = Field(
        default=None, max_length=16
    )
    # What the agent would install (shared.manifest.agent_refusal): the registry checks
    # a version against these before it accepts or announces it.
    model_name: ShortText | None = None
    input_hw: list[Dimension] | None = Field(default=None, min_length=2, max_length=2)
    runtime_version: ShortText | None = None
    max_opset: Annotated[int, Field(ge=1, le=1000)] | None = None


class ModelStatus(Message):
    """One step of a model update on an agent."""

    SCHEMA: ClassVar[str] = "edgeloop.model-status"
    VERSION: ClassVar[int] = 1

    fleet: FleetId
    agent: AgentId
    model_name: ShortText
    model_version: ShortText
    state: Literal["downloaded", "verified", "active", "rejected", "rolled-back"]
    reason: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    at: UtcDatetime


class ModelAnnouncement(Message):
    """A signed model manifest, retained on a fleet's or an agent's models topic."""

    SCHEMA: ClassVar[str] = "edgeloop.model-announcement"
    VERSION: ClassVar[int] = 1

    manifest: ModelManifest
    signature: Annotated[str, Field(min_length=1, max_length=256)]
    key_id: Annotated[str, Field(min_length=1, max_length=64)]

    # The bytes the signature covers: the manifest object as received (unknown
    # fields included), else this manifest's canonical bytes.
    _signed: bytes = PrivateAttr(default=b"")

    @model_validator(mode="wrap")
    @classmethod
    def _keep_signed_bytes(
        cls, data: Any, handler: ModelWrapValidatorHandler[ModelAnnouncement]
    ) -> ModelAnnouncement:
        announcement = handler(data)
        raw = data.get("manifest") if isinstance(data, Mapping) else None
        signed = None
        if isinstance(raw, Mapping):
            try:
                signed = canonical_json(raw)
            except UnicodeEncodeError:
                raise ValueError("manifest holds text that is not valid Unicode") from None
            except (TypeError, ValueError):
                signed = None  # not JSON data (a model_dump in Python mode): use the model
        announcement._signed = signed or canonical_manifest_bytes(announcement.manifest)
        return announcement

    def signed_bytes(self) -> bytes:
        """The bytes the signature covers."""
        return self._signed


MESSAGE_TYPES: Mapping[str, type[Message]] = MappingProxyType(
    {
        cls.SCHEMA: cls
        for cls in (
            SampleHeader,
            Receipt,
            Verdict,
            Verdicts,
            AgentStatus,
            ModelStatus,
            ModelAnnouncement,
        )
    }
)

# A JSON "\ud800"-style escape can decode to a lone surrogate, which no UTF-8
# encoder accepts; such text is refused at the door rather than when re-encoded.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def encode_message(message: Message) -> bytes:
    """A message as compact UTF-8 JSON (sorted keys, aliases, no None fields).

    An announcement is canonical_json: its manifest must arrive in the canonical form
    its signature covers (``verify_manifest_bytes``). Every other message is written
    by orjson: the same values and the same layout (sorted keys, compact, UTF-8), a
    small number's exponent perhaps written otherwise ("1e-7" for "1e-07"), two to
    three times faster (a sample header, a verdict batch: the hot paths).
    """
    fields = message.model_dump(mode="json", by_alias=True, exclude_none=True)
    if isinstance(message, ModelAnnouncement):
        return canonical_json(fields)
    try:
        return orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError as exc:  # text that is not valid Unicode, say
        raise ContractError(f"cannot encode a {message.SCHEMA} message: {exc}") from None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 70 else text[:70] + "..."


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def _load_object(data: MessageData, max_bytes: int) -> dict[str, Any]:
    """Return the JSON object in ``data``, checking its size first."""
    if isinstance(data, Mapping):
        return dict(data)
    if isinstance(data, str):
        raw: bytes | bytearray | memoryview = data.encode("utf-8", "surrogatepass")
    elif isinstance(data, (bytes, bytearray, memoryview)):
        raw = data
    else:
        raise MessageValidationError(f"expected JSON bytes, got {type(data).__name__}")
    size = raw.nbytes if isinstance(raw, memoryview) else len(raw)
    if size > max_bytes:
        raise MessageError(
            f"message of {size} bytes is over the limit of {max_bytes}", reason="too_large"
        )
    try:
        # orjson refuses what the checks below refuse (bad UTF-8, lone surrogates,
        # non-finite numbers, absurd nesting) in a fifth of their time, and what it
        # refuses goes through them for their exact words. It reads an integer past
        # 64 bits as a float, which strict validation refuses where an integer is due.
        fast = orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    else:
        if not isinstance(fast, dict):
            raise MessageValidationError(f"message is JSON {type(fast).__name__}, not an object")
        return fast
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MessageValidationError(f"message is not UTF-8 (byte {exc.start})") from None
    try:
        obj = json.loads(text, parse_constant=_refuse_constant)
        if _SURROGATE_ESCAPE.search(text):
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except json.JSONDecodeError as exc:
        raise MessageValidationError(
            f"message is not valid JSON: {exc.msg} at character {exc.pos}"
        ) from None
    except UnicodeEncodeError:
        raise MessageValidationError("message holds text that is not valid Unicode") from None
    except (ValueError, RecursionError) as exc:
        # Non-finite constants, integers too long to convert, absurd nesting.
        raise MessageValidationError(f"message is not acceptable JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise MessageValidationError(f"message is JSON {type(obj).__name__}, not an object")
    return obj


def _check_version(obj: Mapping[str, Any], cls: type[Message]) -> None:
    v = obj.get("v")
    if type(v) is not int:  # bool is an int subclass; refuse it too
        raise MessageValidationError(f"{cls.SCHEMA} message needs an integer 'v', got {_shown(v)}")
    if v > cls.VERSION:
        raise UnsupportedVersionError(
            f"{cls.SCHEMA} version {v} is newer than this receiver supports"
            f" (newest supported: {cls.VERSION})"
        )
    if v < 1:
        raise MessageValidationError(f"{cls.SCHEMA} version {v} is not valid: versions start at 1")


def _validate(obj: Mapping[str, Any], cls: type[M]) -> M:
    try:
        return cls.model_validate(obj, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        parts = [
            f"{'.'.join(str(p) for p in err['loc']) or '(message)'}: {err['msg']}"
            for err in errors[:3]
        ]
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise MessageValidationError(
            f"{cls.SCHEMA} message is not valid: {'; '.join(parts)}{more}"
        ) from exc


def decode_message(
    data: MessageData,
    expected: type[M],
    *,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> M:
    """Decode and check one message of the ``expected`` type; raise MessageError if unfit.

    ``data`` is JSON (bytes or text, at most ``max_bytes`` as UTF-8) or an already
    parsed mapping, which is taken as is (no size check).
    """
    obj = _load_object(data, max_bytes)
    received = obj.get("schema")
    if received != expected.SCHEMA:
        if "schema" not in obj:
            raise UnknownSchemaError(f"message has no 'schema'; expected {expected.SCHEMA!r}")
        raise UnknownSchemaError(
            f"expected schema {expected.SCHEMA!r}, received {_shown(received)}"
        )
    _check_version(obj, expected)
    return _validate(obj, expected)


def decode_any(data: MessageData, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Decode a message of any known schema; raise MessageError if unfit."""
    obj = _load_object(data, max_bytes)
    received = obj.get("schema")
    cls = MESSAGE_TYPES.get(received) if isinstance(received, str) else None
    if cls is None:
        raise UnknownSchemaError(
            f"unknown schema {_shown(received)}; known: {', '.join(sorted(MESSAGE_TYPES))}"
        )
    _check_version(obj, cls)
    return _validate(obj, cls)


def decode_verdicts(
    data: MessageData, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> list[Verdict]:
    """The verdicts in a message on an agent's verdict topic: an ``edgeloop.verdicts``
    batch or a single ``edgeloop.verdict`` (as verifiers before batches, or with
    ``verdicts_per_message`` 1, send them); raise MessageError if unfit."""
    obj = _load_object(data, max_bytes)
    if obj.get("schema") == Verdicts.SCHEMA:
        _check_version(obj, Verdicts)
        return list(_validate(obj, Verdicts).verdicts)
    return [decode_message(obj, Verdict)]


def encode_verdicts(
    verdicts: Sequence[Verdict],
    *,
    per_message: int,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> list[tuple[str, str, bytes]]:
    """Messages for ``verdicts``, as (fleet, agent, payload): each agent's verdicts in
    ``edgeloop.verdicts`` batches of at most ``per_message`` verdicts and ``max_bytes``
    bytes, in order; ``per_message`` 1 sends each as a single ``edgeloop.verdict``."""
    by_agent: dict[tuple[str, str], list[Verdict]] = {}
    for verdict in verdicts:
        by_agent.setdefault((verdict.fleet, verdict.agent), []).append(verdict)
    out: list[tuple[str, str, bytes]] = []
    for (fleet, agent), own in by_agent.items():
        if per_message <= 1:
            out.extend((fleet, agent, encode_message(v)) for v in own)
            continue
        chunks = [own[i : i + per_message] for i in range(0, len(own), per_message)]
        while chunks:
            chunk = chunks.pop(0)
            payload = encode_message(Verdicts(verdicts=chunk))
            if len(payload) > max_bytes and len(chunk) > 1:
                half = len(chunk) // 2  # too large (a detector's boxes): split in two
                chunks[:0] = [chunk[:half], chunk[half:]]
                continue
            out.append((fleet, agent, payload))
    return out


def sign_manifest(manifest: ModelManifest, key: FleetSigningKey) -> ModelAnnouncement:
    """An announcement of ``manifest`` signed with the fleet key."""
    signature = key.sign(canonical_manifest_bytes(manifest))
    return ModelAnnouncement(
        manifest=manifest,
        signature=base64.b64encode(signature).decode("ascii"),
        key_id=key.key_id,
    )


def verify_announcement(announcement: ModelAnnouncement, public_key_b64: str) -> ModelManifest:
    """Return the manifest if the announcement's signature is valid, else raise SignatureError.

    A malformed ``public_key_b64`` is this receiver's configuration, so ConfigError.
    """
    return verify_manifest_signature(
        announcement.manifest,
        announcement.signed_bytes(),
        signature=announcement.signature,
        key_id=announcement.key_id,
        public_key_b64=public_key_b64,
    )


def verify_manifest_bytes(
    raw_announcement: bytes, public_key_b64: str, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> ModelManifest:
    """Decode an announcement as received and verify it; raises MessageError or SignatureError."""
    raw = bytes(raw_announcement)
    announcement = decode_message(raw, ModelAnnouncement, max_bytes=max_bytes)
    manifest = verify_announcement(announcement, public_key_b64)
    # The signature covers the manifest's parsed content; requiring its canonical
    # form on the wire also refuses byte changes that parse to the same content
    # ("1E-05" for "1e-05", a lowercase "z" in a timestamp).
    if announcement.signed_bytes() not in raw:
        raise SignatureError("announcement's manifest is not in canonical form")
    return manifest
