"""bench.ab's sides: a checkout and its settings, each side's processes importing from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.ab import Side, ThreadCpu, parse_side, side_env
from bench.common import Scrape

CHECKOUT = Path(__file__).resolve().parents[2]


def test_a_side_is_a_checkout_with_a_name_and_settings() -> None:
    side = parse_side(f"base={CHECKOUT}:EDGELOOP_GC_YOUNG_EVERY=0,EDGELOOP_X=a=b", "A")
    assert side.name == "base"
    assert side.tree == CHECKOUT
    assert side.env == {"EDGELOOP_GC_YOUNG_EVERY": "0", "EDGELOOP_X": "a=b"}
    plain = parse_side(str(CHECKOUT), "B")
    assert (plain.name, plain.tree, plain.env) == ("B", CHECKOUT, {})


def test_its_processes_import_from_its_checkout_with_its_settings() -> None:
    side = parse_side(f"{CHECKOUT}:EDGELOOP_LOG_LEVEL=DEBUG", "A")
    env = side_env(side, {"PATH": "/usr/bin", "PYTHONPATH": "/elsewhere"})
    assert env == {"PATH": "/usr/bin", "PYTHONPATH": str(CHECKOUT), "EDGELOOP_LOG_LEVEL": "DEBUG"}


@pytest.mark.parametrize(
    ("text", "message"),
    [("/", "is not a checkout"), (f"{CHECKOUT}:NOVALUE", "expected VAR=VALUE")],
)
def test_a_malformed_side_is_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_side(text, "A")


def test_thread_cpu_is_reported_per_unit_by_thread_busiest_first() -> None:
    sides = [Side("A", Path("."), {}), Side("B", Path("."), {})]
    threads = ThreadCpu(sides)
    first = Scrape({"decode": 1.0, "other": 2.0})
    second = Scrape({"decode": 1.5, "other": 2.1})
    threads.add("A", second.since(first), 500)
    threads.add("A", Scrape({"decode": 2.0, "other": 2.2}).since(second), 500)
    threads.add(
        "B", Scrape({"decode": 0.8, "verdicts": 0.05}, batch_frames=1000, batches=200), 1000
    )
    lines = threads.table("sample").splitlines()
    assert lines[0].split()[-2:] == ["A", "B"]
    assert lines[1].split() == ["decode", "1.000", "0.800"]
    assert lines[2].split() == ["other", "0.200", "-"]
    assert lines[3].split() == ["verdicts", "-", "0.050"]
    assert lines[4].split()[-2:] == ["-", "5.00"]  # frames per inference batch (B's agent)


def test_a_side_without_thread_figures_adds_no_table() -> None:
    threads = ThreadCpu([Side("A", Path("."), {})])
    threads.add("A", Scrape(), 100)
    assert threads.table("frame") == ""


def test_a_pools_threads_add_up_under_its_stage() -> None:
    from bench.common import by_stage

    seconds = {"decode_0": 1.0, "decode_1": 2.0, "inference-loop": 0.5, "inference-loop-1": 0.25}
    assert by_stage({**seconds, "spool-writer": 0.1}) == {
        "decode": 3.0,
        "inference-loop": 0.75,
        "spool-writer": 0.1,
    }


def test_a_layout_is_named_as_intra_op_and_inference_threads() -> None:
    from bench.ab import _layout
    from bench.agent import LAYOUTS, Layout

    assert _layout("0,1") == Layout(0, 1)
    assert _layout("1,2,pinned") == Layout(1, 2, pinned=True)
    free = [layout for layout in LAYOUTS if not layout.pinned]
    assert _layout("") == free[-1]  # a batch per core, free to move, unless named
