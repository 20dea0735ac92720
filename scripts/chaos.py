"""Chaos, full forms: inject each fault on loopback and print what was lost.

    .venv/bin/python scripts/chaos.py [--only NAME ...] [--offline-s 300] [--pg-down-s 30]
                                      [--json]
    .venv/bin/python scripts/chaos.py --attacks [--only NAME ...] [--json]

``--attacks`` plays the attackers of ``simulations.attacks`` instead (JPEG bombs,
junk on an agent's topic, reused sample ids, oversized unauthenticated bodies, slow
request heads, NUL and overflow inputs) beside legitimate traffic, and prints per
attack: hostile inputs tried, refused, accepted, crashes, legitimate data lost.

Scenarios (``simulations.chaos``): broker restart mid-stream, verifier SIGKILL
(several), API SIGKILL and restart (several) under enroll/poll/infer/label load,
agent offline for ``--offline-s`` then back, agent spool full (a byte cap standing in
for a full disk), PostgreSQL stopped for ``--pg-down-s`` while samples flow (a private
server). Prints one row per fault: what was tried; forwarded, lost, duplicated,
without verdict, evicted by policy, redelivered, refused (and retried), 5xx, crashed
(processes killed on purpose). Exit status 1 when any row is not ok.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations import attacks
from simulations.chaos import (
    Outcome,
    agent_offline,
    api_restart,
    broker_restart,
    postgres_restart,
    spool_full,
    verifier_sigkill,
)


def run_attacks(only: list[str] | None, as_json: bool) -> None:
    plan = {
        "scan_bombs": lambda folder: attacks.scan_bombs(folder, bombs=8, frames_n=300),
        "junk_on_agent_topic": lambda folder: attacks.junk_on_agent_topic(folder, junk=200),
        "sample_id_collision": lambda folder: attacks.sample_id_collision(folder, n=100),
        "oversized_bodies": lambda folder: attacks.oversized_bodies(folder, mb=200, parallel=4),
        "slow_headers": lambda folder: attacks.slow_headers(folder, connections=200),
        "nul_inputs": attacks.nul_inputs,
    }
    rows: list[dict[str, object]] = []
    for name, attack in plan.items():
        if only and name not in only:
            continue
        folder = Path(tempfile.mkdtemp(prefix=f"edgeloop-attack-{name}-"))
        start = time.monotonic()
        try:
            row = attack(folder).row()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        row["seconds"] = round(time.monotonic() - start, 1)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        cols = ["finding", "attack", "tried", "refused", "accepted", "crashes"]
        cols += ["legit_sent", "legit_lost", "ok", "seconds"]
        print(" | ".join(cols))
        for row in rows:
            print(" | ".join(str(row[c]) for c in cols))
        for row in rows:
            if row["notes"]:
                print(f"{row['finding']}: {row['notes']}")
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attacks", action="store_true", help="attacks instead of faults")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--frames", type=int, default=1000)
    parser.add_argument("--offline-s", type=float, default=300.0)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--pg-down-s", type=float, default=30.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.attacks:
        run_attacks(args.only, args.json)
        return
    plan = {
        "broker_restart": lambda folder: broker_restart(folder, frames_n=args.frames, down_s=5.0),
        "verifier_sigkill": lambda folder: verifier_sigkill(
            folder, frames_n=args.frames, kills=args.kills
        ),
        "api_restart": lambda folder: api_restart(
            folder, frames_n=args.frames // 2, kills=args.kills, down_s=2.0
        ),
        "agent_offline": lambda folder: agent_offline(
            folder, frames_n=args.frames // 4, offline_s=args.offline_s
        ),
        "spool_full": lambda folder: spool_full(folder, frames_n=args.frames, max_bytes=1 << 17),
        "postgres_restart": lambda folder: postgres_restart(
            folder, frames_n=args.frames, down_s=args.pg_down_s, stream_s=args.pg_down_s + 20
        ),
    }
    rows: list[dict[str, object]] = []
    for name, scenario in plan.items():
        if args.only and name not in args.only:
            continue
        folder = Path(tempfile.mkdtemp(prefix=f"edgeloop-chaos-{name}-"))
        start = time.monotonic()
        try:
            outcome: Outcome = scenario(folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        row = outcome.row()
        row["seconds"] = round(time.monotonic() - start, 1)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        cols = [
            "fault",
            "tried",
            "forwarded",
            "lost",
            "duplicated",
            "without_verdict",
            "evicted_by_policy",
            "redelivered",
            "refused",
            "server_errors",
            "crashed",
            "recovered",
            "ok",
            "seconds",
        ]
        print(" | ".join(cols))
        for row in rows:
            print(" | ".join(str(row[c]) for c in cols))
        for row in rows:
            print(f"{row['fault']}: {row['notes']}")
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
