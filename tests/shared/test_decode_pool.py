"""The decode pool: a decode past its budget, or a decoder crash, costs one worker process."""

from __future__ import annotations

import functools
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
from PIL import Image

from shared.decode_pool import DecodePool
from shared.errors import ImageDecodeFailedError, ImageDecodeTimeoutError, ImageError
from shared.images import DEFAULT_ISOLATE_COST, decode_cost, probe_image
from tests.shared import decoders
from tests.shared.jpeg_bomb import progressive_jpeg

PRELOAD = ("tests.shared.decoders",)


def _wait_for(path: Path, thread: threading.Thread) -> None:
    """Until the hanging decoder has started (its file), while its caller still waits."""
    pause = threading.Event()
    deadline = time.monotonic() + 60  # a safety net: it starts within moments
    while not path.exists() and thread.is_alive() and time.monotonic() < deadline:
        pause.wait(0.01)
    assert path.exists()


def _pid(pool: DecodePool) -> int:
    return int.from_bytes(pool.run(decoders.pid, b"").tobytes(), "little")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def pool() -> Iterator[DecodePool]:
    # Long enough for any quick decode on a loaded machine; the hanging one still ends.
    with DecodePool(1, budget_s=2.0, preload=PRELOAD, name="test-decode") as started:
        yield started


def test_a_decode_past_its_budget_kills_the_worker_and_a_new_one_decodes(
    pool: DecodePool, tmp_path: Path
) -> None:
    before = _pid(pool)
    with pytest.raises(ImageDecodeTimeoutError) as raised:
        pool.run(functools.partial(decoders.hang, str(tmp_path / "started")), b"bomb")
    assert raised.value.reason == "image_decode_timeout"
    assert (tmp_path / "started").read_text() == str(before)  # it was decoding when killed
    assert _gone(before)
    after = _pid(pool)
    assert after != before
    assert pool.timeouts == 1
    echoed = pool.run(decoders.echo, bytes(range(12)), (2, 2, 3))
    assert echoed.shape == (2, 2, 3) and echoed.dtype == np.uint8
    assert echoed.reshape(-1).tolist() == list(range(12))


def test_a_decoder_crash_refuses_the_image_and_the_pool_heals(pool: DecodePool) -> None:
    before = _pid(pool)
    with pytest.raises(ImageDecodeFailedError) as raised:
        pool.run(decoders.crash, b"crash")
    assert raised.value.reason == "image_decode_failed"
    assert _gone(before)
    assert _pid(pool) != before
    assert pool.crashes == 1


def test_a_decoder_refusal_keeps_its_reason_and_its_worker(pool: DecodePool) -> None:
    before = _pid(pool)
    with pytest.raises(ImageError) as raised:
        pool.run(decoders.refuse, b"junk")
    assert type(raised.value) is ImageError
    assert raised.value.reason == "undecodable"
    assert _pid(pool) == before


def test_other_workers_decode_while_one_hangs(tmp_path: Path) -> None:
    started = tmp_path / "started"
    outcome: list[BaseException] = []

    def bomb(pool: DecodePool) -> None:
        try:
            pool.run(functools.partial(decoders.hang, str(started)), b"bomb")
        except BaseException as exc:
            outcome.append(exc)

    # A budget no test run reaches: the hanging decode ends only when the pool closes.
    with DecodePool(2, budget_s=3600, preload=PRELOAD, name="test-decode") as pool:
        thread = threading.Thread(target=bomb, args=(pool,), name="bomb")
        thread.start()
        _wait_for(started, thread)
        hung = int(started.read_text())
        for i in range(20):
            data = bytes([i]) * 6
            assert pool.run(decoders.echo, data, (2, 3)).tobytes() == data
        assert thread.is_alive()  # all 20 answered while the bomb was still decoding
    thread.join(30)
    assert not thread.is_alive()
    assert [type(exc) for exc in outcome] == [ImageDecodeFailedError]
    assert _gone(hung)


def test_close_leaves_no_worker_process() -> None:
    with DecodePool(3, budget_s=5, preload=PRELOAD, name="test-decode") as pool:
        pids = [pid for pid in pool.pids if pid is not None]
        assert len(pids) == 3
        assert not any(_gone(pid) for pid in pids)
    assert all(_gone(pid) for pid in pids)
    assert pool.pids == [None, None, None]
    with pytest.raises(ImageDecodeFailedError):
        pool.run(decoders.echo, b"x", (1,))


def test_a_result_over_the_limit_is_refused() -> None:
    with DecodePool(1, budget_s=5, max_result_bytes=8, preload=PRELOAD) as pool:
        with pytest.raises(ImageDecodeFailedError):
            pool.run(decoders.echo, bytes(12), (12,))
        assert pool.run(decoders.echo, bytes(8), (8,)).shape == (8,)


def _jpeg(side: int, *, progressive: bool) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (90, 120, 150)).save(
        buffer, format="JPEG", progressive=progressive
    )
    return buffer.getvalue()


def test_only_progressive_or_costly_images_are_isolated() -> None:
    baseline = _jpeg(64, progressive=False)
    cost = decode_cost(baseline, probe_image(baseline))
    assert (cost.scans, cost.progressive, cost.units) == (1, False, 64 * 64)
    assert not cost.isolate(DEFAULT_ISOLATE_COST)
    assert cost.isolate(64 * 64 - 1)  # over the threshold: isolated even when baseline
    progressive = progressive_jpeg()
    cost = decode_cost(progressive, probe_image(progressive))
    assert cost.progressive and cost.scans > 1
    assert cost.isolate(DEFAULT_ISOLATE_COST)
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64)).save(buffer, format="PNG")
    png = buffer.getvalue()
    cost = decode_cost(png, probe_image(png))
    assert (cost.scans, cost.progressive) == (1, False)
    assert not cost.isolate(DEFAULT_ISOLATE_COST)
