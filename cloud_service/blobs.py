"""Blob storage by key: the local-folder implementation and the factory.

The interface and key rules live in ``cloud_service.blobs_base`` and are importable here.
``open_blob_store(settings)`` builds the store the settings name: the local folder
by default, an S3-compatible bucket (``cloud_service.blobs_s3``) when ``blob_url``
is ``s3://bucket[/prefix]``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cloud_service.blobs_base import BlobStore, check_blob_key, sample_image_key
from cloud_service.blobs_s3 import S3BlobStore
from shared.errors import StoreError

if TYPE_CHECKING:
    from cloud_service.settings import CloudSettings

__all__ = ["BlobStore", "LocalBlobStore", "check_blob_key", "open_blob_store", "sample_image_key"]


def _load_syncfs() -> Callable[[int], int] | None:
    """libc's syncfs(2) (Linux), which flushes one filesystem; None where it is missing."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function: Callable[[int], int] = libc.syncfs
        return function
    except (OSError, AttributeError):
        return None


_syncfs = _load_syncfs()
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


class LocalBlobStore:
    """Blobs as files under ``root``; a blob is never seen half-written (see ``_write``)."""

    def __init__(self, root: Path, *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / check_blob_key(key)

    def put(self, key: str, data: bytes) -> None:
        self._write(key, data, fsync=self.fsync, in_place=False)

    def _write(self, key: str, data: bytes, *, fsync: bool, in_place: bool = True) -> None:
        """Write ``data`` as the blob ``key``; ``put`` always replaces atomically.

        For ``put_many`` (``in_place``), a new blob is written in place: its callers
        (ingest) point no row at it until the batch commits, after the write is
        durable, so nothing reads it half-written. A blob that exists already (a
        redelivered sample's, or what a crash left of one) is replaced atomically:
        a temporary file beside it, renamed over it.
        """
        path = str(self._path(key))
        try:
            if not in_place:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self._replace(path, data, fsync=fsync)
                return
            try:
                fd = os.open(path, _CREATE_FLAGS, 0o600)
            except FileNotFoundError:  # the folder's first blob (or it was removed)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(path, _CREATE_FLAGS, 0o600)
            except FileExistsError:
                self._replace(path, data, fsync=fsync)
                return
            try:
                self._fill(fd, data, fsync=fsync)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise
        except OSError as exc:
            raise StoreError(f"cannot write blob {key}: {exc.strerror or exc}") from exc

    def _replace(self, path: str, data: bytes, *, fsync: bool) -> None:
        folder, name = os.path.split(path)
        tmp = os.path.join(folder, f".{name}.{os.urandom(6).hex()}.tmp")
        fd = os.open(tmp, _CREATE_FLAGS, 0o600)
        try:
            self._fill(fd, data, fsync=fsync)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @staticmethod
    def _fill(fd: int, data: bytes, *, fsync: bool) -> None:
        """Write all of ``data`` to ``fd`` (fsync'd if asked), then close it."""
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        if not self.fsync or len(items) <= 1 or _syncfs is None:
            for key, data in items:
                self._write(key, data, fsync=self.fsync)
            return
        # One syncfs for the batch instead of an fsync per file: an fsync per file
        # alone held ingest to a few hundred samples/s on a local disk.
        for key, data in items:
            self._write(key, data, fsync=False)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            if _syncfs(fd) != 0:
                raise StoreError(f"syncfs of the blob store failed: errno {ctypes.get_errno()}")
        finally:
            os.close(fd)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError as exc:
            raise StoreError(f"blob {key} does not exist", reason="not_found") from exc
        except OSError as exc:
            raise StoreError(f"cannot read blob {key}: {exc.strerror or exc}") from exc

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot delete blob {key}: {exc.strerror or exc}") from exc


def open_blob_store(settings: CloudSettings) -> BlobStore:
    """The blob store the settings name: ``blob_url`` (s3://...) if set, else the local folder."""
    if settings.blob_url is not None:
        return S3BlobStore.from_settings(settings)
    return LocalBlobStore(settings.resolved_blob_dir, fsync=settings.blob_fsync)
