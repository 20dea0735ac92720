"""Sample ids (UUIDv7, RFC 9562) and the UTC timestamps that travel with them.

A sample id is made on the edge and keys every store, so a sample delivered twice
is stored once. UUIDv7 puts a 48-bit Unix millisecond timestamp first, so ids sort
by creation time; here the 12-bit ``rand_a`` field is a counter (RFC 9562, section
6.2, method 1) so ids made in one process are strictly increasing even when many
fall in the same millisecond:

    unix_ts_ms (48) | ver=7 (4) | counter (12) | var=0b10 (2) | random (62)

The random bits come from the operating system's CSPRNG, read 4 KiB at a time
(``OsRandomBits``): ``os.urandom`` lets go of the GIL around its system call, so
one call per id made every id a GIL hand-off, and the thread making it had to win
the GIL back from whichever thread took it (with one busy Python thread beside it,
an id took two orders of magnitude longer than with bits read ahead).

``UtcDatetime`` is the timestamp type every message field uses: it accepts an
aware ``datetime`` or an ISO 8601 string with an offset, refuses naive times and
numbers, stores UTC, and serialises as ``2024-05-01T12:00:00.123456Z``.
"""

from __future__ import annotations

import os
import re
import threading
import time
import weakref
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer

from shared.errors import InvalidIdError

__all__ = [
    "OsRandomBits",
    "SampleIdGenerator",
    "UtcDatetime",
    "format_utc",
    "new_sample_id",
    "parse_utc",
    "sample_id_time",
    "validate_sample_id",
]

_UUID7_RE = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", re.IGNORECASE
)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_COUNTER_MAX = 0xFFF
# A new millisecond seeds the counter in the lower half of its range, so at least
# 2048 ids fit in one millisecond before the timestamp has to be bumped.
_SEED_BITS = 11


class OsRandomBits:
    """``randbits(k)`` from ``os.urandom``, read ``chunk`` bytes ahead; not thread-safe.

    A forked child drops what its parent read ahead, so the two never share bits.
    """

    def __init__(self, chunk: int = 4096) -> None:
        self._chunk = chunk
        self._buffer = b""
        self._at = 0
        _read_ahead.add(self)

    def __call__(self, bits: int) -> int:
        size = (bits + 7) // 8
        if self._at + size > len(self._buffer):
            self._buffer = os.urandom(max(self._chunk, size))
            self._at = 0
        value = int.from_bytes(self._buffer[self._at : self._at + size], "big")
        self._at += size
        return value >> (8 * size - bits)

    def forget(self) -> None:
        """Drop the bits read ahead (the next call reads fresh ones)."""
        self._buffer = b""
        self._at = 0


_read_ahead: weakref.WeakSet[OsRandomBits] = weakref.WeakSet()


def _forget_read_ahead() -> None:
    for source in list(_read_ahead):
        source.forget()


os.register_at_fork(after_in_child=_forget_read_ahead)


class SampleIdGenerator:
    """Makes strictly increasing UUIDv7 strings; ``clock_ns`` is a seam for tests.

    ``randbits`` is called under the generator's lock (the default is not thread-safe).
    """

    def __init__(
        self,
        clock_ns: Callable[[], int] = time.time_ns,
        randbits: Callable[[int], int] | None = None,
    ) -> None:
        self._clock_ns = clock_ns
        self._randbits = randbits or OsRandomBits()
        # Guards the (millisecond, counter) pair; several threads make ids.
        self._lock = threading.Lock()
        self._last_ms = -1
        self._counter = 0

    def __call__(self) -> str:
        """Return a new id, greater than every id this generator made before."""
        with self._lock:
            now_ms = self._clock_ns() // 1_000_000
            if now_ms > self._last_ms:
                self._last_ms = now_ms
                self._counter = self._randbits(_SEED_BITS)
            else:
                # Same millisecond, or the wall clock stepped back: keep counting.
                self._counter += 1
                if self._counter > _COUNTER_MAX:
                    self._last_ms += 1
                    self._counter = self._randbits(_SEED_BITS)
            ms, counter = self._last_ms, self._counter
            low = self._randbits(62)
        value = (ms & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | low
        h = f"{value:032x}"
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_generator = SampleIdGenerator()


def new_sample_id() -> str:
    """Return a new UUIDv7 sample id, monotonic within this process."""
    return _generator()


def validate_sample_id(value: object) -> str:
    """Return ``value`` as a canonical lowercase UUIDv7 string, or raise InvalidIdError."""
    if isinstance(value, str) and len(value) == 36 and _UUID7_RE.fullmatch(value):
        return value.lower()
    shown = repr(value) if not isinstance(value, str) or len(value) <= 64 else repr(value[:64])
    raise InvalidIdError(
        f"sample id {shown} is not valid: expected a UUIDv7 (RFC 9562) in canonical form,"
        " like '0190f5c2-7a1b-7c3d-8e4f-0123456789ab'"
    )


def sample_id_time(sample_id: str) -> datetime:
    """Return the UTC creation time (millisecond precision) encoded in a UUIDv7 id."""
    canonical = validate_sample_id(sample_id)
    ms = int(canonical[:8] + canonical[9:13], 16)
    return _EPOCH + timedelta(milliseconds=ms)


def parse_utc(value: object) -> datetime:
    """Return an aware datetime or ISO 8601 string as a UTC datetime; refuse naive times."""
    if isinstance(value, str):
        if len(value) > 64:
            raise ValueError("timestamp string is too long")
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(
                "timestamp is not ISO 8601: use a form like 2024-05-01T12:00:00Z"
            ) from None
    if not isinstance(value, datetime):
        raise ValueError(f"expected an ISO 8601 timestamp string, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError("timestamp has no time zone: give an offset, such as Z for UTC")
    try:
        return value.astimezone(UTC)
    except OverflowError:  # 9999-12-31T23:00-05:00 is past datetime.max in UTC
        raise ValueError("timestamp is out of range") from None


def format_utc(value: datetime) -> str:
    """Return an aware datetime as ISO 8601 in UTC with a 'Z' suffix."""
    return value.astimezone(UTC).replace(tzinfo=None).isoformat() + "Z"


UtcDatetime = Annotated[
    datetime,
    BeforeValidator(parse_utc),
    PlainSerializer(format_utc, return_type=str, when_used="json"),
]
