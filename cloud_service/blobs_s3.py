"""Blobs in an S3-compatible object store (AWS S3, MinIO, Ceph RGW, R2, GCS interop).

The same keys as the local folder (``samples/{fleet}/{agent}/...``), under an
optional prefix in one bucket. ``put`` returns once the store has answered the
PUT with success: S3 and its compatibles acknowledge an object only after it is
durably stored, and reads after that acknowledgement see it (strong
read-after-write consistency), so a verifier may ack the MQTT message then.
A batch (``batch``, ``put_many``) keeps the keys it is offered, one object each,
uploaded in parallel; it is stored when every upload has been answered.

boto3 is imported when a store is built, so installations that keep blobs in a
local folder do not need it (``pip install edgeloop[s3]``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from cloud_service.blobs_base import BlobBatch, SweptBlobs, check_blob_key
from shared.errors import ConfigError, StoreError

if TYPE_CHECKING:
    from cloud_service.settings import CloudSettings

__all__ = ["S3BlobStore", "parse_s3_url"]

# Codes S3 and its compatibles answer for a missing object (GET says NoSuchKey,
# HEAD has no body and so only its status, 404).
_MISSING = {"NoSuchKey", "404", "NotFound"}


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket[/prefix]`` as (bucket, prefix without surrounding slashes)."""
    if not url.startswith("s3://"):
        raise ConfigError(f"blob URL {url!r} is not valid: use s3://bucket[/prefix]")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    prefix = prefix.strip("/")
    if not bucket:
        raise ConfigError(f"blob URL {url!r} names no bucket: use s3://bucket[/prefix]")
    if prefix:
        try:
            check_blob_key(prefix)
        except StoreError as exc:
            raise ConfigError(
                f"blob URL {url!r} has a prefix that is not a/b/c: use s3://bucket/a/b"
            ) from exc
    return bucket, prefix


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


class S3BlobStore:
    """Blobs as objects ``{prefix}/{key}`` in ``bucket``; thread-safe (one shared client)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        addressing_style: str = "auto",
        max_concurrency: int = 16,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        max_attempts: int = 5,
        client: Any | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.max_concurrency = max(1, max_concurrency)
        if (access_key_id is None) != (secret_access_key is None):
            raise ConfigError("set both the S3 access key id and the secret access key, or neither")
        self._client = (
            client
            if client is not None
            else self._make_client(
                endpoint_url=endpoint_url,
                region=region,
                access_key_id=access_key_id,
                secret_access_key=secret_access_key,
                addressing_style=addressing_style,
                connect_timeout_s=connect_timeout_s,
                read_timeout_s=read_timeout_s,
                max_attempts=max_attempts,
            )
        )
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: CloudSettings) -> S3BlobStore:
        """The store ``settings.blob_url`` names, with the endpoint and credentials beside it."""
        if settings.blob_url is None:
            raise ConfigError("no S3 blob store configured: set EDGELOOP_BLOB_URL=s3://bucket")
        bucket, prefix = parse_s3_url(settings.blob_url)
        secret = settings.s3_secret_access_key
        return cls(
            bucket,
            prefix,
            endpoint_url=settings.s3_endpoint_url,
            region=settings.s3_region,
            access_key_id=settings.s3_access_key_id,
            secret_access_key=secret.get_secret_value() if secret is not None else None,
            addressing_style=settings.s3_addressing_style,
            max_concurrency=settings.s3_max_concurrency,
        )

    @staticmethod
    def _make_client(
        *,
        endpoint_url: str | None,
        region: str | None,
        access_key_id: str | None,
        secret_access_key: str | None,
        addressing_style: str,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_attempts: int,
    ) -> Any:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise ConfigError(
                "an s3:// blob store needs boto3: pip install 'edgeloop[s3]'"
            ) from exc
        config = Config(
            s3={"addressing_style": addressing_style},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            # Transient failures (throttling, 5xx, resets) are retried here; what
            # still fails surfaces as StoreError, which the verifier waits out.
            retries={"max_attempts": max_attempts, "mode": "standard"},
            # One connection per concurrent upload, plus a few for reads.
            max_pool_connections=64,
        )
        # A session of its own: boto3's default session is not safe to share
        # between threads, a client built from a session is.
        session = boto3.session.Session(
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            region_name=region,
        )
        return session.client("s3", endpoint_url=endpoint_url, config=config)

    def __repr__(self) -> str:
        where = f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket
        return f"S3BlobStore(s3://{where})"

    def _key(self, key: str) -> str:
        check_blob_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _fail(self, action: str, key: str, exc: BaseException) -> StoreError:
        code = _error_code(exc)
        detail = f"{code}: {exc}" if code else str(exc)
        return StoreError(f"cannot {action} blob {key} in s3://{self.bucket}: {detail}")

    def put(self, key: str, data: bytes) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        name = self._key(key)
        try:
            self._client.put_object(Bucket=self.bucket, Key=name, Body=data)
        except (ClientError, BotoCoreError) as exc:
            raise self._fail("write", key, exc) from exc

    def batch(self, items: Sequence[tuple[str, bytes]]) -> BlobBatch:
        keys = [check_blob_key(key) for key, _ in items]  # refused before any upload
        return BlobBatch(keys, functools.partial(self._upload, list(items)))

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[str]:
        batch = self.batch(items)
        batch.write()
        return batch.keys

    def sweep_abandoned(
        self, referenced: Callable[[str], Collection[str]], *, older_than_s: float
    ) -> SweptBlobs:
        """Nothing to sweep: a batch's objects are stored under the keys offered, so a
        writer that died before its rows committed is redelivered the same messages,
        and the retry writes the same objects again (a bucket lifecycle rule ages out
        what the broker never redelivers)."""
        return SweptBlobs()

    def _upload(self, items: Sequence[tuple[str, bytes]]) -> None:
        if len(items) <= 1 or self.max_concurrency == 1:
            for key, data in items:
                self.put(key, data)
            return
        # Round trips, not bandwidth, bound small-object uploads: a batch in
        # parallel costs about one round trip instead of one per object.
        futures = [self._executor().submit(self.put, key, data) for key, data in items]
        errors = [f.exception() for f in futures]
        failed = [e for e in errors if e is not None]
        if failed:
            first = failed[0]
            if isinstance(first, StoreError):
                raise StoreError(f"{len(failed)} of {len(items)} uploads failed; first: {first}")
            raise StoreError(f"{len(failed)} of {len(items)} uploads failed: {first}") from first

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.max_concurrency, thread_name_prefix="s3-put"
                )
            return self._pool

    def get(self, key: str) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError

        name = self._key(key)
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=name)
            body: bytes = response["Body"].read()
        except ClientError as exc:
            if _error_code(exc) in _MISSING:
                raise StoreError(f"blob {key} does not exist", reason="not_found") from exc
            raise self._fail("read", key, exc) from exc
        except BotoCoreError as exc:
            raise self._fail("read", key, exc) from exc
        return body

    def exists(self, key: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        name = self._key(key)
        try:
            self._client.head_object(Bucket=self.bucket, Key=name)
        except ClientError as exc:
            if _error_code(exc) in _MISSING:
                return False
            raise self._fail("look up", key, exc) from exc
        except BotoCoreError as exc:
            raise self._fail("look up", key, exc) from exc
        return True

    def delete(self, key: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        name = self._key(key)
        try:
            # Deleting a missing object succeeds, as unlinking a missing file does locally.
            self._client.delete_object(Bucket=self.bucket, Key=name)
        except (ClientError, BotoCoreError) as exc:
            raise self._fail("delete", key, exc) from exc

    def close(self) -> None:
        """Stop the upload threads and close the client's connections."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        close = getattr(self._client, "close", None)
        if close is not None:
            close()
