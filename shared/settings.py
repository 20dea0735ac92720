"""The settings base every EdgeLoop process builds its one settings object on.

Values come from, highest priority first: keyword overrides (tests, CLI flags),
``EDGELOOP_*`` environment variables, an optional TOML file (``--config PATH``;
flat keys named like the variables without the prefix, e.g. ``mqtt_url``), then
the defaults below. The defaults are for development on one machine; with
``EDGELOOP_ENV=production`` the object refuses to exist while an unsafe default
is still in place (anonymous broker, plaintext broker off loopback; each process
adds its own: the cloud its secrets and SQLite, the agent its fleet key), listing
every problem at once.
"""

from __future__ import annotations

import contextvars
import os
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from shared.envelope import EnvelopeLimits
from shared.errors import ConfigError
from shared.http_server import ServerLimits
from shared.images import DEFAULT_ISOLATE_COST
from shared.mqtt import MqttTarget
from shared.topics import Topics

__all__ = ["EdgeLoopSettings", "default_data_dir"]

_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "edgeloop_config_file", default=None
)
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def default_data_dir() -> Path:
    """A per-user data folder: ``$XDG_DATA_HOME/edgeloop`` or ``~/.local/share/edgeloop``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "edgeloop"


class EdgeLoopSettings(BaseSettings):
    """Settings shared by every process; each process subclasses it with its own."""

    model_config = SettingsConfigDict(
        env_prefix="EDGELOOP_",
        extra="forbid",
        validate_default=True,
        frozen=True,
    )

    env: Literal["development", "production"] = "development"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    data_dir: Path = Field(default_factory=default_data_dir)
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; SQLite under data_dir when unset"
    )
    mqtt_url: str = "mqtt://127.0.0.1:1883"
    mqtt_username: str | None = None
    mqtt_password: SecretStr | None = None
    mqtt_ca_file: Path | None = None
    topic_prefix: str = "edgeloop/v1"
    max_header_bytes: int = Field(default=4096, ge=256, le=65535)
    max_image_bytes: int = Field(default=2_000_000, ge=1024)
    max_pixels: int = Field(default=4_000_000, ge=64)

    # Decode budget (shared/decode_pool.py): what an image may cost to decode.
    decode_budget_ms: float = Field(
        default=1500.0,
        gt=0.0,
        le=600_000.0,
        description="time one isolated image (progressive JPEG, costly) may take to decode;"
        " past it its decoder process is killed and the image refused (image_decode_timeout:"
        " 422 at the agent, a dead letter at the cloud)",
    )
    decode_workers: int = Field(
        default=2, ge=1, le=64, description="decoder processes for isolated images"
    )
    decode_isolate_cost: int = Field(
        default=DEFAULT_ISOLATE_COST,
        ge=1,
        description="pixels times scans above which any image is decoded in a decoder process"
        " (progressive JPEGs always are)",
    )

    # HTTP server limits (shared/http_server.py, shared/http_limits.py); subclasses add
    # their body limits.
    http_header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="a request head must be complete within this of the connection"
        " or of the previous response, else the connection is closed",
    )
    http_keep_alive_s: int = Field(
        default=5, ge=1, le=300, description="idle keep-alive connections close after this"
    )
    http_limit_concurrency: int | None = Field(
        default=1000, ge=1, description="connections at once; over it, 503; None: no limit"
    )
    http_backlog: int = Field(default=2048, ge=1, le=65535, description="the listen backlog")
    http_max_head_bytes: int = Field(
        default=16384, ge=1024, le=1 << 20, description="request line and headers together"
    )

    @field_validator("data_dir", "mqtt_ca_file", mode="after")
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @field_validator("mqtt_url")
    @classmethod
    def _check_mqtt_url(cls, value: str) -> str:
        MqttTarget.parse(value)  # raises ConfigError naming the accepted forms
        return value

    @field_validator("topic_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        Topics(prefix=value)
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _config_file.get()
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)

    @classmethod
    def load(cls, config_file: Path | str | None = None, **overrides: Any) -> Self:
        """Read the file (if any) and the environment; raise ConfigError on anything unsafe."""
        path = Path(config_file).expanduser() if config_file is not None else None
        if path is not None and not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        token = _config_file.set(path)
        try:
            settings = cls(**overrides)
        except ValidationError as exc:
            raise ConfigError(_summarise(exc, path)) from exc
        except ValueError as exc:  # TOML syntax errors surface as ValueError subclasses
            raise ConfigError(f"config file {path}: {exc}") from exc
        finally:
            _config_file.reset(token)
        if settings.env == "production":
            problems = settings.production_problems()
            if problems:
                raise ConfigError(
                    "refusing to start in production with unsafe settings:\n  - "
                    + "\n  - ".join(problems)
                )
        return settings

    def production_problems(self) -> list[str]:
        """What makes these settings unsafe outside development (subclasses add theirs)."""
        problems: list[str] = []
        target = self.mqtt
        if target.anonymous:
            problems.append(
                "the broker connection is anonymous: set EDGELOOP_MQTT_USERNAME/PASSWORD "
                "or credentials in EDGELOOP_MQTT_URL"
            )
        if not target.tls and target.host not in _LOOPBACK:
            problems.append(f"the broker at {target.host} is reached without TLS: use mqtts://")
        return problems

    # Derived views: computed from the fields, never stored twice.

    @property
    def mqtt(self) -> MqttTarget:
        password = self.mqtt_password.get_secret_value() if self.mqtt_password else None
        return MqttTarget.parse(
            self.mqtt_url,
            username=self.mqtt_username,
            password=password,
            ca_file=str(self.mqtt_ca_file) if self.mqtt_ca_file else None,
        )

    @property
    def http_server_limits(self) -> ServerLimits:
        return ServerLimits(
            header_timeout_s=self.http_header_timeout_s,
            keep_alive_s=self.http_keep_alive_s,
            limit_concurrency=self.http_limit_concurrency,
            backlog=self.http_backlog,
            max_head_bytes=self.http_max_head_bytes,
        )

    @property
    def topics(self) -> Topics:
        return Topics(prefix=self.topic_prefix)

    @property
    def envelope_limits(self) -> EnvelopeLimits:
        return EnvelopeLimits(
            max_header_bytes=self.max_header_bytes,
            max_image_bytes=self.max_image_bytes,
            max_pixels=self.max_pixels,
        )

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir / 'edgeloop.db'}"


def _summarise(exc: ValidationError, path: Path | None) -> str:
    where = f" (from {path} and EDGELOOP_* variables)" if path else " (from EDGELOOP_* variables)"
    lines = []
    for error in exc.errors()[:5]:
        field = ".".join(str(p) for p in error["loc"]) or "settings"
        lines.append(f"{field}: {error['msg']}")
    return "invalid settings" + where + ":\n  - " + "\n  - ".join(lines)
