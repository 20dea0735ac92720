"""Two checkouts side by side: the verifier or the agent from each, rounds alternating.

    git worktree add /tmp/edgeloop-base HEAD~1
    python -m bench.ab verifier --rounds 8 /tmp/edgeloop-base .
    python -m bench.ab agent --model detector --routing defaults --rounds 6 /tmp/edgeloop-base .
    python -m bench.ab agent --source video --layout 0,1 /tmp/edgeloop-base .
    python -m bench.ab verifier A=. B=.:EDGELOOP_VERIFIER_GC_YOUNG_EVERY=0
    python -m bench.ab agent --source video one=. \
        per-core=.:EDGELOOP_INFERENCE_THREADS=2,EDGELOOP_INTRA_OP_THREADS=1

A change that moves a figure by a few percent hides in the noise of one host between
runs; run alternately on the same host, two processes see the same noise. Each side
is ``[NAME=]TREE[:VAR=VALUE,...]``: a checkout of this project (its processes import
from it: it is their working directory and their ``PYTHONPATH``) and settings for that
side's processes only. The side figures in the closing notes of performance changes
come from here; the goals come from ``make bench``.

* ``verifier``: one ``cloud-service verifier`` process per side (``--workers`` each)
  on the bench's PostgreSQL, Mosquitto and seeded teacher, each side on topics of its
  own; a round publishes ``--samples`` of the bench's ~20 KB envelopes to one side, as
  fast as it verifies them (``bench.cloud``). Per side: the CPU of its process tree
  per sample, and samples per second.
* ``agent``: one ``edge-agent run`` per side behind HTTP, in the bench's fastest
  layout for a camera-sized student, with the bench's load generator and, when it
  forwards, the bench's stand-in cloud answering both; a round is one burst of the
  model's frames to one side (after its last forwarded samples settled). Per side:
  the agent's CPU per frame, and frames per second. With ``--source video``, a round
  is instead one side's agent reading the bench's clip with a camera source for a
  window (``bench.agent``'s video window, in a process of the side's checkout), the
  stand-in cloud in that process. A side's ``EDGELOOP_INFERENCE_THREADS`` and
  ``EDGELOOP_INTRA_OP_THREADS`` (and ``EDGELOOP_PIN_INFERENCE_THREADS``) win over
  ``--layout`` on either source.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.common import Scrape, scrape

__all__ = ["Side", "parse_side", "side_env"]

MODELS = {
    "detector": "detector student int8",
    "224": "tiny-student 224px",
    "reference": "reference student int8",
}


@dataclass(frozen=True)
class Side:
    """One side of the comparison: its name, its checkout and its settings."""

    name: str
    tree: Path
    env: dict[str, str] = field(default_factory=dict)


def parse_side(text: str, default_name: str) -> Side:
    """``[NAME=]TREE[:VAR=VALUE,...]`` -> Side (ValueError when malformed)."""
    head, _, settings = text.partition(":")
    name, named, tree = head.partition("=")
    if not named:
        name, tree = "", head
    env: dict[str, str] = {}
    for item in filter(None, settings.split(",")):
        var, equals, value = item.partition("=")
        if not equals or not var:
            raise ValueError(f"expected VAR=VALUE, got {item!r} in {text!r}")
        env[var] = value
    path = Path(tree or ".").resolve()
    if not (path / "edge_agent").is_dir() or not (path / "cloud_service").is_dir():
        raise ValueError(f"{path} is not a checkout of this project")
    return Side(name or default_name, path, env)


def _slug(side: Side) -> str:
    """The side's name as MQTT client ids, agent ids and group ids accept it."""
    return "ab-" + re.sub(r"[^a-z0-9_-]", "-", side.name.lower())[:40]


def side_env(side: Side, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of a side's processes: ``base``, its checkout first on the
    import path, and its settings."""
    return {**base, "PYTHONPATH": str(side.tree), **side.env}


def _summary(cost: dict[str, list[float]], rate: dict[str, list[float]], units: str) -> str:
    lines = []
    for name in cost:
        lines.append(
            f"{name}: {units} median {statistics.median(cost[name]):.3f}"
            f" (min {min(cost[name]):.3f}, {len(cost[name])} rounds),"
            f" per second median {statistics.median(rate[name]):.0f}"
        )
    return "\n".join(lines)


class ThreadCpu:
    """Each side's CPU by thread over its rounds, per unit of work (frame, sample)."""

    def __init__(self, sides: list[Side]) -> None:
        self.seconds: dict[str, dict[str, float]] = {side.name: {} for side in sides}
        self.units: dict[str, int] = {side.name: 0 for side in sides}
        self.batches = {side.name: Scrape() for side in sides}

    def add(self, side: str, used: Scrape, units: int) -> None:
        """``used``: what one round of ``units`` frames or samples cost the side."""
        totals = self.seconds[side]
        for thread, seconds in used.threads.items():
            totals[thread] = totals.get(thread, 0.0) + seconds
        so_far = self.batches[side]
        self.batches[side] = Scrape(
            batch_frames=so_far.batch_frames + used.batch_frames,
            batches=so_far.batches + used.batches,
        )
        self.units[side] += units

    def table(self, unit: str) -> str:
        """Milliseconds per ``unit`` by thread, a column per side, busiest first."""
        per_unit = {
            name: {t: s / max(self.units[name], 1) * 1e3 for t, s in self.seconds[name].items()}
            for name in self.seconds
        }
        batches = None
        if any(b.batches for b in self.batches.values()):
            batches = {
                name: b.batch_frames / b.batches if b.batches else None
                for name, b in self.batches.items()
            }
        return _thread_table(per_unit, f"CPU ms per {unit} by thread", batches)


def verifier(sides: list[Side], rounds: int, samples: int, workers: int) -> str:
    from bench import cloud
    from cloud_service.demo_teacher import build_demo_teacher
    from shared.mqtt import MqttTarget, negotiate_protocol
    from shared.topics import Topics
    from simulations.stack import Stack

    workdir = Path(tempfile.mkdtemp(prefix="edgeloop-ab-"))
    teacher = build_demo_teacher(workdir / "teacher.onnx", size=cloud.SIZE, hidden=2048, seed=0)
    protocol = negotiate_protocol(MqttTarget.parse(cloud.BROKER))
    stack = Stack(
        workdir,
        broker=cloud.BROKER,
        db="postgres",
        verifier=None,
        teacher=teacher,
        topic_prefix=f"ab-{uuid.uuid4().hex[:8]}/v1",
        cloud={
            "mqtt_session_expiry_s": 0,
            "max_batch_size": cloud.BATCH,
            "max_queue_delay_ms": 2.0,
            "review_audit_share": 0.02,
        },
        name="ab",
    )
    cost: dict[str, list[float]] = {side.name: [] for side in sides}
    rate: dict[str, list[float]] = {side.name: [] for side in sides}
    with ExitStack() as stack_exit:
        stack_exit.enter_context(stack)
        running = []
        for side in sides:
            tag = f"{_slug(side)}-{uuid.uuid4().hex[:6]}"
            process = stack.verifier_process(
                workers=workers,
                ready_timeout_s=120.0,
                stop_timeout_s=60.0,
                checkout=side.tree,
                env=side.env,
                topic_prefix=f"{tag}/v1",
                verifier_client_id=tag,
                verifier_group=tag,
            )
            stack_exit.enter_context(process)
            running.append((side.name, Topics(prefix=f"{tag}/v1"), process))
        for _, topics, _ in running:
            cloud._processes_end_to_end(topics, 300, protocol)  # warm-up
        threads = ThreadCpu(sides)
        for i in range(rounds):
            for name, topics, process in running if i % 2 == 0 else running[::-1]:
                urls = [f"http://127.0.0.1:{process.port + w}/metrics" for w in range(workers)]
                before = scrape(urls)
                seconds, used = cloud._processes_end_to_end(
                    topics, samples, protocol, tree=process.pid
                )
                threads.add(name, scrape(urls).since(before), samples)
                cost[name].append(used["verifier"])
                rate[name].append(samples / seconds)
            print(i, {name: round(c[-1], 3) for name, c in cost.items()}, flush=True)
    summary = _summary(cost, rate, "verifier CPU ms per sample")
    return "\n\n".join(filter(None, [threads.table("sample"), summary]))


def _model_and_frames(model_key: str, frames: int) -> tuple[Path, Path, str, list[bytes]]:
    """A work folder, the model ``model_key`` names (built in the model cache), its task,
    and ``frames`` of the bench's JPEG frames for it."""
    from bench import agent as bench_agent

    workdir = Path(tempfile.mkdtemp(prefix="edgeloop-ab-"))
    models = dict(bench_agent._models(workdir))
    if MODELS[model_key] not in models:
        raise SystemExit(f"{MODELS[model_key]} is not built here (edgeloop models bootstrap)")
    model = models[MODELS[model_key]]
    task, side_px = bench_agent._model_info(model)
    jpegs, _ = bench_agent._frames_for(task, side_px, frames)
    return workdir, model, task, jpegs


def agent(
    sides: list[Side], model_key: str, routing: str, rounds: int, layout_text: str = ""
) -> str:
    from bench import agent as bench_agent
    from shared.broker import free_port

    workdir, model, task, jpegs = _model_and_frames(model_key, 600)
    layout = _layout(layout_text)
    context = multiprocessing.get_context("spawn")
    client_end, client_child = context.Pipe()
    cloud_end, cloud_child = context.Pipe()
    agents: list[tuple[str, subprocess.Popen[bytes], int]] = []
    children: list[Any] = []
    cost: dict[str, list[float]] = {side.name: [] for side in sides}
    rate: dict[str, list[float]] = {side.name: [] for side in sides}
    try:
        for side in sides:
            port = free_port()
            folder = workdir / side.name
            config = bench_agent._write_config(folder, model, port, layout, routing=routing)
            agent_id = bench_agent.HTTP_AGENTS[routing]
            config.write_text(
                config.read_text().replace(f'"{agent_id}"', f'"{_slug(side)}"')
            )  # each side its own MQTT client
            env = side_env(side, {**os.environ, "PYTHONUNBUFFERED": "1"})
            process = subprocess.Popen(
                [sys.executable, "-m", "edge_agent.cli", "run", "--config", str(config)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
                cwd=side.tree,
            )
            agents.append((side.name, process, port))
        for _, process, port in agents:
            bench_agent._wait_ready(process, port)
        if routing != "off":
            stand_in = context.Process(
                target=bench_agent._cloud_main,
                args=(
                    bench_agent._broker_url(),
                    bench_agent.FLEET,
                    [_slug(side) for side in sides],
                    task == "detection",
                    cloud_child,
                ),
            )
            stand_in.start()
            children.append(stand_in)
            if bench_agent._answer(cloud_end, stand_in) != "ready":
                raise RuntimeError("the stand-in cloud did not start")
        client = context.Process(
            target=bench_agent._client_main, args=(jpegs, layout.clients, client_child)
        )
        client.start()
        children.append(client)
        if bench_agent._answer(client_end, client) != "ready":
            raise RuntimeError("the load generator did not start")
        for _, _, port in agents:  # warm-up
            client_end.send(("burst", port))
            bench_agent._answer(client_end, client)
        threads = ThreadCpu(sides)
        for i in range(rounds):
            for name, process, port in agents if i % 2 == 0 else agents[::-1]:
                watched = psutil.Process(process.pid)
                if routing != "off":
                    bench_agent._settle(port)
                metrics = [f"http://127.0.0.1:{port}/metrics"]
                threads_before = scrape(metrics)
                before = sum(watched.cpu_times()[:2])
                client_end.send(("burst", port))
                seconds, _latencies, errors, _client_cpu = bench_agent._answer(client_end, client)
                if errors:
                    raise RuntimeError(f"{errors} requests to {name} were not answered 200")
                if routing != "off":  # its forwarded samples' work, until receipted
                    bench_agent._settle(port)
                cost[name].append((sum(watched.cpu_times()[:2]) - before) / len(jpegs) * 1e3)
                threads.add(name, scrape(metrics).since(threads_before), len(jpegs))
                rate[name].append(len(jpegs) / seconds)
            print(i, {name: round(c[-1], 3) for name, c in cost.items()}, flush=True)
        client_end.send(("stop", 0))
        if routing != "off":
            cloud_end.send("stop")
    finally:
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
        for _, process, _ in agents:
            process.terminate()
            process.wait(20)
    summary = _summary(cost, rate, "agent CPU ms per frame")
    return "\n\n".join(filter(None, [threads.table("frame"), summary]))


_VIDEO_WINDOW = """
import json, os, sys
from pathlib import Path
from bench import agent as B
model, clip, window, routing, intra, at_once, pinned = sys.argv[1:8]
# A side's own layout settings win, as they do over the HTTP agent's config file.
intra = os.environ.get("EDGELOOP_INTRA_OP_THREADS", intra)
at_once = os.environ.get("EDGELOOP_INFERENCE_THREADS", at_once)
pinned = os.environ.get("EDGELOOP_PIN_INFERENCE_THREADS", pinned).lower() in ("1", "true")
figures = B._video_window(
    Path(model), Path(clip), float(window), routing=routing,
    layout=B.Layout(int(intra), int(at_once), pinned),
)
print(json.dumps(figures))
"""


def video(
    sides: list[Side], model_key: str, routing: str, rounds: int, layout_text: str = ""
) -> str:
    """Each side's agent reading the bench's clip with a camera source (``bench.agent``'s
    video window, in a process importing from the side's checkout), rounds alternating."""
    from bench import agent as bench_agent

    workdir, model, _task, jpegs = _model_and_frames(model_key, 64)
    clip = bench_agent._video(workdir / "clip.avi", jpegs)
    layout = _layout(layout_text)
    cost: dict[str, list[float]] = {side.name: [] for side in sides}
    rate: dict[str, list[float]] = {side.name: [] for side in sides}
    threads: dict[str, dict[str, list[float]]] = {side.name: {} for side in sides}
    for i in range(rounds):
        for side in sides if i % 2 == 0 else sides[::-1]:
            command = [
                sys.executable,
                "-c",
                _VIDEO_WINDOW,
                *(str(x) for x in (model, clip, 3.0, routing)),
                *(str(x) for x in (layout.intra_op_threads, layout.inference_threads)),
                str(layout.pinned).lower(),
            ]
            done = subprocess.run(
                command,
                env=side_env(side, {**os.environ, "PYTHONUNBUFFERED": "1"}),
                cwd=side.tree,
                capture_output=True,
                text=True,
                timeout=300,
                check=True,
            )
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            cost[side.name].append(figures["video_cpu_ms_per_frame"])
            rate[side.name].append(figures["video_fps"])
            for key, value in figures.items():
                if key.startswith("video_cpu_us_"):
                    threads[side.name].setdefault(key[len("video_cpu_us_") :], []).append(value)
        print(i, {name: round(c[-1], 3) for name, c in cost.items()}, flush=True)
    by_thread = {
        name: {thread: statistics.median(v) / 1e3 for thread, v in figures.items()}
        for name, figures in threads.items()
    }
    summary = _summary(cost, rate, "agent CPU ms per frame on video")
    table = _thread_table(by_thread, "CPU ms per frame by thread (medians)")
    return "\n\n".join(filter(None, [table, summary]))


def _layout(text: str) -> Any:
    """``INTRA,THREADS[,pinned]`` as the bench's Layout; empty: a batch per core, the
    threads free to move."""
    from bench import agent as bench_agent

    if not text:
        free = [c for c in bench_agent.LAYOUTS if not c.pinned]
        return free[-1]
    intra, at_once, *rest = text.split(",")
    if rest not in ([], ["pinned"]):
        raise ValueError(f"expected INTRA,THREADS[,pinned], got {text!r}")
    return bench_agent.Layout(int(intra), int(at_once), pinned=bool(rest))


def _thread_table(
    by_thread: dict[str, dict[str, float]],
    header: str,
    batches: dict[str, float | None] | None = None,
) -> str:
    """A column per side of milliseconds by thread, busiest first; with ``batches``, a
    last row of each side's frames per inference batch. Empty when there are no threads."""
    names = list(by_thread)
    threads = sorted(
        {t for figures in by_thread.values() for t in figures},
        key=lambda t: -max(figures.get(t, 0.0) for figures in by_thread.values()),
    )
    if not threads:
        return ""
    batch_label = "frames per inference batch"
    width = max(len(t) for t in [*threads, header, batch_label])
    lines = [header.ljust(width) + "".join(f"{n:>10}" for n in names)]
    for thread in threads:
        cells = "".join(
            f"{by_thread[n][thread]:>10.3f}" if thread in by_thread[n] else f"{'-':>10}"
            for n in names
        )
        lines.append(thread.ljust(width) + cells)
    if batches is not None:
        cells = "".join(
            f"{batches[n]:>10.2f}" if batches.get(n) is not None else f"{'-':>10}" for n in names
        )
        lines.append(batch_label.ljust(width) + cells)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for command in ("verifier", "agent"):
        sub = commands.add_parser(command)
        sub.add_argument("a", help="[NAME=]TREE[:VAR=VALUE,...] (NAME defaults to A)")
        sub.add_argument("b", help="[NAME=]TREE[:VAR=VALUE,...] (NAME defaults to B)")
        sub.add_argument("--rounds", type=int, default=8)
        if command == "verifier":
            sub.add_argument("--samples", type=int, default=4000)
            sub.add_argument("--workers", type=int, default=1)
        else:
            sub.add_argument("--model", choices=sorted(MODELS), default="detector")
            sub.add_argument("--routing", choices=("off", "defaults", "all"), default="defaults")
            sub.add_argument(
                "--layout",
                default="",
                metavar="INTRA,THREADS[,pinned]",
                help="ORT intra-op threads (0: one per core) and inference threads, each"
                " pinned to a core with ',pinned'; default 1,<cores>: a batch per core",
            )
            sub.add_argument(
                "--source",
                choices=("http", "video"),
                default="http",
                help="frames over HTTP (edge-agent run), or a camera source reading a clip",
            )
    args = parser.parse_args(argv)
    try:
        sides = [parse_side(args.a, "A"), parse_side(args.b, "B")]
    except ValueError as exc:
        parser.error(str(exc))
    if _slug(sides[0]) == _slug(sides[1]):
        parser.error(f"the sides need different names ({sides[0].name}, {sides[1].name})")
    if args.command == "verifier":
        print(verifier(sides, args.rounds, args.samples, args.workers))
    else:
        run = video if args.source == "video" else agent
        print(run(sides, args.model, args.routing, args.rounds, args.layout))


if __name__ == "__main__":
    main()
