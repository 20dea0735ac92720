"""Fault scenarios on loopback, run by the short chaos tests and ``scripts/chaos.py``.

Each scenario runs real parts on its own ``chaos_stack`` (``simulations.chaos_rig``): a
private Mosquitto, the real edge ``Agent`` (tiny student, disk spool), the real verifier
(in-process, or a ``cloud-service verifier`` subprocess where it is to be SIGKILLed), a
database; it injects one fault and returns counts, judged against the database after
the system drained:

- ``lost``: forwarded by the agent, never stored, not evicted from the spool; over
  HTTP, a write answered 2xx that the store does not hold (or an enrollment token
  spent whose answer never arrived);
- ``duplicated``: stored sample rows or verdict rows beyond one per sample id; over
  HTTP, a label stored twice or a token spent twice;
- ``without_verdict``: stored, still no verdict;
- ``evicted``: dropped by the spool's eviction policy (by design, counted);
- ``redelivered``: deliveries the cloud absorbed as duplicates (expected, harmless);
- ``refused``: requests or writes refused while the fault lasted and retried by the
  client (expected; each one was retried until it succeeded);
- ``server_errors``: HTTP 5xx answers (must be zero);
- ``crashed``: processes killed by the scenario (injected, not found);
- ``recovered``: every kind of client was served again after the fault.

The PostgreSQL scenario runs a private server (``initdb`` into a temp folder, a free
port) that it stops and starts; the API scenario (``simulations.chaos_api``) runs
``cloud-service api`` as a subprocess that it SIGKILLs and starts again.

Every loop is bounded in count and time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from simulations.chaos_api import api_restart
from simulations.chaos_rig import (
    VERIFIER_PROCESS,
    Outcome,
    chaos_agent,
    chaos_stack,
    drain,
    frames,
    judge,
    reached,
    stream_frames,
    until,
)
from simulations.databases import PostgresProcess, postgres_binaries
from simulations.processes import ServiceProcess

__all__ = [
    "SCENARIOS",
    "Outcome",
    "agent_offline",
    "api_restart",
    "broker_restart",
    "postgres_binaries",
    "postgres_restart",
    "spool_full",
    "verifier_sigkill",
]


def broker_restart(folder: Path, *, frames_n: int = 200, down_s: float = 1.0) -> Outcome:
    """The broker restarts while the agent streams and the verifier ingests."""
    outcome = Outcome("broker restart mid-stream", f"{frames_n} frames, broker down {down_s} s")
    forwarded: list[str] = []
    stack = chaos_stack(folder, verifier="in-process")
    with stack, chaos_agent(stack) as agent:
        assert stack.broker is not None
        until(lambda: agent.publisher.connected, 10)
        thread = threading.Thread(
            target=stream_frames, args=(agent, frames(16), frames_n, forwarded, 0.01)
        )
        thread.start()
        until(lambda: len(forwarded) >= frames_n // 3, 30)
        stack.broker.stop()
        time.sleep(down_s)
        stack.broker.start()
        thread.join(120)
        drain(stack.database_url, forwarded, 60)
        until(lambda: agent.spool.depth == 0, 30)
        outcome.redelivered = stack.worker.counts["duplicates"]
    return judge(stack.database_url, outcome, set(forwarded))


def verifier_sigkill(folder: Path, *, frames_n: int = 200, kills: int = 1) -> Outcome:
    """SIGKILL the verifier subprocess mid-stream, ``kills`` times; restart it each time."""
    outcome = Outcome("verifier SIGKILL", f"{frames_n} frames, {kills} SIGKILL(s) mid-stream")
    forwarded: list[str] = []
    stack = chaos_stack(folder, verifier=VERIFIER_PROCESS)
    with stack, chaos_agent(stack) as agent:
        verifier = stack.verifier
        assert isinstance(verifier, ServiceProcess)
        until(lambda: agent.publisher.connected, 10)
        thread = threading.Thread(
            target=stream_frames, args=(agent, frames(16), frames_n, forwarded, 0.01)
        )
        thread.start()
        for k in range(kills):
            until(reached(forwarded, frames_n * (k + 1) // (kills + 1)), 60)
            verifier.kill()
            outcome.crashed += 1
            verifier.start()
        thread.join(120)
        drain(stack.database_url, forwarded, 90)
        until(lambda: agent.spool.depth == 0, 30)
    return judge(stack.database_url, outcome, set(forwarded))


def agent_offline(folder: Path, *, frames_n: int = 60, offline_s: float = 3.0) -> Outcome:
    """The agent stops with unreceipted samples, stays away, comes back and streams again."""
    outcome = Outcome("agent offline, then back", f"{frames_n} frames each side, off {offline_s} s")
    forwarded: list[str] = []
    with chaos_stack(folder, verifier="in-process") as stack:
        with chaos_agent(stack) as agent:
            until(lambda: agent.publisher.connected, 10)
            stream_frames(agent, frames(16), frames_n, forwarded, 0.0)
            depth_at_stop = agent.spool.depth
        outcome.notes.append(f"spool depth at stop {depth_at_stop}")
        time.sleep(offline_s)
        with chaos_agent(stack) as agent:
            until(lambda: agent.publisher.connected, 10)
            stream_frames(agent, frames(16, seed=1), frames_n, forwarded, 0.0)
            drain(stack.database_url, forwarded, 60)
            until(lambda: agent.spool.depth == 0, 30)
        outcome.redelivered = stack.worker.counts["duplicates"]
    return judge(stack.database_url, outcome, set(forwarded))


def spool_full(folder: Path, *, frames_n: int = 300, max_bytes: int = 1 << 16) -> Outcome:
    """Broker away while frames arrive into a spool capped at ``max_bytes`` (a full disk)."""
    outcome = Outcome(
        "agent spool full (byte cap)", f"{frames_n} frames, broker down, spool {max_bytes} B"
    )
    forwarded: list[str] = []
    with chaos_stack(folder, verifier="in-process") as stack:
        assert stack.broker is not None
        with chaos_agent(stack, spool_max_bytes=max_bytes) as agent:
            until(lambda: agent.publisher.connected, 10)
            stack.broker.stop()
            stream_frames(agent, frames(16), frames_n, forwarded, 0.0)
            stats = agent.spool.stats()
            evicted = stats.evicted_audit + stats.evicted_oldest
            outcome.notes.append(f"answered {frames_n} frames with the broker down")
            stack.broker.start()
            until(lambda: agent.spool.depth == 0, 60)
            kept = set(forwarded[-max(1, len(forwarded) - evicted) :]) if evicted else set()
            drain(stack.database_url, list(kept) or forwarded, 60)
        outcome.redelivered = stack.worker.counts["duplicates"]
    return judge(stack.database_url, outcome, set(forwarded), evicted=evicted)


def postgres_restart(
    folder: Path, *, frames_n: int = 200, down_s: float = 3.0, stream_s: float | None = None
) -> Outcome:
    """PostgreSQL stops for ``down_s`` while the agent streams; samples flow before, during, after.

    The stream is paced over ``stream_s`` (default ``down_s + 6``) so a third of it
    lands before the outage and the rest during and after it.
    """
    binaries = postgres_binaries()
    if binaries is None:
        raise RuntimeError("PostgreSQL binaries (initdb, postgres) are not installed")
    outcome = Outcome(
        "PostgreSQL restarted", f"{frames_n} frames, PostgreSQL down {down_s:g} s mid-stream"
    )
    pg = PostgresProcess(binaries)
    forwarded: list[str] = []
    try:
        pg.start()
        pace = (stream_s if stream_s is not None else down_s + 6.0) / frames_n
        stack = chaos_stack(folder, verifier="in-process", db=pg.url)
        with stack, chaos_agent(stack) as agent:
            until(lambda: agent.publisher.connected, 10)
            thread = threading.Thread(
                target=stream_frames, args=(agent, frames(16), frames_n, forwarded, pace)
            )
            thread.start()
            until(lambda: len(forwarded) >= frames_n // 3, 60)
            pg.stop()
            at_stop = len(forwarded)
            time.sleep(down_s)
            during = len(forwarded) - at_stop
            pg.start()
            thread.join(max(120.0, 3 * frames_n * pace))
            drain(stack.database_url, forwarded, 120)
            until(lambda: agent.spool.depth == 0, 60)
            worker = stack.worker
            outcome.redelivered = worker.counts["duplicates"]
            refused = worker.metrics.registry.get_sample_value("edgeloop_store_errors_total")
            outcome.refused = int(refused or 0)
            outcome.notes.append(f"{during} frames forwarded while PostgreSQL was down")
            outcome.notes.append(f"{outcome.refused} storage attempts refused and retried")
        return judge(stack.database_url, outcome, set(forwarded))
    finally:
        pg.close()


SCENARIOS: dict[str, Callable[..., Outcome]] = {
    "broker_restart": broker_restart,
    "verifier_sigkill": verifier_sigkill,
    "api_restart": api_restart,
    "agent_offline": agent_offline,
    "spool_full": spool_full,
    "postgres_restart": postgres_restart,
}
