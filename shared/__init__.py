"""EdgeLoop's shared contracts: what the edge agent, cloud service and distill worker agree on.

Other packages import from here (``from shared import SampleHeader, Topics``);
the modules behind it are private. The error tree lives in ``shared.errors``;
process settings subclass ``shared.settings.EdgeLoopSettings``.
"""

from shared.broker import EmbeddedBroker, free_port
from shared.envelope import (
    Envelope,
    EnvelopeLimits,
    decode_envelope,
    encode_envelope,
    envelope_overhead,
)
from shared.ids import new_sample_id, sample_id_time, validate_sample_id
from shared.images import ImageInfo, probe_image
from shared.manifest import (
    FleetSigningKey,
    GoldenCase,
    InputSpec,
    ModelManifest,
    canonical_manifest_bytes,
    sha256_file,
)
from shared.messages import (
    AgentStatus,
    Message,
    ModelAnnouncement,
    ModelStatus,
    Receipt,
    RouteReason,
    SampleHeader,
    Verdict,
    Verdicts,
    decode_any,
    decode_message,
    decode_verdicts,
    encode_message,
    encode_verdicts,
    sign_manifest,
    verify_announcement,
    verify_manifest_bytes,
)
from shared.mqtt import MqttTarget, make_client, negotiate_protocol
from shared.settings import EdgeLoopSettings
from shared.topics import TopicRef, Topics, topic_matches, validate_id

__all__ = [
    "AgentStatus",
    "EdgeLoopSettings",
    "EmbeddedBroker",
    "Envelope",
    "EnvelopeLimits",
    "FleetSigningKey",
    "GoldenCase",
    "ImageInfo",
    "InputSpec",
    "Message",
    "ModelAnnouncement",
    "ModelManifest",
    "ModelStatus",
    "MqttTarget",
    "Receipt",
    "RouteReason",
    "SampleHeader",
    "TopicRef",
    "Topics",
    "Verdict",
    "Verdicts",
    "canonical_manifest_bytes",
    "decode_any",
    "decode_envelope",
    "decode_message",
    "decode_verdicts",
    "encode_envelope",
    "encode_message",
    "encode_verdicts",
    "envelope_overhead",
    "free_port",
    "make_client",
    "negotiate_protocol",
    "new_sample_id",
    "probe_image",
    "sample_id_time",
    "sha256_file",
    "sign_manifest",
    "topic_matches",
    "validate_id",
    "validate_sample_id",
    "verify_announcement",
    "verify_manifest_bytes",
]
