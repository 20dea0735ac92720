"""The edge agent's one settings object."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from edge_agent.routing import RoutingPolicy, Strategy
from shared.errors import InvalidIdError
from shared.settings import EdgeLoopSettings
from shared.topics import validate_id

# Addresses only this machine reaches (an API bound elsewhere is on the network).
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}

__all__ = [
    "AgentSettings",
    "CameraSource",
    "FolderSource",
    "default_agent_id",
    "default_config_path",
]


def default_config_path() -> Path:
    """Where ``edge-agent enroll`` writes the agent's config and ``run``/``status`` read it:
    ``$XDG_CONFIG_HOME/edgeloop/agent.toml``, else ``~/.config/edgeloop/agent.toml``."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "edgeloop" / "agent.toml"


def default_agent_id() -> str:
    """The host name, lowered and reduced to the characters an agent id accepts."""
    name = re.sub(r"[^a-z0-9_-]+", "-", socket.gethostname().lower()).strip("-_")
    return (name or "agent")[:64]


def _as_value_error(check: Callable[[str, str], str], value: str, kind: str) -> str:
    # pydantic reports ValueErrors with the field's name; our own errors would escape raw.
    try:
        return check(value, kind)
    except InvalidIdError as exc:
        raise ValueError(exc.message) from exc


class CameraSource(BaseModel):
    """One OpenCV source: a device index ("0"), an RTSP/HTTP URL, or a video file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")
    uri: str
    max_fps: float = Field(default=10.0, gt=0)
    loop: bool = True  # a video file starts again at its end
    # Motion JPEG: read the camera's own JPEGs, decode them at the model's scale and
    # forward them as they came (no JPEG encode on the agent); other codecs are decoded.
    keep_jpeg: bool = True
    reconnect_min_s: float = Field(default=0.5, gt=0)
    reconnect_max_s: float = Field(default=30.0, gt=0)


class FolderSource(BaseModel):
    """A watched folder: new JPEG/PNG files are inferred, then moved to ``done/``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")
    path: Path
    max_fps: float = Field(default=10.0, gt=0)
    poll_s: float = Field(default=1.0, gt=0)
    done_dir: Path | None = None  # default: {path}/done


class AgentSettings(EdgeLoopSettings):
    """Settings of one edge agent (``EDGELOOP_*``; see README's configuration reference)."""

    fleet: str = "default"
    agent_id: str = Field(default_factory=default_agent_id)
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8081, ge=1, le=65535)
    fleet_public_key: str | None = Field(
        default=None, description="base64 ed25519 key that signs this fleet's models"
    )
    key_id: str | None = None
    cloud_url: str | None = Field(
        default=None, description="the cloud this agent enrolled with (https in production)"
    )
    api_token: SecretStr | None = Field(
        default=None,
        description="bearer token for the cloud's API; sent only to cloud_url's origin over https",
    )
    local_api_token: SecretStr | None = Field(
        default=None,
        description="bearer token the agent's own API requires on its mutating routes"
        " (`edge-agent enroll` writes one); default: read from local_api_token_file",
    )
    local_api_token_file: Path | None = Field(
        default=None,
        description="file holding local_api_token (mode 0600); default"
        " {data_dir}/local-api-token, created by the agent when no token is set",
    )

    # Model and inference.
    model_path: Path | None = Field(
        default=None, description="default: {data_dir}/models/student.onnx"
    )
    providers: list[str] | None = Field(
        default=None, description="ORT providers by preference; default TensorRT, CUDA, CPU"
    )
    intra_op_threads: int = Field(default=0, ge=0)
    inference_threads: int = Field(
        default=1,
        ge=1,
        le=64,
        description="batches inferred at once, each on its own thread (with intra_op_threads"
        " 1: one core each, no intra-op hand-offs)",
    )
    pin_inference_threads: bool = Field(
        default=False,
        description="with several inference threads, each on a core of its own (the"
        " process's cores in turn), so the kernel never queues two on one core while"
        " another idles; `edge-agent tune` tries both",
    )
    ort_spinning: bool = Field(
        default=False,
        description="ORT threads spin between batches (off: they sleep, leaving the cores"
        " to the decode threads)",
    )
    trt_fp16: bool = True
    trt_int8: bool = False
    trt_cache_dir: Path | None = None
    warmup_runs: int = Field(default=3, ge=0)
    max_batch: int = Field(default=8, ge=1, le=1024)
    max_wait_ms: float = Field(default=5.0, ge=0)
    infer_timeout_s: float = Field(default=10.0, gt=0)
    switch_interval_ms: float = Field(
        default=0.5,
        ge=0.0,
        le=100.0,
        description="CPython's thread switch interval while the agent runs; 0: unchanged",
    )
    gc_young_every: int = Field(
        default=20_000,
        ge=0,
        le=10_000_000,
        description=(
            "CPython's youngest garbage collection every this many allocations while the"
            " agent runs (CPython's default 700), what it holds at start frozen; 0: unchanged"
        ),
    )
    opencv_threads: int = Field(
        default=1,
        ge=0,
        le=256,
        description="OpenCV's own threads inside one decode or resize while the agent runs"
        " (it decodes on several threads of its own); 0: OpenCV's default, one per core",
    )

    # Model updates (edge_agent/updates/).
    models_keep: int = Field(
        default=3, ge=1, le=50, description="model versions kept on disk, the active one included"
    )
    max_announcement_bytes: int = Field(default=1 << 20, ge=1024)
    max_model_opset: int | None = Field(
        default=None, ge=1, description="highest opset accepted; default: what onnxruntime runs"
    )
    download_timeout_s: float = Field(default=60.0, gt=0)
    download_attempts: int = Field(default=6, ge=1, le=100)
    updater_nice: int = Field(
        default=10, ge=0, le=19, description="nice value of the model-updater thread (Linux)"
    )
    update_retry_s: float = Field(
        default=60.0, gt=0, description="wait before retrying an update that failed transiently"
    )

    # Routing (strategies in route_order; None turns one off).
    route_max_prob_below: float | None = Field(default=0.6, ge=0, le=1.01)
    route_margin_below: float | None = Field(default=None, ge=0, le=1)
    route_entropy_above: float | None = Field(default=None, ge=0)
    route_class_thresholds: dict[str, float] = Field(default_factory=dict)
    # Detection (docs/architecture.md, "The task contract"): mean box score, share of
    # low-confidence boxes, candidates near the score threshold, box count range, and
    # the audit share of empty frames. The defaults forward about a sixth of the
    # reference detector's clean frames (bench/results/simulations/loop-detection.json:
    # forward_rate_clean).
    route_mean_score_below: float | None = Field(default=0.45, ge=0, le=1.01)
    route_low_share_above: float | None = Field(default=0.7, ge=0, le=1)
    route_near_threshold_at_least: int | None = Field(default=None, ge=1)
    route_box_count_min: int | None = Field(default=None, ge=0)
    route_box_count_max: int | None = Field(default=None, ge=0)
    empty_audit_share: float = Field(default=0.05, ge=0, le=1)
    # None: the model's task's rules, in its order.
    route_order: list[Strategy] | None = None
    audit_share: float = Field(default=0.01, ge=0, le=1)
    budget_per_minute: int | None = Field(default=None, ge=0)
    budget_per_hour: int | None = Field(default=None, ge=0)
    budget_per_day: int | None = Field(default=None, ge=0)

    # What is uploaded.
    upload_max_side: int = Field(default=640, ge=16)
    upload_jpeg_quality: int = Field(default=85, ge=10, le=100)
    upload_recompress: bool = False

    # Spool and uplink.
    spool_path: Path | None = Field(default=None, description="default: {data_dir}/spool.db")
    spool_max_bytes: int = Field(default=256 << 20, ge=1 << 16)
    spool_max_samples: int = Field(default=100_000, ge=1)
    resend_after_s: float = Field(default=30.0, gt=0)
    uplink_coalesce_ms: float = Field(
        default=10.0, ge=0, le=1000, description="wait to publish newly spooled samples together"
    )
    mqtt_protocol: Literal["auto", "5", "3.1.1"] = "auto"
    mqtt_keepalive_s: int = Field(default=30, ge=5)
    reconnect_min_s: float = Field(default=0.5, gt=0)
    reconnect_max_s: float = Field(default=30.0, gt=0)
    heartbeat_s: float = Field(default=15.0, gt=0)

    # Sources and results.
    http_max_fps: float | None = Field(default=None, gt=0, description="None: unlimited")
    http_decode_threads: int = Field(
        default=2,
        ge=1,
        le=64,
        description="threads decoding uploads beside inference (with several inference"
        " threads, each decodes its own batch's uploads, and these only isolated ones)",
    )
    cameras: list[CameraSource] = Field(default_factory=list)
    folders: list[FolderSource] = Field(default_factory=list)
    results_kept: int = Field(default=10_000, ge=1)
    verdicts_kept: int = Field(
        default=100_000, ge=1, description="verdicts kept in the spool database, newest first"
    )

    # Verdicts posted to the user's application (off when webhook_url is None).
    webhook_url: str | None = None
    webhook_queue: int = Field(default=1000, ge=1, description="verdicts waiting to be posted")
    webhook_attempts: int = Field(default=5, ge=1, le=100)
    webhook_timeout_s: float = Field(default=5.0, gt=0)
    webhook_backoff_min_s: float = Field(default=0.5, gt=0)
    webhook_backoff_max_s: float = Field(default=30.0, gt=0)

    # HTTP limits (shared/http_limits.py)
    http_max_body_bytes: int = Field(
        default=64 << 10,
        ge=1024,
        description="body limit of the local API's routes other than POST /v1/frames,"
        " whose limit is max_image_bytes plus multipart framing",
    )
    http_limit_concurrency: int | None = Field(
        default=256, ge=1, description="connections at once; over it, 503; None: no limit"
    )
    http_backlog: int = Field(default=256, ge=1, le=65535, description="the listen backlog")

    @field_validator("fleet")
    @classmethod
    def _check_fleet(cls, value: str) -> str:
        return _as_value_error(validate_id, value, "fleet")

    @field_validator("agent_id")
    @classmethod
    def _check_agent(cls, value: str) -> str:
        return _as_value_error(validate_id, value, "agent")

    @field_validator("webhook_url")
    @classmethod
    def _check_webhook(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"webhook_url must be an http:// or https:// URL, got {value!r}")
        return value

    @field_validator("cloud_url")
    @classmethod
    def _check_cloud_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"cloud_url must be an http:// or https:// URL, got {value!r}")
        return value

    @field_validator(
        "model_path", "spool_path", "trt_cache_dir", "local_api_token_file", mode="after"
    )
    @classmethod
    def _expand_paths(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @model_validator(mode="after")
    def _check_sources(self) -> AgentSettings:
        names = [c.name for c in self.cameras] + [f.name for f in self.folders]
        if len(names) != len(set(names)):
            raise ValueError(f"source names must be unique, got {names}")
        return self

    def production_problems(self) -> list[str]:
        """The broker checks of every process, and the agent's own (it has no SQL database)."""
        problems = super().production_problems()
        if not self.fleet_public_key:
            problems.append(
                "no fleet public key: the agent could not verify model updates "
                "(run `edge-agent enroll` or set EDGELOOP_FLEET_PUBLIC_KEY)"
            )
        if not self.cloud_url:
            problems.append(
                "no cloud_url: the agent could not fetch model updates "
                "(run `edge-agent enroll` or set EDGELOOP_CLOUD_URL)"
            )
        elif urlsplit(self.cloud_url).scheme.lower() != "https":
            problems.append(
                f"the cloud at {self.cloud_url} is reached without TLS: use https://"
                " (the agent's token and model artifacts travel on it)"
            )
        explicit_token = self.local_api_token is not None or self.local_api_token_file is not None
        if self.http_host not in _LOOPBACK and not explicit_token:
            problems.append(
                f"the agent's API listens on {self.http_host} without a configured local API"
                " token: set EDGELOOP_LOCAL_API_TOKEN (or _FILE), or bind it to 127.0.0.1"
            )
        return problems

    # Derived views.

    @property
    def resolved_model_path(self) -> Path:
        return self.model_path or self.data_dir / "models" / "student.onnx"

    @property
    def resolved_local_api_token_file(self) -> Path:
        return self.local_api_token_file or self.data_dir / "local-api-token"

    @property
    def resolved_spool_path(self) -> Path:
        return self.spool_path or self.data_dir / "spool.db"

    @property
    def resolved_verdicts_path(self) -> Path:
        """The verdict store's file, beside the spool's: ``spool.db`` -> ``spool-verdicts.db``."""
        spool = self.resolved_spool_path
        return spool.with_name(f"{spool.stem}-verdicts{spool.suffix or '.db'}")

    @property
    def resolved_trt_cache_dir(self) -> Path:
        return self.trt_cache_dir or self.data_dir / "trt-cache"

    @property
    def routing_policy(self) -> RoutingPolicy:
        return RoutingPolicy(
            max_prob_below=self.route_max_prob_below,
            margin_below=self.route_margin_below,
            entropy_above=self.route_entropy_above,
            class_thresholds=dict(self.route_class_thresholds),
            audit_share=self.audit_share,
            mean_score_below=self.route_mean_score_below,
            low_share_above=self.route_low_share_above,
            near_threshold_at_least=self.route_near_threshold_at_least,
            box_count_range=(
                None
                if self.route_box_count_min is None and self.route_box_count_max is None
                else (self.route_box_count_min or 0, self.route_box_count_max or 10**6)
            ),
            empty_audit_share=self.empty_audit_share,
            order=None if self.route_order is None else tuple(self.route_order),
            per_minute=self.budget_per_minute,
            per_hour=self.budget_per_hour,
            per_day=self.budget_per_day,
        )
