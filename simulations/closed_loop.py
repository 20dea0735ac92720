"""The closed loop, measured: drift hits the fleet, a trigger fires, a distillation round
runs, the new student reaches the agents, and accuracy recovers; then the drifted stream
goes on, the trigger fires again, and further rounds run until the loop settles.

    edgeloop loop [--quick] [--json] [--drift blur:0.8] [--agents 3] [--rounds 2]
                  [--report loop.html]

On embedded defaults, in one process tree (a ``simulations.stack.Stack``): an embedded
MQTT broker; SQLite and a local blob folder in a temporary data dir; the cloud verifier
(``cloud_service.worker``: MQTT ingest, teacher batching, receipts, verdicts); the
cloud's REST API over HTTP (``cloud_service.api``) serving signed model artifacts;
the model registry with signed, retained announcements over MQTT; a distill worker
(``cloud_service.jobs.worker`` + ``cloud_service.jobs.runner``) claiming the job the
drift trigger queues; and ``agents`` real edge agents (``edge_agent.Agent``), each
enrolled with its own API token and fed by its own camera stream in its own thread. An agent answers
every frame with its INT8 student, spools and forwards the unsure frames (plus an
audit share) over MQTT, receives verdicts, and installs new models as it does in
the field: retained announcement, signature, HTTP download, sha256, golden inputs,
atomic swap.

Frames come from the reference scenario's stream split (each scan rendered
``stream_renders`` times, 16 by default: about 1,400 distinct frames per pool; the
stream is never trained on, so the render count changes no model), divided by
source scan into two pools that share no scan: the *live* pool feeds the clean and
drifted phases (whose forwarded frames become the round's training data) and the
*evaluation* pool is used for every figure in the table, so "after" is measured on
frames the new student never trained on. The table's columns use the same evaluation frames (same
seeds): ``before drift`` (serving student, clean), ``drifted`` (serving student,
drifted) and ``after round k`` for each round (that round's student, drifted; the clean
frames again for forgetting). The serving-student columns, and every round's column but
the last, apply each agent's routing rule without sending (the verdict would be the
teacher's answer on the same bytes); the last round's column is live through the fleet.
So no evaluation frame is ever verified, and none can reach a round's training data.

Rounds: round 1 trains on what the trigger's first firing found (the newest verified
samples, up to ``max_samples``). From round 2 on, the drifted stream continues on the
live pool with the previous round's student serving; the same drift trigger, with the
same conditions, is ticked on what the agents have forwarded, and round k's job takes
the newest verified samples (the resumed stream's first, then earlier ones, up to
``max_samples``) plus its replay of the reference training set, warm-started from the
serving student. The goals read two columns: the first-round goals (recovery, gap
closed, forgetting, forward-rate drop) read ``after round 1``; the steady-state goals
(hybrid accuracy, forward rate, uplink) read the last round.

Agents run with their own defaults except the forwarding threshold (``threshold``)
and the connection details; in particular they keep the agent's default audit share.
The run is not bit-for-bit repeatable: agents answer concurrently, so which verified
samples are newest (and so which ones the round trains on) varies a little.

What stays simplified: the agents run in this process (a thread each, not a process
per device), and the camera streams run as fast as the agents answer.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort
from rich.console import Console

from distill.frames import FrameSet
from shared.settings import EdgeLoopSettings
from simulations.loop_fleet import Fleet, LoopAgent, LoopProgress, PhaseStats, Timeline
from simulations.loop_table import (
    goal_columns,
    goals,
    print_table,
    table_header,
    table_rows,
    write_svg,
)
from simulations.report import write_report

if TYPE_CHECKING:
    from simulations.loop_cloud import LoopCloud

__all__ = [
    "LoopProgress",
    "PhaseStats",
    "goal_columns",
    "run_closed_loop",
    "split_pool",
    "table_header",
    "table_rows",
]

# Stream seeds of the evaluation phases: "before" and "after" see the very same frames.
EVAL_DRIFT_SEED, EVAL_CLEAN_SEED = 6, 7
# The cloud parts: quick batching and storage, no review share, no rollout loop.
_CLOUD: dict[str, Any] = {
    "blob_fsync": False,
    "max_queue_delay_ms": 2.0,
    "review_audit_share": 0.0,
    "rollout_tick_s": 0,
}


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def split_pool(pool: FrameSet, seed: int = 0) -> tuple[FrameSet, FrameSet]:
    """(live, evaluation): the pool's frames divided by source scan, so no scan is in both."""
    if pool.sources is None:
        raise ValueError("the stream pool carries no source ids to split by")
    scans = np.unique(pool.sources)
    rng = np.random.default_rng([seed, 31337])
    live_scans = rng.permutation(scans)[: len(scans) // 2]
    live = np.isin(pool.sources, live_scans)
    return pool.subset(np.flatnonzero(live)), pool.subset(np.flatnonzero(~live))


# ---------------------------------------------------------------------------------
# The run


def _models(quick: bool, console: Console) -> Any:
    from distill.cache import ReferenceConfig, bootstrap_reference_models, default_cache_dir

    cache = default_cache_dir()
    if not quick:
        cfg = ReferenceConfig.reference()
        have = (cache / f"student-{cfg.student_key()}" / "student.int8.onnx").is_file()
        if not have:
            console.print(
                "[yellow]the full reference student is not cached under its current key;"
                " training it now (minutes)[/]"
            )
    return bootstrap_reference_models(cache, quick=quick, progress=not quick, console=console)


@contextmanager
def _quiet_logs() -> Iterator[None]:
    """Agents and services log every step at INFO; the loop shows its own progress."""
    import logging

    names = (
        "edge_agent",
        "cloud_service",
        "distill",
        "shared",
        "uvicorn",
        "httpx",
        "amqtt",
        "alembic",
    )
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def run_closed_loop(
    settings: EdgeLoopSettings | None = None,
    *,
    quick: bool,
    frames: int = 400,
    agents: int = 3,
    drift: str = "blur:0.8",
    threshold: float = 0.85,
    max_samples: int = 500,
    threads: int = 2,
    plot: Path | None = None,
    report_html: Path | None = None,
    console: Console | None = None,
    live: bool = True,
    models: Any = None,
    job_params: dict[str, Any] | None = None,
    rounds: int = 1,
    stream_renders: int = 16,
) -> dict[str, Any]:
    """Run the loop once and return its figures (also printed; a plot and a report saved).

    ``models`` overrides the reference models (``distill.cache.ReferenceModels``);
    ``job_params`` adds parameters to the job the drift trigger queues; ``rounds``
    distillation rounds run (from the second on, the drifted stream continues first and
    the trigger must fire again).
    """
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    console = console or Console(stderr=True)
    started = time.perf_counter()
    with _quiet_logs(), LoopProgress(console, live=live) as progress:
        models = models or _models(quick, console)
        report = _run(
            settings,
            models=models,
            quick=quick,
            frames=frames,
            agents=agents,
            drift=drift,
            threshold=threshold,
            max_samples=max_samples,
            threads=threads,
            progress=progress,
            started=started,
            job_params=job_params or {},
            rounds=rounds,
            stream_renders=stream_renders,
        )
    report["goals"] = goals(report)
    report["goal_columns"] = goal_columns(report)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    print_table(console, report)
    plot = plot or Path("closed_loop.svg")
    write_svg(plot, report)
    report["plot"] = str(plot)
    if report_html is not None:
        write_report(report_html, report)
        report["report"] = str(report_html)
        console.print(f"report: {report_html.resolve()}")
    return report


def _job_params(
    fleet: str, *, max_samples: int, threads: int, drift: str, extra: dict[str, Any]
) -> dict[str, Any]:
    """The parameters of every job the drift trigger queues."""
    return {
        "fleet": fleet,
        "max_samples": max_samples,
        "threads": threads,
        "drift_eval": drift,
        # The whole reference test set under the drift, not a sample of it:
        # on 200 frames a point is two frames, and a round that fell a point
        # on the stream's unseen scans passed the check.
        "drift_eval_frames": 100_000,
        # Best of three training seeds by validation NLL: a round on a few
        # hundred frames varies by a point from one seed to the next.
        "candidates": 3,
        # A round must not fall on unseen scans under the drift it answers:
        # the live pool shows each of its scans again in new renders, so the
        # recent holdout alone can reward a student that learnt those scans.
        "max_drift_drop": 0.02,
        **extra,
    }


def _run(
    settings: EdgeLoopSettings | None,
    *,
    models: Any,
    quick: bool,
    frames: int,
    agents: int,
    drift: str,
    threshold: float,
    max_samples: int,
    threads: int,
    progress: LoopProgress,
    started: float,
    job_params: dict[str, Any],
    rounds: int,
    stream_renders: int,
) -> dict[str, Any]:
    from distill.cache import ReferenceConfig
    from distill.drift import parse_drift_spec
    from distill.scenario import render_split
    from simulations.loop_cloud import FLEET, LoopCloud
    from simulations.stack import Stack

    scenario = ReferenceConfig.reference(quick=quick).scenario
    # The stream scans are never trained on, so rendering each more often changes no
    # model: it gives the cameras fresh pictures of the same scans, as a real line shows
    # the same kinds of object in new positions, instead of repeating a few hundred.
    stream = render_split("stream", replace(scenario, stream_renders=stream_renders))
    live_pool, eval_pool = split_pool(stream)
    spec = tuple(parse_drift_spec(drift))
    teacher = _session(models.teacher_onnx)
    timeline = Timeline(started)
    report: dict[str, Any] = {
        "drift": drift,
        "agents": agents,
        "frames_per_phase": frames,
        "threshold": threshold,
        "quick": quick,
        "rounds_requested": rounds,
        "pools": {
            "live_frames": len(live_pool),
            "evaluation_frames": len(eval_pool),
            "stream_renders": stream_renders,
        },
    }
    # Agents run with their own defaults but for the forwarding threshold and quick
    # batching, heartbeats and resends.
    edge = {
        "route_max_prob_below": threshold,
        "intra_op_threads": 1,
        "warmup_runs": 1,
        "max_wait_ms": 0.5,
        "heartbeat_s": 5.0,
        "resend_after_s": 20.0,
        "updater_nice": 0,
    }
    # Everything the run stores (database, blobs, spools) is in the stack's temporary
    # folder and goes when it ends.
    stack = Stack(
        broker="embedded",
        db="sqlite",
        verifier="in-process",
        api="in-process",
        teacher=models.teacher_onnx,
        student=models.student_int8_onnx,
        fleet=FLEET,
        topic_prefix=settings.topic_prefix if settings else "edgeloop/v1",
        cloud=_CLOUD,
        edge=edge,
        name="closed-loop",
    )
    with stack:
        assert stack.broker is not None
        progress.note(
            f"[bold]closed loop[/]: broker {stack.broker.url}, cloud API {stack.api_url},"
            f" {agents} agents, {frames} frames/agent/phase, drift {drift}"
        )
        cloud = LoopCloud(stack)
        params = _job_params(
            FLEET, max_samples=max_samples, threads=threads, drift=drift, extra=job_params
        )
        ref_version = cloud.seed(models.student_int8_onnx, params)
        fleet = Fleet([], teacher, timeline, progress, frames)
        for i in range(agents):
            agent = stack.add_agent(
                f"cam-{i + 1}",
                cls=LoopAgent,
                loop=fleet,
                start_sources=False,
                rng=random.Random(100 + i),
            )
            assert isinstance(agent, LoopAgent)
            fleet.agents.append(agent)
        run = _LoopRun(cloud, fleet, report, pools=(live_pool, eval_pool), spec=spec)
        run.serve(ref_version)
        run.drift()
        cloud.start_worker(models, scenario, progress.job, stack.folder)
        run.rounds(rounds)
        report["versions"] = {"before": ref_version, "after": report.get("agents_on")}
    report["timeline"] = timeline.as_dict()
    return report


class _LoopRun:
    """One run's phases and rounds on the fleet and the cloud of a started stack."""

    def __init__(
        self,
        cloud: LoopCloud,
        fleet: Fleet,
        report: dict[str, Any],
        *,
        pools: tuple[FrameSet, FrameSet],
        spec: tuple[Any, ...],
    ) -> None:
        self.cloud = cloud
        self.fleet = fleet
        self.progress = fleet.progress
        self.timeline = fleet.timeline
        self.report = report
        self.live_pool, self.eval_pool = pools
        self.spec = spec
        self.first: dict[str, Any] = {}

    def show(self, title: str, row: dict[str, Any]) -> None:
        self.progress.note(
            f"[bold]{title}[/]: edge {row['edge_accuracy']:.1%}, forward"
            f" {row['forward_rate']:.1%}, hybrid {row['hybrid_accuracy']:.1%},"
            f" teacher-only {row['teacher_only_accuracy']:.1%}"
        )

    def on_version(self, version: str, timeout: float = 60.0) -> bool:
        """Wait until every agent serves ``version``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(a.engine.version == version for a in self.fleet.agents):
                return True
            time.sleep(0.1)
        return False

    def serve(self, ref_version: str) -> None:
        """Wait for the agents to serve the reference student."""
        agents = self.fleet.agents
        self.report["audit_share"] = agents[0].settings.audit_share if agents else None
        ready = self.on_version(ref_version)
        self.report["serving_version"] = ref_version
        self.progress.note(
            f"{len(agents)} agents enrolled; serving {ref_version}"
            + ("" if ready else " [yellow](not every agent confirmed it)[/]")
        )

    def drift(self) -> None:
        """The fleet before and under drift (live pool), the serving student measured on
        the evaluation frames, and the trigger."""
        report, fleet, cloud, spec = self.report, self.fleet, self.cloud, self.spec
        report["live_before"] = fleet.run_phase("clean", self.live_pool, (), 1, live=True)
        self.show("clean (live)", report["live_before"])
        cloud.wait_verified()
        fired_early = cloud.tick()
        report["trigger_fired_before_drift"] = bool(fired_early)
        self.timeline.mark("drift starts")
        report["live_drifted"] = fleet.run_phase("drifted", self.live_pool, spec, 2, live=True)
        self.show("drifted (live)", report["live_drifted"])
        stored = cloud.wait_verified()

        # The serving student on the evaluation frames (measured, nothing sent).
        report["before"] = fleet.run_phase(
            "measure: clean", self.eval_pool, (), EVAL_CLEAN_SEED, live=False
        )
        report["drifted"] = fleet.run_phase(
            "measure: drifted", self.eval_pool, spec, EVAL_DRIFT_SEED, live=False
        )
        self.show("serving student, evaluation frames, clean", report["before"])
        self.show("serving student, evaluation frames, drifted", report["drifted"])

        check, fired = cloud.trigger(fired_early)
        report["samples_stored"] = stored
        report["trigger_fired"] = bool(fired)
        report["trigger_stats"] = check.stats
        self.progress.note(f"trigger fired: {bool(fired)} (jobs {fired}); {stored} samples stored")
        self.first = {"trigger_fired": bool(fired), "trigger_stats": check.stats}
        self.first["samples_new"] = stored

    def resume(self, k: int, entry: dict[str, Any]) -> bool:
        """Round ``k`` > 1: the drifted stream continues on the serving (round k-1)
        student; whether the trigger fired again."""
        cutoff = datetime.now(UTC)
        self.timeline.mark(f"round {k}: the drifted stream continues")
        entry["live_drifted"] = self.fleet.run_phase(
            f"drifted, round {k}", self.live_pool, self.spec, 10 + k, live=True
        )
        self.show(f"drifted (live), round {k}", entry["live_drifted"])
        self.cloud.wait_verified()
        new, new_disagree = self.cloud.new_verified(cutoff)
        entry["samples_new"] = new
        entry["new_samples_disagreement"] = new_disagree / new if new else None
        check_k, fired_k = self.cloud.trigger()
        entry.update(trigger_fired=bool(fired_k), trigger_stats=check_k.stats)
        self.progress.note(
            f"round {k}: trigger fired: {bool(fired_k)} ({check_k.reason});"
            f" {new} newly verified samples"
            + ("" if not new else f", teacher disagreed with the edge on {new_disagree / new:.1%}")
        )
        if not fired_k:
            entry.update(job=None, skipped="the trigger did not fire")
        return bool(fired_k)

    def deliver(self, k: int, entry: dict[str, Any]) -> None:
        """Round ``k``'s job, and its model's way to every agent."""
        timeline, progress = self.timeline, self.progress
        round_started = time.perf_counter()
        t_round = timeline.now()
        job_id = self.cloud.run_next_job()
        job_wall = time.perf_counter() - round_started
        entry["job"] = self.cloud.job_entry(job_id)
        want = entry["job"]["version"] if entry["job"] else None
        delivered = self.on_version(want, timeout=60.0) if want else False
        entry["agents_on"] = {a.settings.agent_id: a.engine.version for a in self.fleet.agents}
        entry["delivered"] = delivered
        entry["round_s"] = round(time.perf_counter() - round_started, 1)
        entry["job_wall_s"] = round(job_wall, 1)
        with timeline.lock:
            n = len(timeline.frames)
            timeline.spans.append((f"distillation round {k}", n, n, t_round, timeline.now()))
        progress.note(
            f"round {k} took {entry['round_s']} s (job {entry['job_wall_s']} s);"
            f" agents now on {entry['agents_on']}"
        )
        gate = entry["job"]["gate"] if entry["job"] else None
        if gate and not gate["passed"]:
            progress.note(f"[yellow]round {k}: gate refused: {gate['reasons']}[/]")

    def rounds(self, rounds: int) -> None:
        """Up to ``rounds`` rounds; the top-level figures are the last completed round's."""
        report = self.report
        rounds_out: list[dict[str, Any]] = []
        report["rounds"] = rounds_out
        for k in range(1, rounds + 1):
            round_wall0 = time.perf_counter()
            entry: dict[str, Any] = {"round": k}
            if k == 1:
                entry.update(self.first)
            elif not self.resume(k, entry):
                rounds_out.append(entry)
                break
            self.deliver(k, entry)
            # After: new frames (evaluation pool). Only the last round's column is live:
            # a later round trains on the newest verified samples, and no evaluation
            # frame may be among them.
            last_round = k == rounds
            entry["after"] = self.fleet.run_phase(
                f"after round {k}", self.eval_pool, self.spec, EVAL_DRIFT_SEED, live=last_round
            )
            self.show(
                f"after round {k}, evaluation frames, drifted" + (" (live)" if last_round else ""),
                entry["after"],
            )
            entry["after_clean"] = self.fleet.run_phase(
                f"measure: clean after round {k}", self.eval_pool, (), EVAL_CLEAN_SEED, live=False
            )
            self.show(f"after round {k}, evaluation frames, clean", entry["after_clean"])
            entry["round_wall_s"] = round(time.perf_counter() - round_wall0, 1)
            rounds_out.append(entry)

        # The top-level figures are the last completed round's (the fleet's final state).
        done = [e for e in rounds_out if "after" in e]
        if done:
            last = done[-1]
            for name in (
                "job",
                "agents_on",
                "delivered",
                "round_s",
                "job_wall_s",
                "after",
                "after_clean",
            ):
                report[name] = last[name]


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small, fast-trained models")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--frames", type=int, default=400, help="frames per agent per phase")
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="distillation rounds")
    parser.add_argument("--drift", default="blur:0.8")
    parser.add_argument("--threshold", type=float, default=0.85)
    parser.add_argument("--threads", type=int, default=2, help="the job's thread limit")
    parser.add_argument("--plot", type=Path, default=Path("closed_loop.svg"))
    parser.add_argument("--report", type=Path, default=None, help="write an HTML report here")
    parser.add_argument("--stream-renders", type=int, default=16, help="renders per stream scan")
    args = parser.parse_args()
    report = run_closed_loop(
        None,
        quick=args.quick,
        frames=args.frames,
        agents=args.agents,
        drift=args.drift,
        threshold=args.threshold,
        threads=args.threads,
        plot=args.plot,
        report_html=args.report,
        rounds=args.rounds,
        stream_renders=args.stream_renders,
    )
    if args.json:
        print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
