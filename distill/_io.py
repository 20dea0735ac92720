"""Atomic file writes and cache entries: readers never see a half-written model,
metrics file or cache entry."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_json",
    "build_entry",
    "cache_lock",
]


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same directory, so the final os.replace is a rename on one filesystem.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_json(path: Path, obj: Any, *, default: Callable[[Any], Any] | None = None) -> None:
    atomic_write_bytes(
        path, (json.dumps(obj, indent=2, sort_keys=True, default=default) + "\n").encode()
    )


@contextlib.contextmanager
def cache_lock(cache_dir: Path, name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``cache_dir/.locks/<name>`` (no-op where flock is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    locks = cache_dir / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / name, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def build_entry(cache_dir: Path, name: str) -> Iterator[Path]:
    """A scratch folder that becomes ``cache_dir/name`` by one rename if the block succeeds."""
    final = cache_dir / name
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=cache_dir))
    try:
        yield tmp
        if final.exists():  # an incomplete leftover; a complete one was checked for earlier
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
