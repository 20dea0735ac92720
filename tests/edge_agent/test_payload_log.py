"""The spool's payload log: payloads in segment files, rows in SQLite, and what a
receipt, a rotation, a restart, a damaged file and a failed transaction do to them."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from edge_agent.spool import NewSample, Spool
from shared.errors import StoreError


def payload(i: int, size: int = 1000) -> bytes:
    return (f"sample {i:05d} ".encode() * size)[:size]


def fill(spool: Spool, ids: range, size: int = 1000, batch: int = 1) -> list[str]:
    names = [f"s{i:05d}" for i in ids]
    for start in range(0, len(names), batch):
        chunk = [
            NewSample(name, payload(int(name[1:]), size), 5, False)
            for name in names[start : start + batch]
        ]
        assert all(spool.put_many(chunk, now=1.0))
    return names


def due(spool: Spool) -> dict[str, bytes]:
    return {d.sample_id: d.payload for d in spool.due(now=100.0, resend_after_s=1.0, limit=10_000)}


def segments(spool: Spool) -> list[str]:
    return sorted(p.name for p in spool.payload_folder.iterdir())


def test_payloads_live_in_segment_files_not_in_sqlite(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    ids = fill(spool, range(20), size=50_000, batch=4)
    assert due(spool) == {sid: payload(int(sid[1:]), 50_000) for sid in ids}
    spool._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert (tmp_path / "spool.db").stat().st_size < 100_000  # rows only
    assert segments(spool) == ["0000000001.seg"]
    assert (spool.payload_folder / "0000000001.seg").stat().st_size == 20 * 50_000
    spool.close()


def test_a_segment_goes_once_every_sample_in_it_is_receipted(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db", segment_bytes=10_000)
    ids = fill(spool, range(30))  # ten samples a segment
    assert segments(spool) == ["0000000001.seg", "0000000002.seg", "0000000003.seg"]
    spool.ack(ids[:9])
    assert len(segments(spool)) == 3  # one sample of the first is still waiting
    spool.ack(ids[9:10])
    assert segments(spool) == ["0000000002.seg", "0000000003.seg"]
    spool.ack(ids[10:])
    assert segments(spool) == ["0000000003.seg"]  # the current one stays, empty or not
    assert spool.stats().depth == 0
    spool.close()


def test_a_sparse_old_segment_is_compacted_into_the_new_one(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db", segment_bytes=10_000)
    ids = fill(spool, range(20))  # segments 1 and 2, ten samples each
    spool.ack([sid for sid in ids[:10] if sid not in ("s00003", "s00007")])
    fill(spool, range(20, 21))  # rotates: segment 1 holds 2 KB of 10, so it moves
    assert "0000000001.seg" not in segments(spool)
    left = due(spool)
    assert set(left) == {"s00003", "s00007", *ids[10:], "s00020"}
    assert all(data == payload(int(sid[1:])) for sid, data in left.items())
    stats = spool.stats()
    assert (stats.depth, stats.bytes, stats.lost) == (13, 13_000, 0)
    spool.close()


def test_a_restart_reads_the_same_payloads_and_clears_leftovers(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    ids = fill(spool, range(5))
    folder = spool.payload_folder
    spool.close()
    # A crash after a commit and before a deletion leaves a file no row refers to.
    (folder / "0000000000.seg").write_bytes(b"stale")
    again = Spool(tmp_path / "spool.db")
    assert due(again) == {sid: payload(int(sid[1:])) for sid in ids}
    assert segments(again) == ["0000000001.seg", "0000000002.seg"]  # appends start anew
    fill(again, range(5, 7))
    assert (folder / "0000000002.seg").stat().st_size == 2000
    assert again.ack(ids) == 5
    assert segments(again) == ["0000000002.seg"]
    again.close()


def test_a_damaged_payload_is_dropped_and_counted_never_published(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    ids = fill(spool, range(4))
    segment = spool.payload_folder / "0000000001.seg"
    with open(segment, "r+b") as f:  # a power cut lost the second sample's bytes
        f.seek(1000)
        f.write(b"\0" * 1000)
    assert set(due(spool)) == {ids[0], ids[2], ids[3]}
    stats = spool.stats()
    assert (stats.depth, stats.bytes, stats.lost) == (3, 3000, 1)
    os.truncate(segment, 2500)  # and the tail of the file
    assert set(due(spool)) == {ids[0]}
    assert spool.stats().lost == 3
    spool.close()


def test_a_spool_from_before_the_payload_log_keeps_its_samples(tmp_path: Path) -> None:
    old = sqlite3.connect(tmp_path / "spool.db")
    old.executescript(
        """
        CREATE TABLE samples (
            seq INTEGER PRIMARY KEY AUTOINCREMENT, sample_id TEXT NOT NULL UNIQUE,
            created_at REAL NOT NULL, priority INTEGER NOT NULL, audit INTEGER NOT NULL,
            size INTEGER NOT NULL, sent_at REAL, attempts INTEGER NOT NULL DEFAULT 0,
            payload BLOB NOT NULL);
        CREATE INDEX samples_due ON samples (sent_at, priority, seq);
        CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
        INSERT INTO samples (sample_id, created_at, priority, audit, size, payload)
            VALUES ('inline', 0, 5, 0, 6, x'696e6c696e65');
        """
    )
    old.commit()
    old.close()
    spool = Spool(tmp_path / "spool.db")
    fill(spool, range(2))
    assert due(spool) == {"inline": b"inline", "s00000": payload(0), "s00001": payload(1)}
    assert spool.ack(["inline", "s00000"]) == 2
    assert (spool.stats().depth, spool.stats().bytes) == (1, 1000)
    spool.close()


def test_a_failed_transaction_takes_back_its_appended_bytes(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    fill(spool, range(2))
    spool._db.execute(
        "CREATE TRIGGER boom BEFORE INSERT ON samples WHEN NEW.sample_id = 'boom'"
        " BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
    )
    with pytest.raises(StoreError):
        spool.put_many(
            [NewSample("fine", b"y" * 500, 5, False), NewSample("boom", b"y", 5, False)], now=1.0
        )
    assert (spool.payload_folder / "0000000001.seg").stat().st_size == 2000
    fill(spool, range(2, 3))
    assert set(due(spool)) == {"s00000", "s00001", "s00002"}
    spool.close()


def test_a_full_disk_is_a_store_error_and_loses_nothing_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    spool = Spool(tmp_path / "spool.db")
    ids = fill(spool, range(2))

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(StoreError, match="No space left"):
        spool.put("more", b"z" * 100, priority=5, audit=False, now=2.0)
    monkeypatch.undo()
    assert due(spool) == {sid: payload(int(sid[1:])) for sid in ids}
    assert spool.stats().depth == 2
    spool.close()


def test_running_out_of_disk_while_compacting_is_a_store_error_and_the_spool_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    spool = Spool(tmp_path / "spool.db", segment_bytes=10_000)
    ids = fill(spool, range(20))
    spool.ack([sid for sid in ids[:10] if sid != "s00003"])  # segment 1 is due for compaction
    calls = 0
    pwritev = os.pwritev

    def full_on_the_move(*args: object) -> int:
        nonlocal calls
        calls += 1
        if calls == 2:  # the new sample went in; moving segment 1's payload does not
            raise OSError(errno.ENOSPC, "No space left on device")
        return pwritev(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwritev", full_on_the_move)
    with pytest.raises(StoreError, match="No space left"):
        spool.put("more", payload(99), priority=5, audit=False, now=2.0)
    monkeypatch.undo()
    assert set(due(spool)) == {"s00003", *ids[10:]}  # nothing stored, nothing lost
    fill(spool, range(20, 21))  # the transaction was rolled back: the next one commits
    assert set(due(spool)) == {"s00003", *ids[10:], "s00020"}
    spool.close()
