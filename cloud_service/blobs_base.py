"""The blob store interface and its key rules, shared by every implementation.

Keys are relative, slash-separated paths such as ``samples/{fleet}/{agent}/{id}.jpg``.
The local folder (``cloud_service.blobs``) and the S3 bucket (``cloud_service.blobs_s3``)
both check keys with ``check_blob_key``; ``cloud_service.blobs.open_blob_store`` picks one.

A batch (``batch``, ``put_many``) may be stored under keys of the store's choosing:
the local folder packs a batch into one file, and each blob is then read back by
the key the batch gave it (``BlobBatch.keys``), never by the key it was offered under.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from shared.errors import StoreError

__all__ = ["BlobBatch", "BlobStore", "SweptBlobs", "check_blob_key", "sample_image_key"]

_KEY_RE = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")


@dataclass(frozen=True)
class BlobBatch:
    """Blobs about to be stored: the key each is read back by, known before ``write``.

    ``write()`` makes them all durable (one flush for all where possible). Until it
    returns, a key may be seen half-written, so point nothing at these keys before
    then (ingest inserts rows while the batch is written and commits after).
    """

    keys: list[str]
    write: Callable[[], None]
    # Whether every key is a name this batch alone uses (the local folder's pack
    # members): a key whose row was not stored is then referred to by nothing, and
    # its blob can be deleted. An offered key (S3) may be another write's as well.
    fresh: bool = False
    # Call once what points at the keys is committed (or nothing ever will): until
    # then, should this process die, a later ``sweep_abandoned`` by another process
    # deletes the blobs that nothing points at.
    settle: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class SweptBlobs:
    """What one ``sweep_abandoned`` found and did."""

    batches: int = 0  # abandoned batches looked at (their writers had died unsettled)
    bytes_deleted: int = 0  # bytes of blobs nothing pointed at, deleted
    bytes_kept: int = 0  # bytes of blobs something pointed at, kept

    def __add__(self, other: SweptBlobs) -> SweptBlobs:
        return SweptBlobs(
            self.batches + other.batches,
            self.bytes_deleted + other.bytes_deleted,
            self.bytes_kept + other.bytes_kept,
        )


@runtime_checkable
class BlobStore(Protocol):
    """Where images and artifacts live. ``put`` returns only once the bytes are durable."""

    def put(self, key: str, data: bytes) -> None: ...

    def batch(self, items: Sequence[tuple[str, bytes]]) -> BlobBatch:
        """Several blobs to store, in order; their keys may differ from those offered."""
        ...

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[str]:
        """``batch(items)``, written: the keys the blobs are stored under, in order."""
        ...

    def get(self, key: str) -> bytes: ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def sweep_abandoned(
        self, referenced: Callable[[str], Collection[str]], *, older_than_s: float
    ) -> SweptBlobs:
        """Delete the blobs of batches whose writing process died before they settled,
        written at least ``older_than_s`` ago, that nothing points at: ``referenced(prefix)``
        names the keys under ``prefix`` that something points at."""
        ...


def sample_image_key(fleet: str, agent: str, sample_id: str, image_format: str) -> str:
    """The key of a sample's image (ids were validated, so they are safe path parts)."""
    ext = "jpg" if image_format == "jpeg" else image_format
    # The first 8 hex digits of a UUIDv7 are its time prefix (~18 h buckets), which
    # keeps any one folder from holding millions of files.
    return f"samples/{fleet}/{agent}/{sample_id[:8]}/{sample_id}.{ext}"


def check_blob_key(key: str) -> str:
    """``key`` if it is a relative a/b/c.ext path of safe parts; StoreError otherwise."""
    if not _KEY_RE.fullmatch(key) or any(part in (".", "..") for part in key.split("/")):
        raise StoreError(f"blob key {key!r} is not valid: use relative a/b/c.ext paths")
    return key
