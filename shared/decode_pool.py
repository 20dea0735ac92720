"""Image decoding in worker processes, each image within a time budget.

A decode running in a thread cannot be stopped: a thread inside libjpeg keeps its
core until the decoder returns, however long that takes. ``DecodePool`` runs a
decode in one of a few worker processes instead and waits at most the budget for
it. A worker past its budget is killed (SIGKILL) and the caller gets
``ImageDecodeTimeoutError`` (reason ``image_decode_timeout``) at once, while a
thread starts its replacement; a worker that dies while decoding (a decoder crash)
is replaced the same way and the caller gets ``ImageDecodeFailedError``
(``image_decode_failed``). The other workers keep decoding meanwhile, and a caller
waits for a free worker at most one budget (plus a replacement's start) per image
ahead of it.

Workers start from the forkserver (spawn where there is none), never by a plain
fork of a parent that has threads: all of them with ``start()``, else each with
its first image. Each imports the ``preload`` modules before it takes work, so
imports never count against a budget. A request is the decoder (a
module-level function, pickled by reference) and its arguments, then the encoded
bytes; the answer is a JSON header and the pixels, received straight into their
array. Nothing a worker sends back is unpickled, and its array is refused past
``max_result_bytes``: a worker runs a decoder on untrusted bytes.

Which images go through the pool is ``shared.images.DecodeCost.isolate``: see there.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import BufferTooShort
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any

import numpy as np

from shared.errors import (
    EdgeLoopError,
    ImageDecodeFailedError,
    ImageDecodeTimeoutError,
    ImageError,
)
from shared.images import DEFAULT_ISOLATE_COST, DecodeCost

__all__ = ["DecodePool", "Decoder"]

log = logging.getLogger(__name__)

Decoder = Callable[..., np.ndarray]
"""``decoder(data, *args) -> uint8 array``, a module-level function (run in a worker)."""

_READY = b"ready"
_MAX_HEADER = 8192
_SLUG = re.compile(r"^[a-z0-9_]{1,64}$")


def _context() -> BaseContext:
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


def _serve(conn: Connection, preload: tuple[str, ...]) -> None:
    """A worker: decode requests from ``conn`` until the parent closes it."""
    # Ctrl-C in a terminal signals the whole process group: the parent decides for us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for module in preload:
        importlib.import_module(module)
    conn.send_bytes(_READY)
    while True:
        try:
            decoder, args = conn.recv()
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the parent closed the pipe, or is gone
        try:
            result = np.ascontiguousarray(decoder(data, *args), dtype=np.uint8)
        except EdgeLoopError as exc:
            conn.send_bytes(_header(ok=False, reason=exc.reason, message=exc.message))
            continue
        except Exception as exc:  # a decoder's own error: the image is refused, not the worker
            message = f"{type(exc).__name__}: {exc}"
            conn.send_bytes(_header(ok=False, reason="image_decode_failed", message=message))
            continue
        conn.send_bytes(_header(ok=True, shape=list(result.shape)))
        conn.send_bytes(result.reshape(-1).data)


def _header(**fields: Any) -> bytes:
    if "message" in fields:
        fields["message"] = str(fields["message"])[:1000]
    return json.dumps(fields).encode()


class _Slot:
    """One worker place: its process and pipe, or none while it is (re)started."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: BaseProcess | None = None
        self.conn: Connection | None = None


class _Overrun(Exception):
    pass


class DecodePool:
    """Decodes in ``workers`` processes, each image within ``budget_s``; thread-safe."""

    def __init__(
        self,
        workers: int = 2,
        *,
        budget_s: float = 1.5,
        isolate_cost: int = DEFAULT_ISOLATE_COST,
        max_result_bytes: int = 3 * 4_000_000,
        preload: Sequence[str] = (),
        name: str = "decode",
        start_timeout_s: float = 60.0,
    ) -> None:
        if workers < 1 or budget_s <= 0:
            raise ValueError("a decode pool needs at least one worker and a positive budget")
        self.budget_s = budget_s
        self.isolate_cost = isolate_cost
        self.max_result_bytes = max_result_bytes
        self.name = name
        self.start_timeout_s = start_timeout_s
        self._preload = ("shared.decode_pool", *preload)
        self._context = _context()
        self._slots = [_Slot(i) for i in range(workers)]
        self._idle = list(self._slots)
        self._cond = threading.Condition()
        self._closed = False
        self._restarts: set[threading.Thread] = set()
        self.decoded = 0  # images decoded here (counts, for tests and metrics)
        self.timeouts = 0
        self.crashes = 0

    # --- lifecycle ------------------------------------------------------------

    def start(self) -> DecodePool:
        """Start every worker now (else each starts with its first image, outside its budget)."""
        for slot in list(self._slots):
            with self._cond:
                if self._closed or slot not in self._idle:
                    continue
                self._idle.remove(slot)
            try:
                if slot.process is None:
                    self._start(slot)
            finally:
                self._release(slot)
        return self

    def close(self) -> None:
        """Stop every worker: idle ones exit on their closed pipe, busy ones are killed."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            idle = list(self._idle)
            self._idle.clear()
            self._cond.notify_all()
        for slot in self._slots:
            if slot in idle:
                self._stop(slot, graceful=True)
                continue
            process = slot.process
            if process is not None:
                process.kill()  # its caller sees the pipe close and stops the slot
        with self._cond:
            restarts = list(self._restarts)
        for thread in restarts:  # a replacement being started is stopped by its thread
            thread.join(self.start_timeout_s)

    def __enter__(self) -> DecodePool:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def pids(self) -> list[int | None]:
        """Each worker's process id (None where none runs now)."""
        return [slot.process.pid if slot.process else None for slot in self._slots]

    # --- decoding -------------------------------------------------------------

    def isolates(self, cost: DecodeCost) -> bool:
        """Whether an image of ``cost`` is decoded here rather than in-process."""
        return cost.isolate(self.isolate_cost)

    def run(self, decoder: Decoder, data: bytes, *args: Any) -> np.ndarray:
        """``decoder(data, *args)``'s uint8 array, decoded in a worker within the budget.

        Raises ImageDecodeTimeoutError past the budget, ImageDecodeFailedError when the
        worker dies, and the decoder's own EdgeLoopError as an ImageError of its reason.
        """
        for attempt in range(2):
            slot = self._acquire()
            handed_off = False
            try:
                if slot.process is None:
                    self._start(slot)
                process = slot.process
                assert process is not None
                try:
                    return self._call(slot, decoder, data, args)
                except _Overrun:
                    self._count("timeouts")
                    log.warning(
                        "%s: decoder process %s ran past its budget of %.0f ms; killed",
                        self.name,
                        process.pid,
                        self.budget_s * 1000,
                    )
                    handed_off = self._replace(slot)
                    raise ImageDecodeTimeoutError(
                        "decoding the image took longer than its budget of"
                        f" {self.budget_s * 1000:.0f} ms"
                    ) from None
                except _Died as died:
                    self._count("crashes")
                    handed_off = self._replace(slot)
                    log.warning(
                        "%s: decoder process %s failed (%s, exit code %s)",
                        self.name,
                        process.pid,
                        died,
                        process.exitcode,
                    )
                    raise ImageDecodeFailedError(
                        f"the image's decoder process failed (exit code {process.exitcode})"
                    ) from None
                except _IdleWorkerLost:
                    self._stop(slot, graceful=False)
                    if attempt:
                        raise ImageDecodeFailedError(
                            "the image's decoder process could not take it"
                        ) from None
            finally:
                if not handed_off:
                    self._release(slot)
        raise AssertionError("unreachable")  # pragma: no cover

    def _call(
        self, slot: _Slot, decoder: Decoder, data: bytes, args: tuple[Any, ...]
    ) -> np.ndarray:
        conn = slot.conn
        assert conn is not None
        deadline = time.monotonic() + self.budget_s
        try:
            conn.send((decoder, args))
        except OSError:  # it died while idle, before it saw this image
            raise _IdleWorkerLost from None
        try:
            conn.send_bytes(data)
            header = self._header(conn, deadline)
            if not header.get("ok"):
                reason = str(header.get("reason", ""))
                message = str(header.get("message", ""))[:1000]
                if reason == ImageDecodeFailedError.reason:
                    raise ImageDecodeFailedError(message)
                raise ImageError(message, reason=reason if _SLUG.match(reason) else None)
            shape = tuple(int(n) for n in header["shape"])
            if len(shape) > 3 or min(shape, default=0) < 0:
                raise _Died(f"a result of shape {shape}")
            size = int(np.prod(shape, dtype=np.int64))
            if size > self.max_result_bytes:
                raise _Died(f"a result of {size} bytes, over {self.max_result_bytes}")
            out = np.empty(shape, np.uint8)
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise _Overrun
            received = conn.recv_bytes_into(out.reshape(-1))
            if received != size:
                raise _Died(f"{received} bytes for a result of {size}")
        except (EOFError, OSError, BufferTooShort, ValueError, KeyError, TypeError) as exc:
            raise _Died(repr(exc)) from None
        self._count("decoded")
        return out

    def _count(self, name: str) -> None:
        with self._cond:
            setattr(self, name, getattr(self, name) + 1)

    @staticmethod
    def _header(conn: Connection, deadline: float) -> dict[str, Any]:
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise _Overrun
        header = json.loads(conn.recv_bytes(_MAX_HEADER))
        if not isinstance(header, dict):
            raise _Died("a header that is not an object")
        return header

    # --- workers --------------------------------------------------------------

    def _acquire(self) -> _Slot:
        with self._cond:
            while not self._idle and not self._closed:
                self._cond.wait()
            if self._closed:
                raise ImageDecodeFailedError(f"the {self.name} pool is closed")
            return self._idle.pop()

    def _release(self, slot: _Slot) -> None:
        with self._cond:
            if not self._closed:
                self._idle.append(slot)
                self._cond.notify()
                return
        self._stop(slot, graceful=False)

    def _start(self, slot: _Slot) -> None:
        """Start ``slot``'s worker and wait until it has imported what it needs."""
        if self._context.get_start_method() == "forkserver":
            # Takes effect where this process starts its forkserver: the workers then
            # fork with these modules (and the main script, which a worker would
            # otherwise import again) loaded, so a replacement starts in milliseconds.
            self._context.set_forkserver_preload(["__main__", *self._preload])
        parent, child = self._context.Pipe()
        process = self._context.Process(  # type: ignore[attr-defined]
            target=_serve,
            args=(child, self._preload),
            name=f"{self.name}-{slot.index}",
            daemon=True,
        )
        process.start()
        child.close()
        slot.process, slot.conn = process, parent
        try:
            ready = parent.poll(self.start_timeout_s) and parent.recv_bytes(16) == _READY
        except (EOFError, OSError):
            ready = False
        if not ready:
            self._stop(slot, graceful=False)
            raise ImageDecodeFailedError(f"a {self.name} worker process did not start")

    def _replace(self, slot: _Slot) -> bool:
        """Stop ``slot``'s worker; True when a thread starts the next and hands the slot back."""
        self._stop(slot, graceful=False)
        with self._cond:
            if self._closed:
                return False
            thread = threading.Thread(
                target=self._restart, args=(slot,), name=f"{self.name}-restart", daemon=True
            )
            self._restarts.add(thread)
        thread.start()
        return True

    def _restart(self, slot: _Slot) -> None:
        try:
            if not self._closed:
                self._start(slot)
        except ImageDecodeFailedError as exc:
            if not self._closed:  # else stopped on purpose
                log.warning("%s: %s; starting one with the next image", self.name, exc)
        finally:
            self._release(slot)
            with self._cond:
                self._restarts.discard(threading.current_thread())

    def _stop(self, slot: _Slot, *, graceful: bool) -> None:
        process, conn = slot.process, slot.conn
        slot.process, slot.conn = None, None
        if conn is not None:
            conn.close()  # an idle worker exits on the closed pipe
        if process is None:
            return
        if graceful:
            process.join(2.0)
        if process.exitcode is None:
            process.kill()
        process.join(10.0)


class _IdleWorkerLost(Exception):
    pass


class _Died(Exception):
    """The worker died, or answered what no decoder returns: it cannot be trusted further."""
