"""Frame uploads over the local HTTP API: what both upload paths share.

``POST /v1/frames`` is the hot path. An upload with a declared length goes to
``FrameRoute``, which the server's protocol calls with the whole body
(``shared.http_server.RawRoute``: no ASGI task, scope or messages, the answer
written in one piece); any other upload (a chunked body, say) reaches
``post_frame`` (a raw JPEG/PNG body, read without FastAPI's stack) or the FastAPI
route (multipart). Either way ``Frames`` holds the limits, the rate limit and
the refusals. Where several inference threads infer at once, the event loop checks
an upload's header and queues its bytes for the micro-batcher, and the inference
thread that takes the batch decodes its frames (OpenCV, GIL released) before
inferring them: no hand-over per frame, and a thread busy either way. Otherwise,
and for an image whose decode is isolated (``DecodePool``), one job on the decode
pool checks, decodes (overlapping inference) and queues the frame. The answers come
back to the event loop as ready-made JSON bytes through ``_Outbox``, with one
cross-thread wake-up for all the answers of a batch, and one timer for the timeouts
of all waiting uploads.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import queue
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile
from starlette.types import Receive, Send

from edge_agent.batcher import WorkerPool
from edge_agent.imaging import ACCEPTED, ACCEPTED_CONTENT_TYPES, ImageRejected
from edge_agent.sources import RateLimiter
from shared.errors import EdgeLoopError
from shared.http_server import RawResponder

if TYPE_CHECKING:
    from edge_agent.agent import Agent
    from edge_agent.intake import FrameResult, Reply

__all__ = [
    "ACCEPTED_TYPES",
    "HEADER_SLACK",
    "RAW_TYPES",
    "SOURCE",
    "FrameRoute",
    "Frames",
    "file_from_form",
    "media_type",
    "post_frame",
    "refuse",
]

log = logging.getLogger(__name__)

SOURCE = "http"
ACCEPTED_TYPES = (*ACCEPTED_CONTENT_TYPES, "multipart/form-data")
RAW_TYPES = tuple(t.encode("ascii") for t in ACCEPTED_CONTENT_TYPES)
HEADER_SLACK = 65536  # multipart framing around the image


def media_type(content_type: bytes) -> bytes:
    """A Content-Type header's media type, lower-cased (``image/jpeg; q=1`` -> ``image/jpeg``)."""
    return content_type.split(b";", 1)[0].strip().lower()


def _refusal(message: str, reason: str) -> dict[str, str]:
    return {
        "detail": message,
        "reason": reason,
        "accepted": ACCEPTED + ", or multipart/form-data with one file part",
    }


def refuse(status: int, message: str, reason: str) -> JSONResponse:
    return JSONResponse(_refusal(message, reason), status_code=status)


class _Waiter(Protocol):
    """What waits for an upload's answer: an asyncio future, or a ``_RawWaiter``."""

    def done(self) -> bool: ...

    def set_result(self, result: bytes) -> None: ...

    def set_exception(self, exception: BaseException) -> None: ...


class Frames:
    """What both upload paths share: limits, the rate limit, the decode pool, refusals."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        settings = agent.settings
        self.max_bytes = settings.max_image_bytes
        self.timeout_s = settings.infer_timeout_s
        self.max_fps = settings.http_max_fps
        self.limiter = RateLimiter(self.max_fps) if self.max_fps else None
        self.pool = WorkerPool(settings.http_decode_threads, name="http-decode")
        self.inline = agent.decodes_uploads_inline
        self._outboxes: dict[asyncio.AbstractEventLoop, _Outbox] = {}
        self._outboxes_lock = threading.Lock()

    def count_refusal(self, reason: str) -> None:
        self.agent.telemetry.bad_input.labels(SOURCE, reason).inc()

    def failure(self, exc: BaseException) -> tuple[int, dict[str, str]]:
        """Status and body for an upload that got no answer (a refused image counted)."""
        if isinstance(exc, ImageRejected):
            self.count_refusal(exc.reason)
        return _failure(exc)

    def over_declared_size(self, declared: bytes | str | None) -> str | None:
        """A refusal message when the declared Content-Length is over the limit."""
        if declared is None or not declared.isdigit():
            return None
        size = int(declared)
        if size <= self.max_bytes + HEADER_SLACK:
            return None
        return f"request of {size} bytes is over the limit of {self.max_bytes} image bytes"

    def rate_refusal(self) -> tuple[dict[str, str], int] | None:
        """(refusal body, Retry-After seconds), counted, when this upload is over the
        HTTP source's rate; None (and a frame taken from the rate) otherwise."""
        if self.limiter is None or self.limiter.try_take():
            return None
        self.count_refusal("rate_limited")
        wait = self.limiter.wait_time()
        why = (
            f"frame rate over this source's limit of {self.max_fps:g} frames/s;"
            f" retry in {wait:.2f} s"
        )
        return _refusal(why, "rate_limited"), max(1, math.ceil(wait))

    def answer(self, body: bytes, loop: asyncio.AbstractEventLoop) -> asyncio.Future[bytes]:
        """Decode and queue ``body``; the asyncio future resolves with the answer's JSON.

        Called on ``loop``. The future raises TimeoutError after ``infer_timeout_s``.
        """
        waiter: asyncio.Future[bytes] = loop.create_future()
        self.answer_to(body, loop, waiter)
        return waiter

    def answer_to(self, body: bytes, loop: asyncio.AbstractEventLoop, waiter: _Waiter) -> None:
        """``answer`` into ``waiter`` (raises RuntimeError once the decode pool is shut down)."""
        outbox = self._outbox(loop)
        outbox.watch(waiter, self.timeout_s)
        if self.inline:  # queued undecoded, never blocking the loop (a full queue: 503)
            try:
                reply = self._reply(outbox, waiter)
                if self.agent.queue_undecoded(body, reply, source=SOURCE, block=False):
                    return
            except BaseException as exc:
                outbox.put(waiter, None, exc)
                return
        self.pool.submit(self._decode_and_queue, body, outbox, waiter)

    def _outbox(self, loop: asyncio.AbstractEventLoop) -> _Outbox:
        outbox = self._outboxes.get(loop)
        if outbox is None:
            with self._outboxes_lock:  # one per event loop serving the app (usually one)
                self._outboxes = {
                    **{k: v for k, v in self._outboxes.items() if not k.is_closed()},
                    loop: _Outbox(loop),
                }
                outbox = self._outboxes[loop]
        return outbox

    def _decode_and_queue(self, body: bytes, outbox: _Outbox, waiter: _Waiter) -> None:
        # On a decode thread: decoding releases the GIL, so several run beside inference.
        reply = self._reply(outbox, waiter)
        try:
            frame = self.agent.decode_for_model(body)
            self.agent.answer_frame(frame, reply, source=SOURCE)
        except BaseException as exc:
            outbox.put(waiter, None, exc)

    @staticmethod
    def _reply(outbox: _Outbox, waiter: _Waiter) -> Reply:
        def reply(result: FrameResult | None, error: BaseException | None) -> None:
            # On an agent thread, for a whole batch in a row: the JSON is made here, off
            # the event loop, and the outbox wakes the loop once for the lot. orjson: a
            # detector's answer (a dozen boxes) in about 2 us against json's 22, with the
            # interpreter lock held either way; a NaN would be null, never bare NaN.
            if error is None:
                assert result is not None
                try:
                    outbox.put(waiter, _json(result.as_dict()), None)
                    return
                except BaseException as exc:
                    error = exc
            outbox.put(waiter, None, error)

        return reply

    def close(self) -> None:
        self.pool.shutdown(wait=False)


class _Outbox:
    """Answers on their way back to one event loop: one wake-up for all that gather.

    Agent threads ``put`` answers; the first one into an empty outbox schedules a
    drain on the loop, and the others of the same batch ride along with it.

    It also times the waiters out: the timeout is the same for every upload, so the
    deadlines come in order, and one timer for the oldest waiter replaces a timer
    (scheduled, then cancelled) per request.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[_Waiter, bytes | None, BaseException | None]] = []
        self._deadlines: collections.deque[tuple[float, _Waiter]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, waiter: _Waiter, timeout_s: float) -> None:
        """On the loop: fail ``waiter`` with TimeoutError unless answered within ``timeout_s``."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][1].done():  # answered: forget them (and their bytes)
            deadlines.popleft()
        deadline = self.loop.time() + timeout_s
        if deadlines and deadline < deadlines[-1][0]:
            deadline = deadlines[-1][0]  # the clock is monotonic; keep the order anyway
        deadlines.append((deadline, waiter))
        if self._timer is None:
            self._timer = self.loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        deadlines = self._deadlines
        now = self.loop.time()
        while deadlines and (deadlines[0][1].done() or deadlines[0][0] <= now):
            _, waiter = deadlines.popleft()
            if not waiter.done():
                waiter.set_exception(TimeoutError("no answer in time"))
        if deadlines:
            self._timer = self.loop.call_at(deadlines[0][0], self._expire)

    def put(self, waiter: _Waiter, data: bytes | None, error: BaseException | None) -> None:
        """Resolve ``waiter`` on its loop with ``data`` (or raise ``error`` there)."""
        with self._lock:
            self._items.append((waiter, data, error))
            if len(self._items) > 1:
                return  # a drain is already scheduled
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the server's loop is closed, so nobody is waiting any more
            with self._lock:
                self._items.clear()

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for waiter, data, error in items:
            if waiter.done():  # timed out meanwhile
                continue
            if error is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(data)  # type: ignore[arg-type]


class FrameRoute:
    """``POST /v1/frames`` with a raw image body and a declared length, answered by the
    server's protocol (``shared.http_server.RawRoute``) with the same limits, rate
    limit, decoding, answers and refusals as ``post_frame``."""

    path = b"/v1/frames"

    def __init__(self, frames: Frames) -> None:
        self.frames = frames
        self.max_bytes = frames.max_bytes + HEADER_SLACK  # over it: the ASGI path's 413

    def accepts(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        content_types = [value for name, value in headers if name == b"content-type"]
        if len(content_types) != 1:
            return False  # none, or an ambiguous pair: the ASGI path says what is accepted
        return media_type(content_types[0]) in RAW_TYPES

    def handle(self, body: bytes, respond: RawResponder) -> None:
        frames = self.frames
        limited = frames.rate_refusal()
        if limited is not None:
            refusal, retry_after = limited
            respond(429, _json(refusal), [(b"retry-after", b"%d" % retry_after)])
            return
        waiter = _RawWaiter(frames, respond)
        try:
            frames.answer_to(body, asyncio.get_running_loop(), waiter)
        except Exception as exc:  # the decode pool is shut down: the agent is stopping
            waiter.set_exception(exc)


class _RawWaiter:
    """Waits for one ``FrameRoute`` upload's answer and has the protocol write it (on
    the loop: the outbox drains there)."""

    __slots__ = ("_done", "frames", "respond")

    def __init__(self, frames: Frames, respond: RawResponder) -> None:
        self.frames = frames
        self.respond = respond
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, result: bytes) -> None:
        self._answer(200, result)

    def set_exception(self, exception: BaseException) -> None:
        status, refusal = self.frames.failure(exception)
        self._answer(status, _json(refusal))

    def _answer(self, status: int, body: bytes) -> None:
        if self._done:
            return
        self._done = True
        try:
            self.respond(status, body, ())
        except Exception:  # one connection's failure must not stop the others' answers
            log.exception("could not write an upload's answer")


def _failure(exc: BaseException) -> tuple[int, dict[str, str]]:
    """Status and body for an upload that got no answer."""
    if isinstance(exc, ImageRejected):
        return exc.status, _refusal(exc.message, exc.reason)
    if isinstance(exc, TimeoutError):
        return 503, _refusal("inference timed out; the agent is overloaded", "timeout")
    if isinstance(exc, queue.Full):
        return 503, _refusal("the inference queue is full; the agent is overloaded", "overloaded")
    if isinstance(exc, EdgeLoopError):
        return 503, _refusal(f"inference failed: {exc}", exc.reason)
    return 503, _refusal(f"inference failed: {exc}", "error")


async def post_frame(frames: Frames, declared: bytes | None, receive: Receive, send: Send) -> None:
    too_large = frames.over_declared_size(declared)
    if too_large is not None:
        frames.count_refusal("too_large")
        await _send_json(send, 413, _refusal(too_large, "too_large"))
        return
    limited = frames.rate_refusal()
    if limited is not None:
        refusal, retry_after = limited
        await _send_json(send, 429, refusal, retry_after=retry_after)
        return
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > frames.max_bytes + HEADER_SLACK:  # chunked, with no declared length
            frames.count_refusal("too_large")
            over = f"request body over the limit of {frames.max_bytes} image bytes"
            await _send_json(send, 413, _refusal(over, "too_large"))
            return
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    try:
        data = await frames.answer(body, asyncio.get_running_loop())
    except Exception as exc:
        status, refusal = frames.failure(exc)
        await _send_json(send, status, refusal)
        return
    await _send(send, 200, data)


def _json(body: dict[str, Any]) -> bytes:
    """``body`` as JSON (numpy numbers as numbers; NaN and infinities as null)."""
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


async def _send_json(
    send: Send, status: int, body: dict[str, Any], *, retry_after: int | None = None
) -> None:
    extra = [(b"retry-after", str(retry_after).encode())] if retry_after is not None else []
    await _send(send, status, _json(body), extra)


async def _send(
    send: Send, status: int, data: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def file_from_form(request: Request, max_bytes: int) -> bytes | JSONResponse:
    try:
        form = await request.form(max_files=1, max_fields=8, max_part_size=max_bytes + 1)
    except Exception as exc:  # starlette raises several kinds for a malformed body
        return refuse(400, f"malformed multipart body: {exc}", "multipart")
    try:
        files = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
        if len(files) != 1:
            return refuse(
                400, f"multipart body has {len(files)} file parts, expected one", "multipart"
            )
        data = await files[0].read(max_bytes + 1)
        return data
    finally:
        await form.close()
