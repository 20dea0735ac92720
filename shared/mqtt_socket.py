"""The socket under an ``MqttConnection``'s paho client: read in chunks, written in bursts.

paho reads a packet in several ``recv`` calls (its command byte, each byte of its
remaining length, then its body) and writes every packet with a ``send`` of its own:
by its code, four or five calls to take in a 20 KB sample and one more to
acknowledge it, three to read a PUBACK. On loopback a ``send`` also runs the
receiving side's TCP path in the sender's time.

:class:`BufferedSocket` stands in for paho's socket (``client._sock``, which paho
reads and writes through ``recv`` and ``send`` only). Reads take up to
``READ_CHUNK`` bytes from the kernel at once and hand paho what it asks for from
them; :meth:`pending` says what is left, and the io loop reads that before it
selects again (as it does for TLS records already decrypted). Inside :meth:`held`,
writes are gathered and go out as one ``send`` when it ends; what the kernel does
not take then stays in order ahead of every later write (:attr:`unsent`, written by
:meth:`flush` once the socket is writable). Outside :meth:`held`, a write goes
straight through once nothing is waiting ahead of it. A write error met while
flushing is raised by the next ``send`` or ``recv``, where paho reports a lost
connection as it would have from its own call.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt

__all__ = ["READ_CHUNK", "BufferedSocket", "buffered"]

READ_CHUNK = 256 * 1024  # bytes asked of the kernel per read

_WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class BufferedSocket:
    """A socket (plain, TLS or paho's websocket wrapper) read in chunks and written in bursts."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._in = b""
        self._at = 0
        self._gathered: list[bytes] = []
        self._held = False
        self._unsent = memoryview(b"")
        self._error: OSError | None = None

    # --- reading -------------------------------------------------------------------

    def recv(self, size: int) -> bytes:
        """Up to ``size`` bytes: from the chunk read last, else from a new chunk."""
        if self._error is not None:
            raise self._error
        have = len(self._in) - self._at
        if have >= size:
            start = self._at
            self._at = start + size
            return self._in[start : self._at]
        head = self._in[self._at :] if have else b""
        self._in, self._at = b"", 0
        try:
            data = self._sock.recv(max(size - have, READ_CHUNK))
        except _WOULD_BLOCK:
            if head:
                return head
            raise
        if head:
            data = head + data  # a packet across two chunks (or the end of the stream)
        if len(data) <= size:
            return data
        self._in, self._at = data, size
        return data[:size]

    def pending(self) -> int:
        """Bytes read and not yet handed out (here, and decrypted in a TLS socket)."""
        inner = getattr(self._sock, "pending", None)
        return len(self._in) - self._at + (inner() if inner is not None else 0)

    # --- writing -------------------------------------------------------------------

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Gather every write made inside; send them at once when it ends."""
        self._held = True
        try:
            yield
        finally:
            self._held = False
            self.flush()

    def send(self, data: bytes | bytearray | memoryview) -> int:
        if self._error is not None:
            raise self._error
        if self._held:
            self._gathered.append(bytes(data))
            return len(data)
        if self._unsent:
            self.flush()
            if self._error is not None:
                raise self._error
            if self._unsent:
                raise BlockingIOError("earlier writes are still waiting for the socket")
        return int(self._sock.send(data))

    @property
    def unsent(self) -> bool:
        """Whether written bytes wait for the socket to take them (select it for writing)."""
        return bool(self._unsent) or bool(self._gathered)

    def flush(self) -> None:
        """Send what was gathered and what waits, as far as the socket takes it now."""
        if self._gathered:
            waiting = [bytes(self._unsent)] if self._unsent else []
            self._unsent = memoryview(b"".join(waiting + self._gathered))
            self._gathered.clear()
        while self._unsent and self._error is None:
            try:
                sent = self._sock.send(self._unsent)
            except _WOULD_BLOCK:
                return
            except OSError as exc:
                self._error = exc
                return
            self._unsent = self._unsent[sent:]

    # --- the rest of a socket ------------------------------------------------------

    def fileno(self) -> int:
        return int(self._sock.fileno())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.flush()  # e.g. the DISCONNECT paho wrote just before closing
        self._sock.close()

    def __getattr__(self, name: str) -> Any:  # setblocking, setsockopt, getpeername...
        return getattr(self._sock, name)


def buffered(client: mqtt.Client) -> mqtt.Client:
    """``client``, connected, reading and writing through a :class:`BufferedSocket`
    (paho keeps its socket in ``_sock`` and calls only ``recv``, ``send``,
    ``pending``, ``fileno``, ``setblocking`` and ``close`` on it)."""
    sock = client.socket()
    if sock is not None and not isinstance(sock, BufferedSocket):
        client._sock = BufferedSocket(sock)
    return client
