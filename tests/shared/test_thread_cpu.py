import threading
import time

from prometheus_client import CollectorRegistry, generate_latest

from shared.thread_cpu import (
    OTHER,
    ThreadCpuCollector,
    scraped_thread_seconds,
    thread_cpu_seconds,
)


def _burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's own CPU time."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def test_a_busy_thread_shows_its_cpu_under_its_name_and_the_rest_adds_up() -> None:
    burned, release = threading.Event(), threading.Event()

    def work() -> None:
        _burn(0.05)
        burned.set()
        release.wait()

    thread = threading.Thread(target=work, name="spinner")
    thread.start()
    try:
        assert burned.wait(30)
        before = time.process_time()
        figures = thread_cpu_seconds()
        after = time.process_time()
        assert figures["spinner"] >= 0.05
        assert figures[OTHER] >= 0.0
        assert before - 0.02 <= sum(figures.values()) <= after + 0.02
    finally:
        release.set()
        thread.join()


def test_an_ended_threads_cpu_moves_to_other() -> None:
    before = thread_cpu_seconds()
    thread = threading.Thread(target=_burn, args=(0.05,), name="short-lived")
    thread.start()
    thread.join()
    after = thread_cpu_seconds()
    assert "short-lived" not in after
    # The reading thread's own figure may lag by a scheduler tick (a few ms).
    assert after[OTHER] - before[OTHER] >= 0.04


def test_threads_of_one_name_add_up() -> None:
    burned = threading.Barrier(3)
    release = threading.Event()

    def work() -> None:
        _burn(0.03)
        burned.wait()
        release.wait()

    threads = [threading.Thread(target=work, name="pool") for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        burned.wait(30)
        assert thread_cpu_seconds()["pool"] >= 0.06
    finally:
        release.set()
        for thread in threads:
            thread.join()


def test_the_collector_exports_a_counter_per_thread() -> None:
    registry = CollectorRegistry()
    registry.register(ThreadCpuCollector())
    text = generate_latest(registry).decode()
    assert "# TYPE edgeloop_thread_cpu_seconds_total counter" in text
    assert 'edgeloop_thread_cpu_seconds_total{thread="MainThread"}' in text
    assert 'edgeloop_thread_cpu_seconds_total{thread="other"}' in text


def test_a_scraped_page_gives_the_seconds_by_thread() -> None:
    registry = CollectorRegistry()
    registry.register(ThreadCpuCollector())
    figures = scraped_thread_seconds(generate_latest(registry).decode())
    assert set(figures) >= {"MainThread", OTHER}
    assert min(figures.values()) >= 0.0  # CPU time, never negative
    assert scraped_thread_seconds("# a page without the metric\nup 1\n") == {}
