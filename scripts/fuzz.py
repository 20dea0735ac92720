"""Fuzz the input boundaries with hypothesis, ``--cases`` per target (default 10,000).

    .venv/bin/python scripts/fuzz.py [--cases 10000] [--api-cases 100] [--database-url URL]
                                     [--json]

Targets: envelope decoding, manifest (announcement) verification, the edge agent's
frame upload (``POST /v1/frames`` on its HTTP app, in-process; JPEG scan bombs among
the inputs), its request lines (paths and queries with every latin-1 character,
NUL included) and MQTT ingest's
message classifier (what the verifier runs on every message); then schemathesis
against the cloud API's OpenAPI document, served by uvicorn on a loopback port,
``--api-cases`` generated requests per operation and mode (valid and schema-breaking;
0 skips it). Counts every outcome; a crash (an exception outside the error tree) or a
5xx fails the run.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, given, settings

from simulations import fuzz_targets as t


def run_target(name: str, cases: int, strategy: Any, check: Any) -> dict[str, Any]:
    outcomes: collections.Counter[str] = collections.Counter()
    crashes: list[str] = []

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def body(args: tuple[Any, ...]) -> None:
        try:
            outcomes[check(*args)] += 1
        except Exception as exc:  # a crash: record and keep going
            crashes.append(f"{type(exc).__name__}: {exc}"[:200])
            outcomes["CRASH"] += 1

    start = time.monotonic()
    body()
    return {
        "target": name,
        "cases": sum(outcomes.values()),
        "crashes": len(crashes),
        "first_crashes": crashes[:5],
        "outcomes": dict(outcomes.most_common(8)),
        "seconds": round(time.monotonic() - start, 1),
    }


def fuzz_inputs(cases: int) -> list[dict[str, Any]]:
    """The four hypothesis targets, ``cases`` inputs each."""
    from hypothesis import strategies as st

    results = [
        run_target("envelope decoding", cases, st.tuples(t.ENVELOPES), t.check_envelope),
        run_target("manifest verification", cases, st.tuples(t.ANNOUNCEMENTS), t.check_manifest),
        run_target(
            "MQTT ingest (classify)",
            cases,
            st.tuples(t.INGEST_TOPICS, t.INGEST_PAYLOADS),
            t.check_ingest,
        ),
    ]
    from edge_agent.agent import Agent
    from edge_agent.engine import EngineOptions, OrtEngine
    from edge_agent.settings import AgentSettings
    from edge_agent.testing import MemoryPublisher, make_tiny_student

    with tempfile.TemporaryDirectory() as folder:
        student = make_tiny_student(Path(folder) / "student.onnx", size=32)
        agent_settings = AgentSettings(
            data_dir=Path(folder), model_path=student, fleet="f", agent_id="a", warmup_runs=1
        )
        engine = OrtEngine(student, EngineOptions(intra_op_threads=1, warmup_runs=1))
        publisher = MemoryPublisher()
        with (
            Agent(agent_settings, engine=engine, publisher=publisher) as agent,
            t.frame_client(agent) as client,
        ):
            results.append(
                run_target(
                    "frame upload (POST /v1/frames)",
                    cases,
                    st.tuples(t.FRAMES, t.FRAME_TYPES),
                    lambda body, ctype: t.check_frame(client, body, ctype),
                )
            )
            results.append(
                run_target(
                    "agent request lines (GET /v1/...)",
                    cases,
                    st.tuples(t.URL_TEXT, t.URL_TEXT),
                    lambda path, query: t.check_request_line(client, path, query),
                )
            )
    return results


def fuzz_openapi(examples: int, database_url: str | None) -> dict[str, Any]:
    from cloud_service.demo_teacher import build_demo_teacher
    from simulations.fuzz_api import api_server, fuzz_api

    with tempfile.TemporaryDirectory() as folder:
        teacher = build_demo_teacher(Path(folder) / "teacher.onnx", size=32, classes=10, seed=1)
        with api_server(Path(folder), teacher, database_url) as server:
            report = fuzz_api(server.url, examples=examples)
    return report.row()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000, help="per input target; 0 skips")
    parser.add_argument("--api-cases", type=int, default=100, help="per operation and mode")
    parser.add_argument(
        "--database-url", default=None, help="the API's database (default: SQLite, temp folder)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = fuzz_inputs(args.cases) if args.cases > 0 else []
    for result in results:
        print(json.dumps(result), file=sys.stderr, flush=True)
    if args.api_cases > 0:
        results.append(fuzz_openapi(args.api_cases, args.database_url))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"{'target':34} {'cases':>7} {'crashes':>7} {'s':>6}  outcomes")
        for r in results:
            print(
                f"{r['target']:34} {r['cases']:>7} {r['crashes']:>7} {r['seconds']:>6}  "
                f"{r['outcomes']}"
            )
        for r in results:
            if "operations" in r:
                print(f"{r['target']}: {r['operations']} operations, valid and schema-breaking")
            for crash in r["first_crashes"]:
                print(f"  crash: {crash}")
            for operation, count in r.get("server_errors_by_operation", {}).items():
                print(f"  5xx x{count}: {operation}")
    sys.exit(1 if any(r["crashes"] for r in results) else 0)


if __name__ == "__main__":
    main()
