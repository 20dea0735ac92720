"""The SQLite spool: receipts delete, resends after a timeout, bounds and eviction order."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from edge_agent.spool import Spool


def fill(
    spool: Spool, n: int, *, size: int = 100, audit: bool = False, start: int = 0
) -> list[str]:
    ids = [f"s{start + i:04d}" for i in range(n)]
    for i, sid in enumerate(ids):
        assert spool.put(sid, b"x" * size, priority=5, audit=audit, now=float(start + i))
    return ids


def test_put_due_ack(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    ids = fill(spool, 3)
    due = spool.due(now=10.0, resend_after_s=30.0)
    assert [d.sample_id for d in due] == ids
    spool.mark_sent(ids, now=10.0)
    assert spool.due(now=20.0, resend_after_s=30.0) == []  # sent, not yet timed out
    assert [d.sample_id for d in spool.due(now=40.0, resend_after_s=30.0)] == ids
    assert spool.ack([ids[0], "unknown"]) == 1
    assert spool.depth == 2
    assert spool.ack([ids[0]]) == 0  # a repeated receipt is harmless
    stats = spool.stats()
    assert (stats.depth, stats.bytes, stats.acked, stats.stored) == (2, 200, 1, 3)


def test_reset_sent_makes_everything_due(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    ids = fill(spool, 2)
    spool.mark_sent(ids, now=0.0)
    spool.reset_sent()
    assert len(spool.due(now=1.0, resend_after_s=30.0)) == 2
    assert spool.due(now=1.0, resend_after_s=30.0)[0].attempts == 1


def test_urgent_first(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    spool.put("late", b"x", priority=7, audit=False, now=0)
    spool.put("urgent", b"x", priority=1, audit=False, now=1)
    assert [d.sample_id for d in spool.due(now=2, resend_after_s=1)] == ["urgent", "late"]


def test_survives_reopen(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    ids = fill(spool, 4)
    spool.ack(ids[:1])
    spool.close()
    again = Spool(tmp_path / "spool.db")
    assert again.ids() == ids[1:]
    assert again.depth == 3
    assert again.stats().acked == 1


def test_duplicate_id_is_stored_once(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    fill(spool, 1)
    fill(spool, 1)
    assert spool.depth == 1
    assert spool.stats().bytes == 100


def test_eviction_audit_first_then_oldest(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db", max_samples=4)
    normal = fill(spool, 2, start=0)
    audit = fill(spool, 2, audit=True, start=10)
    fill(spool, 2, start=20)  # evicts both audits
    assert spool.ids() == [*normal, "s0020", "s0021"]
    fill(spool, 1, start=30)  # then the oldest
    assert spool.ids() == [normal[1], "s0020", "s0021", "s0030"]
    stats = spool.stats()
    assert (stats.evicted_audit, stats.evicted_oldest) == (2, 1)
    assert not set(audit) & set(spool.ids())


def test_bounded_by_bytes(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db", max_bytes=1 << 16)
    fill(spool, 10, size=10_000)
    stats = spool.stats()
    assert stats.bytes <= 1 << 16
    assert stats.depth == 6
    assert stats.evicted_oldest == 4
    # A sample bigger than the whole spool is refused and counted, not stored.
    assert not spool.put("huge", b"x" * (1 << 17), priority=5, audit=False, now=0)
    assert spool.stats().refused == 1


def test_put_many_is_the_same_as_single_puts(tmp_path: Path) -> None:
    from edge_agent.spool import NewSample

    def batch() -> list[NewSample]:
        return [
            NewSample("a", b"x" * 100, 5, False),
            NewSample("b", b"x" * 100, 5, True),
            NewSample("a", b"x" * 100, 5, False),  # a repeated id is stored once
            NewSample("huge", b"x" * (1 << 17), 5, False),  # refused, counted
            NewSample("c", b"x" * 100, 1, False),
            NewSample("d", b"x" * 100, 5, False),  # evicts the audit sample, then "a"
            NewSample("e", b"x" * 100, 5, True),
        ]

    single = Spool(tmp_path / "single.db", max_bytes=1 << 16, max_samples=3)
    one_by_one = [
        single.put(s.sample_id, s.payload, priority=s.priority, audit=s.audit, now=1.0)
        for s in batch()
    ]
    many = Spool(tmp_path / "many.db", max_bytes=1 << 16, max_samples=3)
    assert many.put_many(batch(), now=1.0) == one_by_one == [True] * 3 + [False] + [True] * 3
    assert many.ids() == single.ids() == ["c", "d", "e"]
    assert many.stats() == single.stats()
    stats = many.stats()
    assert (stats.stored, stats.refused, stats.evicted_audit, stats.evicted_oldest) == (5, 1, 1, 1)
    many.close()
    assert Spool(tmp_path / "many.db").stats() == stats  # counters persisted


def test_a_failed_batch_stores_nothing(tmp_path: Path) -> None:
    import pytest

    from edge_agent.spool import NewSample
    from shared.errors import StoreError

    spool = Spool(tmp_path / "spool.db")
    fill(spool, 2)
    spool._db.execute(
        "CREATE TRIGGER boom BEFORE INSERT ON samples WHEN NEW.sample_id = 'boom'"
        " BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
    )
    before = spool.stats()
    with pytest.raises(StoreError):
        spool.put_many(
            [NewSample("fine", b"y" * 10, 5, False), NewSample("boom", b"y", 5, False)], now=1.0
        )
    assert spool.stats() == before
    assert "fine" not in spool.ids()


def test_settle_marks_sent_and_applies_receipts_in_one_call(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    ids = fill(spool, 4)
    assert spool.settle(sent=ids[:3], acked=[ids[0], ids[3], "unknown"], now=10.0) == 2
    assert spool.ids() == ids[1:3]
    assert spool.due(now=20.0, resend_after_s=30.0) == []
    assert [d.attempts for d in spool.due(now=40.0, resend_after_s=30.0)] == [1, 1]
    stats = spool.stats()
    assert (stats.depth, stats.bytes, stats.acked) == (2, 200, 2)


def test_samples_stored_as_published_wait_for_the_resend_timeout(tmp_path: Path) -> None:
    from edge_agent.spool import NewSample

    spool = Spool(tmp_path / "spool.db")
    fill(spool, 1)  # never sent: due at once
    result = spool.write(
        [NewSample("p1", b"z" * 10, 5, False), NewSample("p2", b"z" * 10, 5, False)],
        now=5.0,
        published=True,
        acked=["s0000"],
    )
    assert (result.stored, result.removed) == ([True, True], 1)
    assert spool.due(now=6.0, resend_after_s=30.0) == []
    assert [d.sample_id for d in spool.due(now=35.0, resend_after_s=30.0)] == ["p1", "p2"]
    spool.reset_sent()  # a reconnect: whatever was in flight is due again
    assert [d.attempts for d in spool.due(now=6.0, resend_after_s=30.0)] == [1, 1]


def test_spool_writer_answers_after_the_commit_and_batches(tmp_path: Path) -> None:
    import threading

    from edge_agent.spool import NewSample
    from edge_agent.spool_writer import SpoolWriter

    spool = Spool(tmp_path / "spool.db")
    writer = SpoolWriter(spool, clock=lambda: 1.0, window_s=0.05, max_batch=8).start()
    seen: list[tuple[str, bool, bool]] = []
    done = threading.Event()

    def callback(sample_id: str) -> Callable[[bool, BaseException | None], None]:
        def stored(ok: bool, error: BaseException | None) -> None:
            assert error is None
            seen.append((sample_id, ok, sample_id in spool.ids()))  # committed already
            if len(seen) == 20:
                done.set()

        return stored

    for i in range(20):
        sid = f"w{i:02d}"
        writer.submit(NewSample(sid, b"p" * 50, 5, False), callback(sid))
    assert done.wait(5.0)
    assert seen == [(f"w{i:02d}", True, True) for i in range(20)]
    assert writer.samples == 20
    assert writer.commits <= 4  # a batch of up to 8 per transaction
    writer.submit(NewSample("late", b"p", 5, False), callback("late"))
    writer.stop()  # stores what is still queued
    assert "late" in spool.ids()
    writer.submit(NewSample("after", b"p", 5, False), lambda ok, err: None)
    assert "after" in spool.ids()  # after stop: stored on the caller's thread


def test_a_new_spool_takes_its_page_size_and_an_old_one_keeps_its_own(tmp_path: Path) -> None:
    import sqlite3

    from edge_agent.spool import PAGE_SIZE

    spool = Spool(tmp_path / "new.db")
    ids = fill(spool, 3, size=50_000)
    assert spool._db.execute("PRAGMA page_size").fetchone()[0] == PAGE_SIZE == 4096
    spool.close()
    again = Spool(tmp_path / "new.db")
    assert [d.sample_id for d in again.due(now=10.0, resend_after_s=30.0)] == ids
    again.close()

    # A spool written by an older agent (32 KiB pages) opens as it is.
    old = sqlite3.connect(tmp_path / "old.db")
    old.execute("PRAGMA page_size=32768")
    old.execute("PRAGMA journal_mode=WAL")
    old.execute("CREATE TABLE unrelated (x INTEGER)")
    old.close()
    kept = Spool(tmp_path / "old.db")
    assert kept._db.execute("PRAGMA page_size").fetchone()[0] == 32768
    ids = fill(kept, 2, size=50_000)
    assert [d.sample_id for d in kept.due(now=10.0, resend_after_s=30.0)] == ids
    kept.close()


def test_a_receipt_does_not_write_the_samples_payload_again(tmp_path: Path) -> None:
    """SQLite built with SECURE_DELETE (Debian's is) zeroes every page a delete frees,
    which cost a receipted sample its whole payload again in writes; the spool asks
    for FAST, which only clears what the delete writes anyway."""
    spool = Spool(tmp_path / "spool.db")
    ids = fill(spool, 20, size=50_000)
    spool._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    wal = tmp_path / "spool.db-wal"
    assert wal.stat().st_size == 0
    assert spool.ack(ids) == 20
    # Zeroing the freed pages wrote 1.5 MB here, more than the payloads; now 0.3 MB.
    assert wal.stat().st_size < 20 * 50_000 // 2
    assert spool._db.execute("PRAGMA secure_delete").fetchone()[0] == 2  # FAST
    spool.close()
