"""BufferedSocket: chunked reads, gathered writes, order kept when the kernel pushes back."""

from __future__ import annotations

import select
import socket
import threading
from typing import Any

import pytest

from shared.mqtt_socket import READ_CHUNK, BufferedSocket


class CountingSocket:
    """A socket that counts the calls reaching it; ``take`` bounds what one send takes."""

    def __init__(self, sock: socket.socket, take: int | None = None) -> None:
        self.sock = sock
        self.take = take
        self.recvs = 0
        self.sends: list[bytes] = []
        self.fail: OSError | None = None

    def recv(self, size: int) -> bytes:
        self.recvs += 1
        return self.sock.recv(size)

    def send(self, data: Any) -> int:
        if self.fail is not None:
            raise self.fail
        if self.take == 0:
            raise BlockingIOError
        chunk = bytes(data)[: self.take] if self.take is not None else bytes(data)
        self.sends.append(chunk)
        return self.sock.send(chunk)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def pair() -> Any:
    a, b = socket.socketpair()
    a.setblocking(False)
    yield a, b
    a.close()
    b.close()


def test_packets_in_one_chunk_are_read_with_one_call(pair: Any) -> None:
    a, b = pair
    inner = CountingSocket(a)
    sock = BufferedSocket(inner)
    b.sendall(b"\x40\x02\x00\x01" * 50)  # fifty PUBACKs
    got = b""
    while len(got) < 200:
        got += sock.recv(1) + sock.recv(1) + sock.recv(2)
    assert got == b"\x40\x02\x00\x01" * 50
    assert inner.recvs == 1
    assert sock.pending() == 0
    with pytest.raises(BlockingIOError):
        sock.recv(1)


def test_a_packet_across_chunks_and_the_end_of_the_stream(pair: Any) -> None:
    a, b = pair
    sock = BufferedSocket(a)
    b.sendall(b"abc")
    assert sock.recv(1) == b"a"
    assert sock.pending() == 2
    b.sendall(b"defg")
    assert sock.recv(5) == b"bcdef"  # what was left, then the kernel's next bytes
    assert sock.recv(1) == b"g"
    b.close()
    assert sock.recv(1) == b""


def test_a_large_body_is_read_whole(pair: Any) -> None:
    a, b = pair
    sock = BufferedSocket(a)
    body = bytes(range(256)) * (READ_CHUNK // 100)  # longer than a chunk
    sender = threading.Thread(target=b.sendall, args=(body,))
    sender.start()
    got = b""
    while len(got) < len(body):
        select.select([sock], [], [])
        got += sock.recv(len(body) - len(got))
    sender.join()
    assert got == body


def test_writes_held_together_go_out_as_one_send(pair: Any) -> None:
    a, b = pair
    inner = CountingSocket(a)
    sock = BufferedSocket(inner)
    with sock.held():
        for i in range(20):
            assert sock.send(bytes([i]) * 4) == 4
        assert inner.sends == []
    assert len(inner.sends) == 1
    assert b.recv(100) == b"".join(bytes([i]) * 4 for i in range(20))


def test_what_the_kernel_did_not_take_stays_ahead_of_later_writes(pair: Any) -> None:
    a, b = pair
    inner = CountingSocket(a, take=3)
    sock = BufferedSocket(inner)
    inner.take = 0  # the kernel takes nothing for now
    with sock.held():
        sock.send(b"first-")
    assert sock.unsent
    with pytest.raises(BlockingIOError):  # paho keeps its packet and tries again later
        sock.send(b"second")
    inner.take = 3
    sock.flush()
    assert not sock.unsent
    assert sock.send(b"second") == 3
    assert b.recv(100) == b"first-sec"


def test_a_write_error_while_flushing_reaches_the_next_call(pair: Any) -> None:
    a, _b = pair
    inner = CountingSocket(a)
    sock = BufferedSocket(inner)
    inner.fail = BrokenPipeError("gone")
    with sock.held():
        sock.send(b"x")
    with pytest.raises(BrokenPipeError):
        sock.send(b"y")
    with pytest.raises(BrokenPipeError):
        sock.recv(1)


def test_a_close_inside_a_pass_sends_what_was_gathered(pair: Any) -> None:
    """paho closes its socket right after writing a DISCONNECT, or when it reads one."""
    a, b = pair
    sock = BufferedSocket(a)
    with sock.held():
        sock.send(b"bye")
        sock.close()
    assert b.recv(10) == b"bye"
    assert a.fileno() == -1
