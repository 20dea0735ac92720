"""The SQLite spool: receipts delete, resends after a timeout, bounds and eviction order."""

from __future__ import annotations

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
