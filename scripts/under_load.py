"""Run pytest several times in a row while busy loops keep the CPUs occupied.

    .venv/bin/python scripts/under_load.py [--runs 10] [--busy 2] [--out FILE]
                                           PATH [PATH ...] [-- PYTEST_ARGS ...]

Starts ``--busy`` processes that spin (``while True: pass``), then runs
``pytest -p no:cacheprovider -q PATH ...`` ``--runs`` times, one after the other.
Each run's passed, failed, error and skipped counts and its duration are written to
``--out`` (JSON, default bench/results/under_load.json) and printed as a table. The
busy loops are stopped at the end, also on Ctrl-C. Exit status 1 when any run failed.

A test that passes alone but fails here depends on how fast the machine is: it
asserts a wall-clock bound or sleeps instead of waiting for what it needs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "under_load.json"
BUSY_LOOP = "while True: pass"
OUTPUT_KEPT = 4000  # characters of a failed run's output kept in the JSON


@dataclass
class RunResult:
    """One pytest run: its counts, duration and exit status."""

    run: int
    passed: int
    failed: int
    errors: int
    skipped: int
    duration_s: float
    returncode: int
    failing_tests: list[str] = field(default_factory=list)
    output_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def start_busy_loops(count: int) -> list[subprocess.Popen[bytes]]:
    """``count`` Python processes that spin until stopped."""
    return [
        subprocess.Popen(
            [sys.executable, "-c", BUSY_LOOP],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(count)
    ]


def stop_busy_loops(processes: list[subprocess.Popen[bytes]]) -> None:
    """Terminate each busy loop (kill it if it does not go), and reap it."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


_SUMMARY_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")


def _counts_from_summary(output: str) -> dict[str, int]:
    """Counts from pytest's last summary line (``3 passed, 1 failed in 2.0s``)."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    summaries = [line for line in output.splitlines() if _SUMMARY_COUNT.search(line)]
    if summaries:
        for number, word in _SUMMARY_COUNT.findall(summaries[-1]):
            key = {"error": "errors", "xfailed": "skipped", "xpassed": "passed"}.get(word, word)
            counts[key] += int(number)
    return counts


def _counts_from_junit(path: Path) -> dict[str, int] | None:
    """Counts from pytest's JUnit XML report; None when it was not written."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in total:
            total[key] += int(suite.get(key, "0"))
    return {
        "passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": total["skipped"],
    }


def _failures_from_junit(path: Path) -> list[str]:
    """``module.Class::test`` of each failed or erroring test case in the JUnit report."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    return [
        f"{case.get('classname', '')}::{case.get('name', '')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]


def run_pytest(index: int, paths: list[str], extra: list[str], folder: Path) -> RunResult:
    """One ``pytest -p no:cacheprovider -q`` run over ``paths``."""
    report = folder / f"run-{index}.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfE",
        f"--junitxml={report}",
        *paths,
        *extra,
    ]
    started = time.monotonic()
    completed = subprocess.run(
        command,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    duration = time.monotonic() - started
    output = completed.stdout or ""
    counts = _counts_from_junit(report) or _counts_from_summary(output)
    return RunResult(
        run=index,
        duration_s=round(duration, 2),
        returncode=completed.returncode,
        failing_tests=_failures_from_junit(report),
        output_tail="" if completed.returncode == 0 else output[-OUTPUT_KEPT:],
        **counts,
    )


def table(results: list[RunResult]) -> str:
    """The runs as a plain-text table."""
    head = f"{'run':>4} {'passed':>7} {'failed':>7} {'errors':>7} {'skipped':>8} {'seconds':>8}  ok"
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(
            f"{r.run:>4} {r.passed:>7} {r.failed:>7} {r.errors:>7} {r.skipped:>8}"
            f" {r.duration_s:>8.1f}  {'yes' if r.ok else 'NO'}"
        )
    return "\n".join(rows)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in args_in:
        cut = args_in.index("--")
        args_in, extra = args_in[:cut], args_in[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="test files or folders for pytest")
    parser.add_argument("--runs", type=int, default=10, help="pytest runs in a row")
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    args = parser.parse_args(args_in)
    if args.runs < 1 or args.busy < 0:
        parser.error("--runs must be at least 1 and --busy at least 0")

    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in background
    signal.signal(signal.SIGTERM, _raise_interrupt)
    results: list[RunResult] = []
    started_at = datetime.now(UTC).isoformat(timespec="seconds")

    def write(interrupted: bool, finished: bool) -> dict[str, object]:
        summary = {
            "started_at": started_at,
            "paths": args.paths,
            "pytest_args": ["-p", "no:cacheprovider", "-q", "-rfE", *extra],
            "busy_processes": args.busy,
            "cpus": os.cpu_count(),
            "runs_requested": args.runs,
            "interrupted": interrupted,
            "finished": finished,
            "all_passed": finished and bool(results) and all(r.ok for r in results),
            "runs": [asdict(r) for r in results],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    busy = start_busy_loops(args.busy)
    interrupted = False
    try:
        with tempfile.TemporaryDirectory(prefix="under-load-") as folder:
            for index in range(1, args.runs + 1):
                result = run_pytest(index, args.paths, extra, Path(folder))
                results.append(result)
                write(interrupted=False, finished=False)  # a run cut short keeps what ended
                print(
                    f"run {index}/{args.runs}: {result.passed} passed, {result.failed} failed,"
                    f" {result.errors} errors, {result.skipped} skipped"
                    f" in {result.duration_s:.1f} s",
                    flush=True,
                )
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: stopping the busy loops", file=sys.stderr)
    finally:
        stop_busy_loops(busy)

    summary = write(interrupted=interrupted, finished=not interrupted)
    print()
    print(table(results))
    print(f"\nbusy loops: {args.busy}; results in {args.out}")
    return 0 if summary["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
