"""The EdgeLoop error tree.

Every error EdgeLoop raises on purpose is an ``EdgeLoopError``. Third-party errors
(pydantic, onnxruntime, paho, SQLAlchemy) are wrapped once, at the boundary where
they enter our code, with ``raise OurError(...) from exc``.

    EdgeLoopError
    ├── ConfigError                  settings missing, invalid, or unsafe for production
    ├── ContractError                input that breaks a shared contract (untrusted data)
    │   ├── InvalidIdError           fleet/agent/sample id not of the accepted form
    │   ├── TopicError               topic outside the EdgeLoop namespace or malformed
    │   ├── MessageError             a JSON message that cannot be accepted
    │   │   ├── UnknownSchemaError       schema name not the expected one
    │   │   ├── UnsupportedVersionError  schema version newer than this receiver
    │   │   └── MessageValidationError   fields missing or of the wrong form
    │   ├── EnvelopeError            a sample envelope that cannot be accepted
    │   │   ├── TruncatedEnvelopeError
    │   │   ├── BadMagicError
    │   │   ├── ChecksumError
    │   │   ├── LimitExceededError       header, image bytes or pixel count over a limit
    │   │   └── ImageFormatError         image bytes not a JPEG/PNG matching the header
    │   ├── ImageError               an uploaded image that cannot be decoded
    │   │   ├── ImageDecodeTimeoutError  its decode ran past the time budget (worker killed)
    │   │   └── ImageDecodeFailedError   its decoder process died (a decoder crash)
    │   ├── DataError                a dataset (folder of labelled images) unusable
    │   └── ManifestError            a model manifest that cannot be accepted
    │       └── SignatureError           signature missing, malformed or not valid
    ├── ModelError                   a model that cannot be built, loaded or run
    ├── TransportError               the broker or network failed us
    └── StoreError                   the database or blob store failed us

Each class carries a short ``reason`` slug, stable across releases, used as the
dead-letter reason and as a metrics label.
"""

from __future__ import annotations

__all__ = [
    "BadMagicError",
    "ChecksumError",
    "ConfigError",
    "ContractError",
    "DataError",
    "EdgeLoopError",
    "EnvelopeError",
    "ImageDecodeFailedError",
    "ImageDecodeTimeoutError",
    "ImageError",
    "ImageFormatError",
    "InvalidIdError",
    "JpegScanLimitError",
    "LimitExceededError",
    "ManifestError",
    "MessageError",
    "MessageValidationError",
    "ModelError",
    "SignatureError",
    "StoreError",
    "TopicError",
    "TransportError",
    "TruncatedEnvelopeError",
    "UnknownSchemaError",
    "UnsupportedVersionError",
]


class EdgeLoopError(Exception):
    """Base of every error EdgeLoop raises on purpose."""

    reason: str = "error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConfigError(EdgeLoopError):
    reason = "config"


class ContractError(EdgeLoopError):
    reason = "contract"


class InvalidIdError(ContractError):
    reason = "invalid_id"


class TopicError(ContractError):
    reason = "bad_topic"


class MessageError(ContractError):
    reason = "bad_message"


class UnknownSchemaError(MessageError):
    reason = "unknown_schema"


class UnsupportedVersionError(MessageError):
    reason = "unsupported_version"


class MessageValidationError(MessageError):
    reason = "invalid_message"


class EnvelopeError(ContractError):
    reason = "bad_envelope"


class TruncatedEnvelopeError(EnvelopeError):
    reason = "truncated"


class BadMagicError(EnvelopeError):
    reason = "bad_magic"


class ChecksumError(EnvelopeError):
    reason = "checksum"


class LimitExceededError(EnvelopeError):
    """A size limit was exceeded; ``limit`` names which (header_bytes, image_bytes, pixels)."""

    reason = "too_large"

    def __init__(self, message: str, *, limit: str, actual: int, allowed: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.actual = actual
        self.allowed = allowed


class ImageFormatError(EnvelopeError):
    reason = "bad_image"


class ImageError(ContractError):
    reason = "bad_image"


class ImageDecodeTimeoutError(ImageError):
    """An image whose decode ran past its time budget; the decoding process was killed."""

    reason = "image_decode_timeout"


class ImageDecodeFailedError(ImageError):
    """An image whose decoding process died (a decoder crash) or could not be started."""

    reason = "image_decode_failed"


class JpegScanLimitError(ImageFormatError):
    """A JPEG with more scans than allowed: each scan re-walks every block (a "scan bomb")."""

    reason = "jpeg_too_many_scans"


class DataError(ContractError):
    reason = "bad_data"


class ManifestError(ContractError):
    reason = "bad_manifest"


class SignatureError(ManifestError):
    reason = "bad_signature"


class ModelError(EdgeLoopError):
    reason = "model"


class TransportError(EdgeLoopError):
    reason = "transport"


class StoreError(EdgeLoopError):
    reason = "store"
