"""A model artifact from the cloud to disk, and the checks before it serves.

The artifact is downloaded (resumed with HTTP Range after a break), its size and
sha256 checked against the signed manifest, then it must load in ONNX Runtime with
the serving model's input size and reproduce its golden outputs within the
manifest's tolerance.

The agent's API token goes only to the cloud it enrolled with (the scheme, host and
port of ``cloud_url``) and only over https (http only for a loopback cloud in
development); an artifact named on another origin is fetched without it, which is
safe because the signed manifest fixes its size and sha256.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
import numpy as np

from edge_agent.settings import AgentSettings
from edge_agent.updates.checks import UpdateRefused
from edge_agent.updates.state import file_sha256
from shared.errors import EdgeLoopError
from shared.manifest import ModelManifest
from shared.tasks import task_for

__all__ = ["ArtifactFetcher", "Engine", "load_and_check", "token_for"]

log = logging.getLogger(__name__)

_CHUNK = 1 << 16
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class Engine(Protocol):
    name: str
    version: str
    input_hw: tuple[int, int]

    def run(self, frames: np.ndarray) -> np.ndarray: ...


def token_for(settings: AgentSettings, url: str) -> str | None:
    """The API token if ``url`` is on the enrolled cloud's origin over TLS, else None."""
    if settings.api_token is None or not settings.cloud_url:
        return None
    target, cloud = _origin(url), _origin(settings.cloud_url)
    if target is None or target != cloud:
        return None  # another host: the sha256 in the signed manifest guards the bytes
    scheme, host, _port = target
    if scheme != "https" and not (host in _LOOPBACK and settings.env == "development"):
        return None  # never a credential in plaintext off this machine
    return settings.api_token.get_secret_value()


def _origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an http(s) URL, the port made explicit; None otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        return None
    return scheme, parts.hostname.lower(), port or (443 if scheme == "https" else 80)


class ArtifactFetcher:
    """Puts a manifest's artifact in ``{root}/versions``, downloading into ``{root}/partial``.

    ``wait(s)`` sleeps between download attempts and returns True when the agent is
    stopping; ``transport`` is an httpx transport for tests.
    """

    def __init__(
        self,
        settings: AgentSettings,
        *,
        root: Path,
        wait: Callable[[float], bool],
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.root = root
        self.versions_dir = root / "versions"
        self.partial_dir = root / "partial"
        self._wait = wait
        self._transport = transport

    def fetch(self, manifest: ModelManifest) -> Path:
        """The verified artifact on disk: kept from before, or downloaded (resumed) now."""
        target = self.versions_dir / f"{manifest.name}-{manifest.version}.onnx"
        if target.is_file() and file_sha256(target) == manifest.sha256:
            return target
        part = self.partial_dir / f"{manifest.sha256}.part"
        try:
            self.partial_dir.mkdir(parents=True, exist_ok=True)
            self._download(manifest, part)
            size = part.stat().st_size
            if size != manifest.size_bytes:
                part.unlink(missing_ok=True)
                raise UpdateRefused(
                    "size_mismatch",
                    f"artifact has {size} bytes, the manifest says {manifest.size_bytes}",
                )
            digest = file_sha256(part)
            if digest != manifest.sha256:
                part.unlink(missing_ok=True)
                raise UpdateRefused(
                    "hash_mismatch",
                    f"artifact sha256 is {digest[:16]}..., the manifest"
                    f" says {manifest.sha256[:16]}...",
                )
            self.versions_dir.mkdir(parents=True, exist_ok=True)
            os.replace(part, target)
        except OSError as exc:
            part.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise UpdateRefused(
                    "disk_full",
                    f"no space left under {self.root} for {manifest.size_bytes} bytes",
                    transient=True,
                ) from exc
            raise UpdateRefused(
                "io_error", f"cannot store the artifact: {exc}", transient=True
            ) from exc
        return target

    def _artifact_url(self, manifest: ModelManifest) -> str:
        if manifest.url.startswith(("http://", "https://")):
            return manifest.url
        if not self.settings.cloud_url:
            raise UpdateRefused(
                "no_cloud_url", "the announcement's URL is relative and cloud_url is unset"
            )
        return self.settings.cloud_url.rstrip("/") + manifest.url

    def _write(self, handle: Any, chunk: bytes) -> None:
        handle.write(chunk)  # a seam: tests make it fail with ENOSPC

    def _download(self, manifest: ModelManifest, part: Path) -> None:
        url = self._artifact_url(manifest)
        token = token_for(self.settings, url)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        size = manifest.size_bytes
        stalled = 0
        with httpx.Client(
            transport=self._transport, timeout=self.settings.download_timeout_s
        ) as client:
            for _attempt in range(self.settings.download_attempts):
                have = part.stat().st_size if part.exists() else 0
                if have > size:
                    part.unlink()
                    have = 0
                if have == size:
                    return
                request_headers = dict(headers)
                if have:
                    request_headers["Range"] = f"bytes={have}-"
                try:
                    with client.stream("GET", url, headers=request_headers) as response:
                        if response.status_code == 416:
                            raise UpdateRefused(
                                "truncated",
                                f"the artifact ends at {have} of {size} bytes on the server",
                            )
                        if response.status_code in (401, 403):
                            why = (
                                "the cloud refused this agent's token"
                                if token
                                else "the token is sent only to the enrolled cloud over https"
                            )
                            raise UpdateRefused(
                                "unauthorized",
                                f"GET {url} answered {response.status_code} ({why})",
                                transient=True,
                            )
                        if response.status_code not in (200, 206):
                            raise UpdateRefused(
                                "download_failed",
                                f"GET {url} answered {response.status_code}",
                                transient=True,
                            )
                        mode = "ab" if response.status_code == 206 and have else "wb"
                        written = have if mode == "ab" else 0
                        with part.open(mode) as handle:
                            for chunk in response.iter_bytes(_CHUNK):
                                written += len(chunk)
                                if written > size:
                                    raise UpdateRefused(
                                        "size_mismatch",
                                        f"the server sent more than the {size} bytes announced",
                                    )
                                self._write(handle, chunk)
                            handle.flush()
                            os.fsync(handle.fileno())
                except UpdateRefused as exc:
                    if not exc.transient:
                        part.unlink(missing_ok=True)
                    raise
                except httpx.HTTPError as exc:
                    log.info("download of %s broke (%s); resuming", url, exc)
                now = part.stat().st_size if part.exists() else 0
                if now == size:
                    return
                stalled = stalled + 1 if now <= have else 0
                if stalled >= 2:
                    break
                self._wait(min(2.0, 0.1 * 2**_attempt))
        have = part.stat().st_size if part.exists() else 0
        raise UpdateRefused(
            "truncated", f"download stopped at {have} of {size} bytes", transient=have < size
        )


def load_and_check(
    manifest: ModelManifest,
    path: Path,
    *,
    engine_factory: Callable[[Path], Any],
    current: Callable[[], Engine],
) -> Any:
    """The engine for ``path``, once it takes the serving engine's input size and passes
    the golden inputs of ``manifest`` (named with the manifest's name and version)."""
    try:
        engine = engine_factory(path)
    except EdgeLoopError as exc:
        raise UpdateRefused("load_failed", exc.message) from exc
    # The signed manifest names the version: samples are tagged with the registry's
    # name and version even when the artifact's own metadata says otherwise.
    engine.name, engine.version = manifest.name, manifest.version
    serving = current()
    if tuple(engine.input_hw) != tuple(serving.input_hw):
        raise UpdateRefused(
            "incompatible_input",
            f"model takes {engine.input_hw} frames; the serving one {serving.input_hw}",
        )
    task = task_for(manifest.task)
    for index, case in enumerate(manifest.golden):
        frames = np.frombuffer(case.input_bytes(), dtype=np.uint8).reshape(case.shape)
        try:
            scores = np.asarray(engine.run(frames), dtype=np.float64)  # the task's output
        except EdgeLoopError as exc:
            raise UpdateRefused("golden_failed", f"golden[{index}] did not run: {exc}") from exc
        try:
            worst = task.golden_difference(case.expected, scores, case.atol)
        except ValueError as exc:
            raise UpdateRefused("golden_mismatch", f"golden[{index}] {exc}") from None
        if not worst <= case.atol:
            raise UpdateRefused(
                "golden_mismatch",
                f"golden[{index}] differs by {worst:.3g}, more than atol {case.atol:g}",
            )
    return engine
