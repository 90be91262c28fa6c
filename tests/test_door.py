"""The agent's door (unicron/control/door.py): every connection of a node starting its
processes gets in, whatever a slow accept thread, a stalled peer or a flood does."""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection

import pytest

from unicron.control import door as D

KEY = b"k" * 16


def _connect_all(address: tuple[str, int], n: int) -> list[int]:
    """``n`` clients at once, as a node's zygote and workers do; the ones that got in."""
    connected: list[int] = []

    def connect(i: int) -> None:
        Client(address, authkey=KEY)
        connected.append(i)

    clients = [threading.Thread(target=connect, args=(i,), daemon=True) for i in range(n)]
    for t in clients:
        t.start()
    deadline = time.monotonic() + 60  # ~1 s here; far more than 10x of headroom
    for t in clients:
        t.join(max(deadline - time.monotonic(), 0))
    return sorted(connected)


def _wait_for(done: Callable[[], bool], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.fixture
def door(request: pytest.FixtureRequest) -> Iterator[tuple[D.Door, list[Connection]]]:
    admitted: list[Connection] = []
    d = D.Door(KEY, admitted.append, **getattr(request, "param", {}))
    d.open()
    yield d, admitted
    d.close()


def _challenges_done() -> bool:
    return not any(t.name == "agent-handshake" for t in threading.enumerate())


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _ends(sock: socket.socket, within_s: float) -> bool:
    """Whether the door closes ``sock`` (after its challenge) within ``within_s``."""
    sock.settimeout(within_s)
    try:
        while sock.recv(1024):
            pass
    except TimeoutError:
        return False
    return True


def test_a_starved_accept_thread_loses_no_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``multiprocessing``'s backlog of 1 and the accept thread starved, the kernel dropped
    the overflow's last ACK: a client whose connect had succeeded waited for ever for its
    challenge (a worker never ready; found by ``make test-loaded``). 12 clients against an
    acceptor that takes 0.1 s per connection all get in."""

    class Starved(threading.Thread):
        def start(self) -> None:
            if self.name == "agent-handshake":  # on the accept thread, after each accept
                time.sleep(0.1)
            super().start()

    monkeypatch.setattr(D.threading, "Thread", Starved)
    admitted: list[Connection] = []
    d = D.Door(KEY, admitted.append)
    d.open()
    try:
        assert _connect_all(d.address, 12) == list(range(12))
    finally:
        d.close()


@pytest.mark.parametrize("door", [{"handshake_s": 0.5}], indirect=True)
def test_a_stalled_or_trickling_peer_holds_up_nobody_and_is_ended_at_the_bound(
    door: tuple[D.Door, list[Connection]], caplog: pytest.LogCaptureFixture
) -> None:
    """A process stopped between its connect and its answer (the cluster soak's SIGSTOP of a
    worker just restarted) held every later connection of its node on ``multiprocessing``'s
    accept thread. Here the others get in at once, and it is ended after the bound, as is a
    peer that sends a byte now and then (a per-read timeout would let it in for hours)."""
    d, admitted = door
    stalled = socket.create_connection(d.address)  # connects, never answers
    trickling = socket.create_connection(d.address)
    try:
        began = time.monotonic()
        assert _connect_all(d.address, 4) == list(range(4))
        _wait_for(lambda: len(admitted) == 4)  # (the door reads their last word after them)
        trickling.settimeout(1)
        trickling.recv(1024)  # its challenge
        trickling.send(b"\x00\x00\x00\x80")  # an answer of 128 bytes is coming ...
        ended = False
        while not ended and time.monotonic() - began < 20:
            try:
                trickling.send(b"a")  # ... a byte every 0.1 s: each read well within any bound
                ended = _ends(trickling, 0.1)
            except OSError:  # reset by the door
                ended = True
        assert ended and time.monotonic() - began < 10  # 0.5-0.75 s here; not 13 s
        assert _ends(stalled, 10)
        assert len(admitted) == 4
        _wait_for(lambda: len(_warnings(caplog)) == 2)  # each said, as a stalled peer
        assert set(_warnings(caplog)) == {
            "ended a connection that did not prove the key within 0.5 s"
        }
    finally:
        stalled.close()
        trickling.close()


def test_a_flood_of_silent_connections_is_capped(
    monkeypatch: pytest.MonkeyPatch, door: tuple[D.Door, list[Connection]]
) -> None:
    """A silent connection costs a thread until its bound: beyond ``MAX_PENDING`` under way, a
    new one is closed at once, and the door serves again once they end."""
    monkeypatch.setattr(D, "MAX_PENDING", 2)
    d, _ = door
    silent = [socket.create_connection(d.address) for _ in range(2)]
    try:
        _wait_for(lambda: len(d._pending) == 2)
        extra = socket.create_connection(d.address)
        assert _ends(extra, 10)  # closed unanswered
        extra.close()
        for s in silent:
            s.close()  # their challenges fail: room again
        _wait_for(lambda: not d._pending)
        assert _connect_all(d.address, 2) == [0, 1]
    finally:
        for s in silent:
            s.close()


def test_a_wrong_key_is_refused_and_an_admitted_connection_is_plainly_blocking(
    door: tuple[D.Door, list[Connection]], caplog: pytest.LogCaptureFixture
) -> None:
    d, admitted = door
    with pytest.raises(AuthenticationError):
        Client(d.address, authkey=b"x" * 16)
    _wait_for(lambda: bool(_warnings(caplog)))
    assert _warnings(caplog) == ["rejected a connection: digest received was wrong"]
    default = socket.getdefaulttimeout()
    socket.setdefaulttimeout(5)  # a process-wide default must not make it non-blocking
    try:
        client = Client(d.address, authkey=KEY)
        _wait_for(lambda: len(admitted) == 1)
    finally:
        socket.setdefaulttimeout(default)
    conn = admitted[0]
    assert os.get_blocking(conn.fileno())
    assert not conn.poll(0.3)  # nothing sent: no error, no end of stream
    client.send(b"x" * 1_000_000)
    assert len(conn.recv()) == 1_000_000
    conn.send("hello")
    assert client.recv() == "hello"


def test_nothing_is_admitted_after_close(caplog: pytest.LogCaptureFixture) -> None:
    """... and the challenges that the close ends, or whose peer goes away (a process killed
    as it connected), are no warning: one reached the terminal of a run refused with its
    one-line error, as a second line (``make test-loaded``, stop 69)."""
    admitted: list[Connection] = []
    d = D.Door(KEY, admitted.append)
    d.open()
    gone = socket.create_connection(d.address)
    _wait_for(lambda: len(d._pending) == 1)
    gone.close()  # the peer goes away in the middle of its challenge
    _wait_for(lambda: not d._pending and _challenges_done())
    stalled = socket.create_connection(d.address)
    _wait_for(lambda: len(d._pending) == 1)
    d.close()
    assert _ends(stalled, 10) and not d._pending and not admitted
    stalled.close()
    _wait_for(_challenges_done)
    assert _warnings(caplog) == []


def test_settle_waits_for_a_connection_in_the_backlog_and_its_challenge() -> None:
    """A worker that dies at once may have sent its error on a connection the door has not
    taken yet: :meth:`Door.settle` returns once it is admitted (here the accept thread starts
    only 0.3 s after the connect, as a starved one would), and gives up on a stalled peer."""
    admitted: list[Connection] = []
    d = D.Door(KEY, admitted.append)
    try:
        assert d.settle(0.0)  # a quiet door: at once
        client = threading.Thread(target=Client, args=(d.address,), kwargs={"authkey": KEY})
        client.start()
        _wait_for(lambda: bool(select.select([d._sock], [], [], 0)[0]))  # in the backlog
        threading.Timer(0.3, d.open).start()
        assert d.settle(60.0) and len(admitted) == 1
        client.join(10)
        stalled = socket.create_connection(d.address)  # connects, never answers
        t0 = time.monotonic()
        assert not d.settle(0.3)
        assert 0.3 <= time.monotonic() - t0 < 3.0
        stalled.close()
    finally:
        d.close()
