"""The cloud service's one settings object (API, verifier and scheduler share it)."""

from __future__ import annotations

import ipaddress
import math
from datetime import timedelta
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from shared.settings import EdgeLoopSettings

__all__ = ["DEV_ADMIN_TOKEN", "DEV_SESSION_SECRET", "CloudSettings", "secret_weakness"]

# Known to everyone who reads this file: fine on a laptop, refused in production.
DEV_SESSION_SECRET = "edgeloop-development-session-secret"
DEV_ADMIN_TOKEN = "edgeloop-development-admin-token"
MIN_SECRET_CHARS = 32
MIN_SECRET_DISTINCT = 10
MIN_SECRET_BITS = 128


def secret_weakness(value: str) -> str | None:
    """Why ``value`` is too weak for a production secret, or None when it is not."""
    if len(value) < MIN_SECRET_CHARS:
        return f"is shorter than {MIN_SECRET_CHARS} characters"
    distinct = len(set(value))
    # Length x log2(alphabet seen): a generous upper bound on the entropy. Random hex
    # (openssl rand -hex 32) often lacks one of its 16 digits, so the distinct-character
    # floor is lower and the bound carries the rest: 32 characters need 16 distinct ones.
    if distinct < MIN_SECRET_DISTINCT or len(value) * math.log2(distinct) < MIN_SECRET_BITS:
        return f"has low entropy ({distinct} distinct characters in {len(value)})"
    period = _shortest_period(value)
    if period <= len(value) // 2:
        return f"repeats a {period}-character pattern"
    return None


def _shortest_period(value: str) -> int:
    """The smallest p with value[i] == value[i - p] for every i >= p (KMP's failure table)."""
    fail = [0] * len(value)
    k = 0
    for i in range(1, len(value)):
        while k and value[i] != value[k]:
            k = fail[k - 1]
        if value[i] == value[k]:
            k += 1
        fail[i] = k
    return len(value) - (fail[-1] if value else 0)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class CloudSettings(EdgeLoopSettings):
    """Settings of the cloud service processes."""

    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8080, ge=1, le=65535)
    session_secret: SecretStr = SecretStr(DEV_SESSION_SECRET)
    admin_token: SecretStr = Field(
        default=SecretStr(DEV_ADMIN_TOKEN),
        description="bearer token of the REST API's admin endpoints",
    )
    signing_key_file: Path | None = Field(
        default=None, description="fleet ed25519 signing key; under data_dir/keys when unset"
    )
    verifier_group: str = Field(
        default="verifiers", description="MQTT v5 shared-subscription group of the verifiers"
    )
    verifier_client_id: str = Field(
        default="edgeloop-verifier-1",
        description="MQTT client id; stable, so the broker keeps the session across restarts",
    )
    verifier_workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="verifier processes on this host (more than 1 needs an MQTT v5 broker)",
    )
    mqtt_session_expiry_s: int = Field(
        default=3600, ge=0, description="how long the broker keeps the verifier's session offline"
    )
    # What enrolled agents are told (the address the broker has outside this host).
    agent_mqtt_url: str | None = Field(
        default=None, description="broker URL handed to agents at enrollment; mqtt_url when unset"
    )
    enrollment_ttl_s: int = Field(default=86400, ge=60, le=30 * 86400)

    # Broker authentication (cloud_service/brokerconf.py; `cloud-service broker-config`).
    broker_auth: bool = Field(
        default=False, description="enrollment issues per-agent broker credentials and ACLs"
    )
    broker_config_dir: Path | None = Field(
        default=None, description="passwd/acl/mosquitto.pid of the broker; data_dir/broker if unset"
    )

    # Abuse limits (cloud_service/security.py): a token bucket per client and route group.
    rate_limit_enroll_per_min: float = Field(default=30.0, ge=0.0, description="0: no limit")
    rate_limit_login_per_min: float = Field(default=20.0, ge=0.0, description="0: no limit")
    rate_limit_upload_per_min: float = Field(default=600.0, ge=0.0, description="0: no limit")
    rate_limit_burst: int = Field(default=10, ge=1, le=10_000)

    # Degradation: a per-agent circuit breaker on malformed data, load shedding.
    breaker_window_s: float = Field(default=60.0, gt=0.0, le=3600.0)
    breaker_min_messages: int = Field(default=20, ge=1)
    breaker_error_rate: float = Field(default=0.5, gt=0.0, le=1.0)
    breaker_cooldown_s: float = Field(default=300.0, ge=0.0, le=86_400.0)
    shed_queue_depth: int = Field(
        default=5000,
        ge=1,
        description="batcher depth above which low-priority (audit) samples are left pending",
    )
    shed_priority_at_least: int = Field(
        default=8, ge=0, le=9, description="sample priorities (0 most urgent) that are shed first"
    )

    # Verifier inbox and breaker
    inbox_max_messages: int = Field(
        default=2000,
        ge=1,
        le=65_535,
        description="messages the verifier holds between the broker and its store at once;"
        " also its MQTT v5 Receive Maximum",
    )
    inbox_max_bytes: int = Field(
        default=128 * 1024 * 1024,
        ge=64 * 1024,
        description="payload bytes the verifier holds between the broker and its store; when"
        " full, QoS 1 messages wait in the broker (the MQTT thread stops reading) and QoS 0"
        " messages are dropped and counted",
    )
    breaker_log_every_s: float = Field(
        default=10.0,
        ge=0.0,
        le=3600.0,
        description="at most one log line per dead-letter reason this often (the rest counted)",
    )

    blob_dir: Path | None = Field(default=None, description="image store; data_dir/blobs if unset")
    blob_fsync: bool = Field(default=True, description="fsync each blob before acknowledging")
    # An S3-compatible object store instead of the local folder (cloud_service/blobs_s3.py).
    blob_url: str | None = Field(
        default=None,
        pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9_./-]*)?$",
        description="s3://bucket[/prefix] for an S3-compatible store; the local blob_dir if unset",
    )
    s3_endpoint_url: str | None = Field(
        default=None, description="S3 endpoint (MinIO, Ceph, R2, ...); AWS's when unset"
    )
    s3_region: str | None = Field(default=None, description="S3 region; boto3's default if unset")
    s3_access_key_id: str | None = Field(
        default=None, description="S3 access key; boto3's credential chain (IAM role) when unset"
    )
    s3_secret_access_key: SecretStr | None = None
    s3_addressing_style: Literal["auto", "path", "virtual"] = Field(
        default="auto", description="bucket in the path (MinIO, most gateways) or the host name"
    )
    s3_max_concurrency: int = Field(
        default=16, ge=1, le=256, description="parallel uploads of one ingest batch"
    )

    teacher_model: Path | None = Field(
        default=None, description="teacher ONNX file; data_dir/models/teacher.onnx when unset"
    )
    teacher_name: str = "teacher"
    teacher_version: str | None = Field(
        default=None, description="teacher version; the model's edgeloop.version metadata if unset"
    )
    ort_providers: list[str] | None = Field(
        default=None, description="ONNX Runtime providers to try in order; best available if unset"
    )
    ort_intra_op_threads: int = Field(default=0, ge=0, description="0: ONNX Runtime decides")
    ort_allow_spinning: bool = Field(
        default=False,
        description="let idle ONNX Runtime threads spin for work (faster hand-offs, busy cores)",
    )
    teacher_gpu_kernels: bool = Field(
        default=True,
        description="on CUDA, run the teacher's preprocessing and scoring as Triton kernels",
    )
    verifier_decode_threads: int = Field(
        default=0,
        ge=0,
        le=64,
        description=(
            "threads decoding sample images in each verifier process; 0: one per core of"
            " the process's share of the host (the cores split between --workers), at most 4"
        ),
    )
    verifier_switch_interval_ms: float = Field(
        default=0.5,
        ge=0.0,
        le=100.0,
        description="CPython's thread switch interval while the verifier runs; 0: unchanged",
    )
    verifier_gc_young_every: int = Field(
        default=20_000,
        ge=0,
        le=10_000_000,
        description=(
            "CPython's youngest garbage collection every this many allocations while the"
            " verifier runs (CPython's default 700), what it holds at start frozen; 0: unchanged"
        ),
    )

    distill_worker: bool = Field(
        default=True,
        description="`cloud-service all` runs a distill worker process beside the API",
    )

    recovery_grace_s: float = Field(
        default=120.0,
        ge=0.0,
        description="periodic recovery scans leave pending samples younger than this alone",
    )

    # Dynamic batcher (the knobs Triton's dynamic_batching has).
    max_batch_size: int = Field(default=32, ge=1, le=4096)
    preferred_batch_sizes: list[int] = Field(default_factory=list)
    max_queue_delay_ms: float = Field(default=5.0, ge=0.0, le=60_000.0)
    max_queue_size: int = Field(default=10_000, ge=1)
    queue_policy: Literal["reject", "delay"] = "delay"
    queue_timeout_s: float | None = Field(default=None, gt=0.0)
    priority_levels: int = Field(default=10, ge=1, le=10)
    model_instances: int = Field(default=1, ge=1, le=16)

    # Ingest.
    ingest_max_batch: int = Field(default=200, ge=1, le=10_000)
    ingest_tick_ms: float = Field(default=10.0, gt=0.0, le=1000.0)
    receipt_flush_ms: float = Field(default=50.0, gt=0.0, le=10_000.0)
    receipt_max_ids: int = Field(default=100, ge=1, le=1000)
    verdicts_per_message: int = Field(
        default=100,
        ge=1,
        le=1000,
        description="an agent's verdicts sent together in one edgeloop.verdicts message; 1"
        " sends each as its own edgeloop.verdict (for agents that read no batches)",
    )
    dead_letter_keep_bytes: int = Field(
        default=65536, ge=0, description="bytes of a refused payload kept for inspection"
    )

    # Model registry and rollouts.
    model_retention_keep: int = Field(
        default=10, ge=1, description="newest versions of a model whose artifacts are kept"
    )
    golden_atol: float = Field(
        default=1e-3, gt=0, le=1, description="tolerance agents apply to the golden outputs"
    )
    rollout_tick_s: float = Field(
        default=30.0, ge=0, description="how often the API evaluates running rollouts; 0: never"
    )
    announcer_client_id: str = Field(
        default="edgeloop-announcer", description="MQTT client id prefix of the announcer"
    )
    announcement_ttl_days: float = Field(
        default=30.0,
        gt=0,
        le=3650,
        description="how long agents may act on a model announcement; the rollout loop signs"
        " a retained one again after half of it",
    )

    # Review rules.
    review_confidence_below: float = Field(default=0.5, ge=0.0, le=1.0)
    review_on_disagreement: bool = True
    review_audit_share: float = Field(default=0.02, ge=0.0, le=1.0)

    # HTTP limits (shared/http_limits.py)
    http_max_body_bytes: int = Field(
        default=1 << 20, ge=1024, description="body limit of the routes without one of their own"
    )
    http_max_model_bytes: int = Field(
        default=256 << 20,
        ge=1 << 20,
        description="body limit of POST /v1/models (a multipart ONNX upload)",
    )
    http_max_infer_bytes: int | None = Field(
        default=None,
        ge=1024,
        description="body limit of V2 infer requests; None: the V2 routes' own MAX_BODY_BYTES",
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="IPs and CIDR blocks of reverse proxies whose X-Forwarded-For and"
        " X-Forwarded-Proto are believed; from any other peer they are ignored",
    )
    cookie_secure: bool | None = Field(
        default=None,
        description="mark the review UI's cookies Secure; None: always in production,"
        " in development when the request came over HTTPS (directly or via a trusted proxy)",
    )
    v2_auth: bool | None = Field(
        default=None,
        description="the V2 endpoints need the admin token or an agent's API token;"
        " None: in production only",
    )
    docs_public: bool | None = Field(
        default=None,
        description="/docs, /redoc and /openapi.json answer without credentials (else the"
        " admin token or a UI session); None: in development only",
    )
    metrics_auth: bool | None = Field(
        default=None,
        description="/metrics needs metrics_token or the admin token; None: in production only",
    )
    metrics_token: SecretStr | None = Field(
        default=None, description="bearer token Prometheus scrapes /metrics with"
    )

    @field_validator("trusted_proxies")
    @classmethod
    def _check_proxies(cls, value: list[str]) -> list[str]:
        from shared.http_limits import parse_networks

        parse_networks(value)  # ValueError names the entry that is not an address or block
        return value

    @property
    def resolved_v2_auth(self) -> bool:
        return self.env == "production" if self.v2_auth is None else self.v2_auth

    @property
    def resolved_docs_public(self) -> bool:
        return self.env != "production" if self.docs_public is None else self.docs_public

    @property
    def resolved_metrics_auth(self) -> bool:
        return self.env == "production" if self.metrics_auth is None else self.metrics_auth

    @property
    def resolved_cookie_secure(self) -> bool | None:
        """True: always Secure; None: when the request came over HTTPS."""
        if self.cookie_secure is None:
            return True if self.env == "production" else None
        return self.cookie_secure or None

    @field_validator("verifier_client_id", "announcer_client_id")
    @classmethod
    def _check_client_id(cls, value: str) -> str:
        # Agents' client ids are their broker users, {fleet}.{agent}: a dot-free service
        # id can never be one of them (cloud_service/brokerconf.py).
        if not value or "." in value:
            raise ValueError("a service's MQTT client id must be non-empty and hold no dot")
        return value

    @field_validator("preferred_batch_sizes")
    @classmethod
    def _check_preferred(cls, value: list[int]) -> list[int]:
        if any(size < 1 for size in value):
            raise ValueError("preferred batch sizes must be positive")
        return sorted(set(value))

    @property
    def announcement_ttl(self) -> timedelta:
        return timedelta(days=self.announcement_ttl_days)

    @property
    def resolved_signing_key_file(self) -> Path:
        return self.signing_key_file or self.data_dir / "keys" / "fleet-signing.pem"

    @property
    def resolved_blob_dir(self) -> Path:
        return self.blob_dir or self.data_dir / "blobs"

    @property
    def resolved_teacher_model(self) -> Path:
        return self.teacher_model or self.data_dir / "models" / "teacher.onnx"

    @property
    def resolved_broker_config_dir(self) -> Path:
        return self.broker_config_dir or self.data_dir / "broker"

    @property
    def resolved_agent_mqtt_url(self) -> str:
        return self.agent_mqtt_url or self.mqtt_url

    def production_problems(self) -> list[str]:
        problems = super().production_problems()
        if self.resolved_database_url.startswith("sqlite"):
            problems.append("SQLite is the development database: set EDGELOOP_DATABASE_URL")
        secrets = (
            ("session secret", "EDGELOOP_SESSION_SECRET", self.session_secret, DEV_SESSION_SECRET),
            ("admin token", "EDGELOOP_ADMIN_TOKEN", self.admin_token, DEV_ADMIN_TOKEN),
        )
        for name, variable, secret, default in secrets:
            value = secret.get_secret_value()
            if value == default:
                problems.append(f"the {name} is the development default: set {variable}")
            elif weakness := secret_weakness(value):
                problems.append(
                    f"the {name} {weakness}: set {variable} to a random value "
                    "(e.g. `openssl rand -hex 32`)"
                )
        if not self.broker_auth:
            problems.append(
                "broker_auth is off: agents would share an anonymous broker; set "
                "EDGELOOP_BROKER_AUTH=true (per-agent broker users, `cloud-service broker-config`)"
            )
        # The API speaks plain HTTP: off loopback, a TLS-terminating proxy must sit in front.
        if not _is_loopback(self.http_host) and not self.trusted_proxies:
            problems.append(
                f"the API listens on {self.http_host} with plain HTTP: put a TLS-terminating "
                "proxy in front and list it in EDGELOOP_TRUSTED_PROXIES, or listen on 127.0.0.1"
            )
        for field in sorted(type(self).model_fields):
            is_rate = field.startswith("rate_limit_") and field.endswith("_per_min")
            if is_rate and getattr(self, field) == 0:
                problems.append(f"{field} is 0 (no limit): set EDGELOOP_{field.upper()} above 0")
        problems += self._http_problems()
        return problems

    def _http_problems(self) -> list[str]:
        """The HTTP surface's unsafe settings (shared/http_limits.py)."""
        problems: list[str] = []
        if not self.resolved_v2_auth:
            problems.append("v2_auth is off: anyone could run the teacher (EDGELOOP_V2_AUTH)")
        if self.resolved_docs_public:
            problems.append("docs_public is on: the API's schema is open (EDGELOOP_DOCS_PUBLIC)")
        if not self.resolved_metrics_auth:
            problems.append(
                "metrics_auth is off: /metrics names every agent (EDGELOOP_METRICS_AUTH)"
            )
        elif self.metrics_token is None:
            problems.append(
                "metrics_token is unset: Prometheus would scrape with the admin token;"
                " set EDGELOOP_METRICS_TOKEN"
            )
        elif weakness := secret_weakness(self.metrics_token.get_secret_value()):
            problems.append(f"the metrics token {weakness}: set EDGELOOP_METRICS_TOKEN")
        if self.cookie_secure is False:
            problems.append("cookie_secure is off: session cookies would travel over plain HTTP")
        for block in self.trusted_proxies:
            network = ipaddress.ip_network(block, strict=False)
            if network.prefixlen == 0 or network.is_global:
                problems.append(
                    f"trusted_proxies holds {block}: anyone there could forge X-Forwarded-For;"
                    " list only the proxies' own private addresses"
                )
        if self.http_limit_concurrency is None:
            problems.append("http_limit_concurrency is unset: connections are unbounded")
        if self.http_header_timeout_s > 60:
            problems.append(
                f"http_header_timeout_s is {self.http_header_timeout_s:g}: slow request heads"
                " would hold connections; keep it at 60 s or less"
            )
        return problems
