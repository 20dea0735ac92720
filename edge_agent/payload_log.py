"""The spool's payloads: append-only segment files beside its SQLite index.

A forwarded sample's envelope (tens of KB) is appended to the newest segment file,
one ``pwritev`` for a transaction's samples, and its row in the spool records where
(segment, offset, size) and its CRC-32. Kept in SQLite instead, every payload was
written twice (into the WAL, then by the checkpoint into the database) as 4 KiB
pages with a checksum each, and a receipt walked its overflow pages to free them:
about 100 us of CPU per 23 KB sample on the reference host, against about 10 us for
the append (``docs/performance.md``, spool).

A segment is deleted whole once no row refers to it, so a receipt costs no payload
I/O. The newest segment takes appends until it holds ``segment_bytes``; then a new
one starts, and the oldest closed segment, when under a quarter of its bytes are
still referred to, is compacted: ``Spool`` moves its live payloads into the new
segment, so a few samples that wait long for their receipts cannot hold many
segments' disk.

Durability matches the spool's SQLite settings (WAL, synchronous=NORMAL): appends
are not fsynced, so a committed sample survives a crash of the agent process, and a
power cut may lose the last ones. A row whose payload did not reach the disk is found
by its CRC when it is read, and the spool drops it (counted ``lost``), never publishes it.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared.checksum import crc32

__all__ = ["SEGMENT_BYTES", "PayloadLog", "Placement", "SegmentChanges"]

SEGMENT_BYTES = 16 << 20
_SUFFIX = ".seg"
_IOV_MAX = 512  # buffers per pwritev, well under the kernel's limit (1024)


@dataclass(frozen=True)
class Placement:
    """Where one payload is: its segment, offset, size and CRC-32."""

    segment: int
    offset: int
    size: int
    crc: int


@dataclass
class SegmentChanges:
    """What one transaction does to the rows referring to each segment."""

    rows: Counter[int] = field(default_factory=Counter)
    bytes: Counter[int] = field(default_factory=Counter)

    def add(self, segment: int, size: int, rows: int = 1) -> None:
        self.rows[segment] += rows
        self.bytes[segment] += size

    def remove(self, segment: int, size: int, rows: int = 1) -> None:
        self.add(segment, -size, -rows)


def _segment_name(segment: int) -> str:
    return f"{segment:010d}{_SUFFIX}"


class PayloadLog:
    """Segment files in ``folder``; not thread-safe (the spool's lock guards it).

    ``rows`` and ``bytes`` count, per segment, the spool's rows referring to it: as
    its index says at ``open`` and as its committed transactions change them.
    """

    def __init__(self, folder: Path, *, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.folder = Path(folder)
        self.segment_bytes = segment_bytes
        self.rows: Counter[int] = Counter()
        self.bytes: Counter[int] = Counter()
        self._readers: dict[int, int] = {}
        self._current = 0
        self._fd = -1
        self._end = 0

    # --- opening and closing ------------------------------------------------------

    def open(self, live: Iterable[tuple[int, int, int]]) -> None:
        """Start a fresh segment after every one on disk or in ``live`` (segment, rows,
        bytes: the spool's index); delete files no row refers to (a crash between a
        commit and the deletion leaves them)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for segment, rows, size in live:
            if rows > 0:
                self.rows[segment], self.bytes[segment] = rows, size
        on_disk = self._on_disk()
        for segment in on_disk:
            if segment not in self.rows:
                self._remove(segment)
        self._start(max([*on_disk, *self.rows, 0]) + 1)

    def close(self) -> None:
        for fd in [self._fd, *self._readers.values()]:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._readers.clear()
        self._fd = -1

    def _start(self, segment: int) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        path = self.folder / _segment_name(segment)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self._current, self._end = segment, 0

    # --- writing -------------------------------------------------------------------

    @property
    def end(self) -> int:
        """Bytes appended to the current segment."""
        return self._end

    def rotate_for(self, incoming: int) -> int | None:
        """Start a new segment when ``incoming`` more bytes would take the current one
        past ``segment_bytes``; then the closed segment due for compaction, if any: the
        oldest with rows left, when they hold under a quarter of its bytes."""
        if not self._end or self._end + incoming <= self.segment_bytes:
            return None
        closed = self._current
        self._start(closed + 1)
        if not self.rows.get(closed):
            self._remove(closed)
        older = sorted(segment for segment in self.rows if segment != self._current)
        if not older:
            return None
        oldest = older[0]
        try:
            size = os.fstat(self._reader(oldest)).st_size
        except OSError:
            return None
        return oldest if self.bytes[oldest] < size / 4 else None

    def append(self, payloads: Sequence[bytes]) -> list[Placement]:
        """Append ``payloads`` to the current segment in one system call; where each is.
        Raises OSError (the disk is full, say), having appended nothing for good."""
        placements: list[Placement] = []
        start = at = self._end
        for payload in payloads:
            placements.append(Placement(self._current, at, len(payload), crc32(payload)))
            at += len(payload)
        if not placements:
            return placements
        try:
            offset = start
            for first in range(0, len(payloads), _IOV_MAX):
                chunk = payloads[first : first + _IOV_MAX]
                want = sum(len(p) for p in chunk)
                written = os.pwritev(self._fd, chunk, offset)
                if written < want:  # a short write: the rest, from where it stopped
                    rest = memoryview(b"".join(chunk))[written:]
                    while rest:
                        n = os.pwrite(self._fd, rest, offset + written)
                        written += n
                        rest = rest[n:]
                offset += want
        except OSError:
            self.undo(start)
            raise
        self._end = at
        return placements

    def undo(self, end: int) -> None:
        """Forget what was appended past ``end`` (its transaction did not commit)."""
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, end)
        self._end = end

    def commit(self, changes: SegmentChanges) -> None:
        """A transaction committed ``changes``; closed segments no row refers to any
        more are deleted."""
        self.rows.update(changes.rows)
        self.bytes.update(changes.bytes)
        for segment in [s for s, rows in self.rows.items() if rows <= 0]:
            del self.rows[segment]
            self.bytes.pop(segment, None)
            if segment != self._current:
                self._remove(segment)

    def _remove(self, segment: int) -> None:
        fd = self._readers.pop(segment, -1)
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            (self.folder / _segment_name(segment)).unlink()

    # --- reading -------------------------------------------------------------------

    def _reader(self, segment: int) -> int:
        if segment == self._current:
            return self._fd
        fd = self._readers.get(segment)
        if fd is None:
            fd = os.open(self.folder / _segment_name(segment), os.O_RDONLY | os.O_CLOEXEC)
            self._readers[segment] = fd
        return fd

    def read(self, place: Placement) -> bytes | None:
        """The payload stored at ``place``, or None when it is missing or damaged."""
        try:
            data = os.pread(self._reader(place.segment), place.size, place.offset)
        except OSError:
            return None
        if len(data) != place.size or crc32(data) != place.crc:
            return None
        return data

    def _on_disk(self) -> list[int]:
        """The segment files in the folder."""
        found = []
        for path in self.folder.glob(f"*{_SUFFIX}"):
            with contextlib.suppress(ValueError):
                found.append(int(path.name.removesuffix(_SUFFIX)))
        return found
