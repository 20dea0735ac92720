"""Schedules: cron, intervals and triggers fire on their conditions and not otherwise."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from cloud_service.db.models import Agent, Sample, Verdict
from cloud_service.jobs import queue as jobs
from cloud_service.jobs import schedules
from shared.errors import ContractError
from shared.ids import new_sample_id

T0 = datetime(2026, 12, 7, 10, 0, tzinfo=UTC)  # a Monday


def test_cron_next_fire_times() -> None:
    assert schedules.parse_cron("0 3 * * *").next_after(T0) == T0.replace(hour=3) + timedelta(1)
    assert schedules.parse_cron("*/15 * * * *").next_after(T0) == T0 + timedelta(minutes=15)
    assert schedules.parse_cron("30 9-17/2 * * 1-5").next_after(T0) == T0.replace(
        hour=11, minute=30
    )
    # Sunday as 0 and as 7
    sunday = datetime(2026, 12, 13, 0, 0, tzinfo=UTC)
    assert schedules.parse_cron("0 0 * * 0").next_after(T0) == sunday
    assert schedules.parse_cron("0 0 * * 7").next_after(T0) == sunday
    assert schedules.parse_cron("0 0 1 1 *").next_after(T0) == datetime(2027, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0 3 * *", "has 4 fields; expected 5"),
        ("61 * * * *", "bad minute field '61': values must be in 0-59"),
        ("* 24 * * *", "bad hour field"),
        ("* * * * mon", "bad day-of-week field 'mon'"),
        ("*/0 * * * *", "bad minute field"),
        ("0 0 31 2 *", "never fires"),
    ],
)
def test_bad_cron_gets_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(ContractError, match=message):
        schedules.parse_cron(text)


def test_bad_schedules_are_refused(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as s:
        with pytest.raises(ContractError, match="bad minute field"):
            schedules.create_schedule(session=s, name="x", kind="cron", expression="99 * * * *")
        with pytest.raises(ContractError, match="at least 10 s"):
            schedules.create_schedule(session=s, name="x", kind="interval", expression="1")
        with pytest.raises(ContractError, match="unknown trigger 'moon'"):
            schedules.create_schedule(session=s, name="x", kind="trigger", expression="moon")
        with pytest.raises(ContractError, match="needs max_forward_rate or max_disagreement"):
            schedules.create_schedule(session=s, name="x", kind="trigger", expression="drift")
        with pytest.raises(ContractError, match="unknown job parameter"):
            schedules.create_schedule(
                session=s, name="x", kind="interval", expression="60", params={"epoch": 1}
            )


def test_cron_and_interval_fire_when_due_and_once(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as s:
        cron = schedules.create_schedule(
            session=s, name="nightly", kind="cron", expression="0 3 * * *", now=T0
        ).id
        every = schedules.create_schedule(
            session=s, name="hourly", kind="interval", expression="3600", now=T0
        ).id
        schedules.create_schedule(
            session=s, name="off", kind="interval", expression="60", enabled=False, now=T0
        )
    with sessions.begin() as s:
        assert schedules.tick(session=s, now=T0 + timedelta(minutes=59)) == []
    with sessions.begin() as s:
        fired = schedules.tick(session=s, now=T0 + timedelta(minutes=61))
        assert [jobs.get_job(session=s, job_id=j).schedule_id for j in fired] == [every]
    with sessions.begin() as s:  # the same instant again: nothing new
        assert schedules.tick(session=s, now=T0 + timedelta(minutes=61)) == []
    with sessions.begin() as s:
        fired = schedules.tick(session=s, now=T0 + timedelta(hours=17, minutes=1))
        assert sorted(jobs.get_job(session=s, job_id=j).schedule_id for j in fired) == sorted(
            [cron, every]
        )


def test_enable_disable_and_run_now(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as s:
        sid = schedules.create_schedule(
            session=s, name="h", kind="interval", expression="60", params={"epochs": 2}, now=T0
        ).id
        schedules.set_enabled(session=s, schedule_id=sid, enabled=False)
    with sessions.begin() as s:
        assert schedules.tick(session=s, now=T0 + timedelta(hours=1)) == []
        job = schedules.run_now(session=s, schedule_id=sid)
        assert job.params == {"epochs": 2} and "run now" in (job.reason or "")
    with sessions.begin() as s:
        schedules.set_enabled(session=s, schedule_id=sid, enabled=True, now=T0)
        assert len(schedules.tick(session=s, now=T0 + timedelta(minutes=2))) == 1


def _add_verified(s: Session, n: int, *, at: datetime, agree: bool, fleet: str = "default") -> None:
    for i in range(n):
        sid = new_sample_id()
        when = at + timedelta(seconds=i)
        s.add(
            Sample(
                sample_id=sid,
                fleet=fleet,
                agent_id="cam",
                captured_at=when,
                model_name="m",
                model_version="v",
                edge_scores=[1.0],
                edge_predicted=0,
                edge_confidence=0.5,
                route_reason="low_confidence",
                image_key=f"k/{sid}",
                image_format="png",
                image_width=8,
                image_height=8,
                image_bytes=1,
                status="verified",
                verified_at=when,
            )
        )
        s.add(
            Verdict(
                sample_id=sid,
                teacher_model="t",
                teacher_version="1",
                scores=[1.0],
                label=0,
                confidence=0.9,
                agrees_with_edge=agree,
                verified_at=when,
            )
        )


def test_new_samples_trigger(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as s:
        schedules.create_schedule(
            session=s,
            name="enough",
            kind="trigger",
            expression="new_samples",
            trigger={"min_samples": 20},
        )
        _add_verified(s, 19, at=T0, agree=True)
    with sessions.begin() as s:
        assert schedules.tick(session=s, now=T0 + timedelta(minutes=1)) == []
        _add_verified(s, 1, at=T0 + timedelta(seconds=30), agree=True)
    with sessions.begin() as s:
        (job_id,) = schedules.tick(session=s, now=T0 + timedelta(minutes=1))
        assert "20 new verified samples" in (jobs.get_job(session=s, job_id=job_id).reason or "")
    with sessions.begin() as s:  # its job is still queued: no second one
        _add_verified(s, 30, at=T0 + timedelta(minutes=2), agree=True)
        assert schedules.tick(session=s, now=T0 + timedelta(minutes=3)) == []
        jobs.cancel(session=s, job_id=job_id)
    with sessions.begin() as s:  # counted since it last fired: 30 new ones
        assert len(schedules.tick(session=s, now=T0 + timedelta(minutes=3))) == 1


def test_drift_trigger_on_disagreement_and_forward_rate(sessions: sessionmaker[Session]) -> None:
    now = T0 + timedelta(minutes=10)
    with sessions.begin() as s:
        dis = schedules.create_schedule(
            session=s,
            name="disagree",
            kind="trigger",
            expression="drift",
            trigger={"window_s": 300, "max_disagreement": 0.3, "min_samples": 10},
        )
        fwd = schedules.create_schedule(
            session=s,
            name="forward",
            kind="trigger",
            expression="drift",
            trigger={"window_s": 300, "max_forward_rate": 0.25, "min_samples": 10},
        )
        dis_id, fwd_id = dis.id, fwd.id
        # Old disagreement outside the window does not count; recent agreement is fine.
        _add_verified(s, 50, at=now - timedelta(minutes=9), agree=False)
        _add_verified(s, 20, at=now - timedelta(minutes=2), agree=True)
        s.add(
            Agent(
                agent_id="cam",
                fleet="default",
                last_seen_at=now - timedelta(seconds=5),
                telemetry={"forward_rate": 0.1},
            )
        )
    with sessions.begin() as s:
        assert schedules.tick(session=s, now=now) == []
        _add_verified(s, 12, at=now - timedelta(minutes=1), agree=False)  # 12/32 = 0.375
        agent = s.get(Agent, "cam")
        assert agent is not None
        agent.telemetry = {"forward_rate": 0.4}
    with sessions.begin() as s:
        fired = schedules.tick(session=s, now=now)
        by_schedule = {jobs.get_job(session=s, job_id=j).schedule_id: j for j in fired}
        assert set(by_schedule) == {dis_id, fwd_id}
        assert "disagreement 0.375 > 0.3" in (
            jobs.get_job(session=s, job_id=by_schedule[dis_id]).reason or ""
        )
        assert "forward rate 0.400 > 0.25" in (
            jobs.get_job(session=s, job_id=by_schedule[fwd_id]).reason or ""
        )


def test_two_schedulers_fire_once(database_url: str, sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as s:
        schedules.create_schedule(
            session=s, name="hourly", kind="interval", expression="3600", now=T0
        )
    later = T0 + timedelta(hours=2)
    a, b = sessions(), sessions()
    try:
        fired_a = schedules.tick(session=a, now=later)
        a.commit()
        fired_b = schedules.tick(session=b, now=later)
        b.commit()
    finally:
        a.close()
        b.close()
    assert len(fired_a) + len(fired_b) == 1
