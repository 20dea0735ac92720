"""The cloud service's one settings object (API, verifier and scheduler share it)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from shared.settings import EdgeLoopSettings

__all__ = ["DEV_ADMIN_TOKEN", "DEV_SESSION_SECRET", "CloudSettings"]

# Known to everyone who reads this file: fine on a laptop, refused in production.
DEV_SESSION_SECRET = "edgeloop-development-session-secret"
DEV_ADMIN_TOKEN = "edgeloop-development-admin-token"


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
    verifier_switch_interval_ms: float = Field(
        default=0.5,
        ge=0.0,
        le=100.0,
        description="CPython's thread switch interval while the verifier runs; 0: unchanged",
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

    # Review rules.
    review_confidence_below: float = Field(default=0.5, ge=0.0, le=1.0)
    review_on_disagreement: bool = True
    review_audit_share: float = Field(default=0.02, ge=0.0, le=1.0)

    @field_validator("preferred_batch_sizes")
    @classmethod
    def _check_preferred(cls, value: list[int]) -> list[int]:
        if any(size < 1 for size in value):
            raise ValueError("preferred batch sizes must be positive")
        return sorted(set(value))

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
        if self.session_secret.get_secret_value() == DEV_SESSION_SECRET:
            problems.append(
                "the session secret is the development default: set EDGELOOP_SESSION_SECRET"
            )
        if self.admin_token.get_secret_value() == DEV_ADMIN_TOKEN:
            problems.append("the admin token is the development default: set EDGELOOP_ADMIN_TOKEN")
        if len(self.admin_token.get_secret_value()) < 24:
            problems.append("the admin token is shorter than 24 characters")
        return problems
