"""The cloud service's one settings object (API, verifier and scheduler share it)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from shared.settings import EdgeLoopSettings

__all__ = ["DEV_SESSION_SECRET", "CloudSettings"]

# Known to everyone who reads this file: fine on a laptop, refused in production.
DEV_SESSION_SECRET = "edgeloop-development-session-secret"


class CloudSettings(EdgeLoopSettings):
    """Settings of the cloud service processes."""

    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8080, ge=1, le=65535)
    session_secret: SecretStr = SecretStr(DEV_SESSION_SECRET)
    signing_key_file: Path | None = Field(
        default=None, description="fleet ed25519 signing key; under data_dir/keys when unset"
    )
    verifier_group: str = Field(
        default="verifiers", description="MQTT v5 shared-subscription group of the verifiers"
    )

    @property
    def resolved_signing_key_file(self) -> Path:
        return self.signing_key_file or self.data_dir / "keys" / "fleet-signing.pem"

    def production_problems(self) -> list[str]:
        problems = super().production_problems()
        if self.session_secret.get_secret_value() == DEV_SESSION_SECRET:
            problems.append(
                "the session secret is the development default: set EDGELOOP_SESSION_SECRET"
            )
        return problems
