"""The API restart scenario: ``cloud-service api`` SIGKILLed while clients enroll, poll,
infer and label, and samples stream over MQTT to an in-process verifier meanwhile.

HTTP clients retry on refused or cut connections; the outcome counts (as in
``simulations.chaos``) every answered write the store lacks or holds twice, and 5xx
answers. Every loop is bounded in count and time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, select

from cloud_service.db.crud import hash_token
from cloud_service.db.models import Agent as AgentRow
from cloud_service.db.models import EnrollmentToken, Label
from edge_agent.enroll import enroll
from shared.errors import ConfigError, TransportError
from simulations.chaos_rig import (
    ADMIN_HEADERS,
    FLEET,
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
from simulations.processes import ServiceProcess

__all__ = ["ApiLoad", "api_restart"]


@dataclass
class ApiLoad:
    """What the HTTP clients did while the API was killed and restarted."""

    base: str
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    refused: int = 0  # connection refused or cut: retried
    server_errors: int = 0
    minted: set[str] = field(default_factory=set)  # agent ids whose token was answered 201
    enrolled: dict[str, str] = field(default_factory=dict)  # agent id -> api token
    enroll_lost: int = 0  # token spent, answer never received
    enroll_refused: int = 0  # an answered token refused at enrollment
    labels_acked: dict[str, int] = field(default_factory=dict)  # sample id -> label
    label_retries_unknown: int = 0  # a label POST whose answer was lost, then retried
    polls: int = 0
    infers: int = 0
    errors: list[str] = field(default_factory=list)

    def call(self, method: str, path: str, **kwargs: Any) -> tuple[httpx.Response | None, int]:
        """One request, retried on transport errors until answered; (answer, transport errors)."""
        failures = 0
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            with self.lock:
                self.requests += 1
            try:
                response = httpx.request(method, self.base + path, timeout=10, **kwargs)
            except httpx.TransportError:
                failures += 1
                with self.lock:
                    self.refused += 1
                time.sleep(0.2)
                continue
            if response.status_code >= 500:
                with self.lock:
                    self.server_errors += 1
                    self.errors.append(f"{method} {path}: {response.status_code}")
            return response, failures
        return None, failures


def _enroll_loop(load: ApiLoad, fleet: str) -> None:
    i = 0
    while not load.stop.is_set():
        agent_id = f"enr-{i}"
        i += 1
        response, _ = load.call(
            "POST",
            "/v1/enrollment-tokens",
            json={"fleet": fleet, "agent_id": agent_id},
            headers=ADMIN_HEADERS,
        )
        if response is None or response.status_code != 201:
            load.errors.append(f"token for {agent_id}: {response and response.status_code}")
            continue
        token = response.json()["token"]
        with load.lock:
            load.minted.add(agent_id)
        unsure = False
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                answer = enroll(load.base, token, agent_id=agent_id, timeout=10)
            except TransportError:
                unsure = True  # the request may have been spent before the answer was lost
                with load.lock:
                    load.refused += 1
                time.sleep(0.2)
                continue
            except ConfigError as exc:
                with load.lock:
                    if unsure and "already used" in str(exc):
                        load.enroll_lost += 1
                    else:
                        load.enroll_refused += 1
                    load.errors.append(f"enroll {agent_id}: {exc}")
                break
            with load.lock:
                load.enrolled[agent_id] = answer["api_token"]
            break
        time.sleep(0.05)


def _poll_loop(load: ApiLoad, teacher: str) -> None:
    frame: dict[str, Any] = {"name": "frames", "shape": [1, 32, 32, 3], "datatype": "UINT8"}
    frame["data"] = [0] * (32 * 32 * 3)
    body = {"inputs": [frame]}
    while not load.stop.is_set():
        response, _ = load.call("GET", f"/v2/models/{teacher}/ready")
        if response is not None and response.status_code == 200:
            with load.lock:
                load.polls += 1
        response, _ = load.call("POST", f"/v2/models/{teacher}/infer", json=body)
        if response is not None and response.status_code == 200:
            with load.lock:
                load.infers += 1
        elif response is not None:
            load.errors.append(f"infer: {response.status_code} {response.text[:120]}")
        time.sleep(0.05)


def _label_loop(load: ApiLoad, forwarded: list[str]) -> None:
    done = 0
    while not load.stop.is_set():
        if done >= len(forwarded):
            time.sleep(0.1)
            continue
        sample_id = forwarded[done]
        label = done % 2  # every model here has at least two classes
        response, failures = load.call(
            "POST",
            f"/v1/samples/{sample_id}/labels",
            json={"label": label, "labeled_by": "chaos"},
            headers=ADMIN_HEADERS,
        )
        if response is not None and response.status_code == 404:
            time.sleep(0.1)  # not stored yet: it is on its way over MQTT
            continue
        if response is not None and response.status_code == 201:
            with load.lock:
                load.labels_acked[sample_id] = label
                load.label_retries_unknown += failures > 0
        elif response is not None:
            load.errors.append(f"label: {response.status_code} {response.text[:120]}")
        done += 1
        time.sleep(0.05)


def api_restart(
    folder: Path,
    *,
    frames_n: int = 200,
    kills: int = 1,
    down_s: float = 1.0,
    pace_s: float = 0.03,
    served_after: int = 5,
) -> Outcome:
    """SIGKILL ``cloud-service api`` ``kills`` times while agents enroll, poll and upload.

    The kills are spread over the stream (``frames_n`` frames, ``pace_s`` apart); each
    restart waits ``down_s`` before starting the API again.

    Samples stream over MQTT to an in-process verifier meanwhile; HTTP clients retry
    on refused or cut connections. Judged: samples as everywhere; every enrollment
    answered (a token spent whose answer was lost counts as lost); every acknowledged
    label stored once; no 5xx.
    """
    outcome = Outcome(
        "API restart",
        f"{frames_n} frames + enroll/poll/infer/label load, {kills} SIGKILL(s), down {down_s:g} s",
    )
    forwarded: list[str] = []
    stack = chaos_stack(folder, verifier="in-process", api="subprocess")
    with stack:
        api = stack.api
        assert isinstance(api, ServiceProcess)
        teacher = stack.cloud_settings().teacher_name
        load = ApiLoad(api.url)
        with chaos_agent(stack) as agent:
            until(lambda: agent.publisher.connected, 10)
            stream = threading.Thread(
                target=stream_frames, args=(agent, frames(16), frames_n, forwarded, pace_s)
            )
            clients = [
                threading.Thread(target=_enroll_loop, args=(load, FLEET), name="enroll"),
                threading.Thread(target=_poll_loop, args=(load, teacher), name="poll"),
                threading.Thread(target=_label_loop, args=(load, forwarded), name="label"),
            ]
            stream.start()
            for thread in clients:
                thread.start()
            for k in range(kills):
                until(reached(forwarded, frames_n * (k + 1) // (kills + 1)), 120)
                api.kill()
                outcome.crashed += 1
                time.sleep(down_s)
                api.start()
            # After the last restart every kind of client is served again, ``served_after``
            # times each, before the load stops.
            since = (load.polls, len(load.enrolled), len(load.labels_acked))
            outcome.recovered = until(
                lambda: (
                    load.polls >= since[0] + served_after
                    and len(load.enrolled) >= since[1] + served_after
                    and len(load.labels_acked) >= min(since[2] + served_after, frames_n)
                ),
                60,
            )
            stream.join(180)
            load.stop.set()
            for thread in clients:
                thread.join(120)
            drain(stack.database_url, forwarded, 90)
            until(lambda: agent.spool.depth == 0, 30)
        outcome.redelivered = stack.worker.counts["duplicates"]
    outcome.refused = load.refused
    outcome.server_errors = load.server_errors
    # Every answered write must be in the store: tokens, enrollments (with the API
    # token that was answered), labels; none of them twice.
    engine = create_engine(stack.database_url)
    try:
        with engine.connect() as conn:
            tokens_for = list(conn.scalars(select(EnrollmentToken.agent_id)))
            keys = dict(conn.execute(select(AgentRow.agent_id, AgentRow.api_token_hash)).all())
            used = list(
                conn.scalars(
                    select(EnrollmentToken.used_by).where(EnrollmentToken.used_at.is_not(None))
                )
            )
            mine = select(Label.sample_id, Label.label).where(Label.labeled_by == "chaos")
            labels = list(conn.execute(mine))
    finally:
        engine.dispose()
    tokens_lost = len(load.minted - set(tokens_for))
    enrollments_lost = sum(
        1 for agent_id, token in load.enrolled.items() if keys.get(agent_id) != hash_token(token)
    )
    twice = len(used) - len(set(used))
    stored_labels: dict[str, list[int]] = {}
    for sample_id, label in labels:
        stored_labels.setdefault(sample_id, []).append(label)
    labels_lost = sum(
        1 for sid, label in load.labels_acked.items() if label not in stored_labels.get(sid, [])
    )
    labels_twice = sum(len(v) - 1 for v in stored_labels.values() if len(v) > 1)
    outcome.lost += (
        tokens_lost + enrollments_lost + load.enroll_lost + load.enroll_refused + labels_lost
    )
    outcome.duplicated += twice + labels_twice
    outcome.notes += [
        f"{load.requests} HTTP requests",
        f"{len(load.minted)} enrollment tokens answered ({tokens_lost} not stored)",
        f"{len(load.enrolled)} agents enrolled ({enrollments_lost} not stored, "
        f"{load.enroll_lost} tokens spent with the answer lost, "
        f"{load.enroll_refused} answered tokens refused)",
        f"{load.polls} polls, {load.infers} infers answered",
        f"{len(load.labels_acked)} labels acknowledged ({labels_lost} missing, "
        f"{labels_twice} stored twice after a retry)",
    ]
    if load.errors:
        outcome.notes.append(f"first errors: {load.errors[:3]}")
    return judge(stack.database_url, outcome, set(forwarded))
