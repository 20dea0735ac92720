"""shared.checksum: the CRC-32 envelopes and the spool store, equal to zlib's."""

from __future__ import annotations

import zlib

import pytest

from shared.checksum import crc32


@pytest.mark.parametrize("size", [0, 1, 15, 16, 63, 64, 4095, 45_000])
def test_crc32_equals_zlib_for_every_buffer_kind(size: int) -> None:
    data = bytes((i * 131 + 7) % 256 for i in range(size))
    expected = zlib.crc32(data)
    assert crc32(data) == expected
    assert crc32(bytearray(data)) == expected
    assert crc32(memoryview(b"xyz" + data)[3:]) == expected


def test_crc32_continues_from_a_value_as_zlib_does() -> None:
    head, tail = b'{"sample_id": "s1"}', bytes(range(256)) * 100
    assert crc32(tail, crc32(head)) == zlib.crc32(head + tail)
    assert crc32(tail, 12345) == zlib.crc32(tail, 12345)
