"""Workers: named threads that start together, stop together and report health."""

from __future__ import annotations

import threading

import pytest

from shared.lifecycle import Lifecycle, Workers


def test_loop_runs_until_stop_and_leaves_no_thread() -> None:
    workers = Workers("unit")
    ran = threading.Event()
    workers.spawn("tick", ran.set, every=0.01)
    assert ran.wait(30)
    assert workers.alive
    assert workers.stop() == []
    assert not any(t.name == "unit-tick" for t in threading.enumerate())
    assert workers.health()["tick"].alive is False
    assert workers.health()["tick"].iterations >= 1


def test_a_failing_iteration_is_counted_and_the_loop_goes_on() -> None:
    workers = Workers("unit")
    calls: list[int] = []
    second = threading.Event()

    def body() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("boom")
        second.set()

    workers.spawn("flaky", body, every=0.0)
    assert second.wait(30)
    workers.stop()
    health = workers.health()["flaky"]
    assert health.errors == 1
    assert health.last_error == "ValueError: boom"


def test_a_run_once_worker_watches_stopping() -> None:
    workers = Workers("unit")
    started = threading.Event()

    def run() -> None:
        started.set()
        workers.stopping.wait()

    workers.spawn("wait", run)
    assert started.wait(30)
    assert workers.stop(timeout=30) == []


def test_a_thread_that_ignores_stop_is_named() -> None:
    workers = Workers("unit")
    release = threading.Event()
    workers.spawn("stuck", release.wait)
    try:
        assert workers.stop(timeout=0.0) == ["unit-stuck"]
    finally:
        release.set()


def test_no_new_worker_while_stopping() -> None:
    workers = Workers("unit")
    workers.stop()
    with pytest.raises(RuntimeError, match="while stopping"):
        workers.spawn("late", lambda: None)


def test_workers_is_not_itself_a_lifecycle_but_parts_are() -> None:
    class Part:
        def start(self) -> Part:
            return self

        def stop(self) -> None:
            return None

        def health(self) -> dict[str, object]:
            return {}

    assert isinstance(Part(), Lifecycle)


def test_wait_first_defers_the_first_call_by_one_interval() -> None:
    workers = Workers("unit")
    calls: list[int] = []
    workers.spawn("late", lambda: calls.append(1), every=3600.0, wait_first=True)
    assert workers.stop() == []  # stopped during the first wait: never called
    assert calls == []
