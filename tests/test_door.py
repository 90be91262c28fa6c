"""The agent's door (unicron/control/door.py): every connection of a node starting its
processes gets in, whatever a slow accept thread or a stalled peer does."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection

import pytest

from unicron.control import door as D

KEY = b"k" * 16


def _connect_all(address: tuple[str, int], n: int, key: bytes = KEY) -> list[int]:
    """``n`` clients at once, as a node's zygote and workers do; the ones that got in."""
    connected: list[int] = []

    def connect(i: int) -> None:
        Client(address, authkey=key)
        connected.append(i)

    clients = [threading.Thread(target=connect, args=(i,), daemon=True) for i in range(n)]
    for t in clients:
        t.start()
    deadline = time.monotonic() + 60  # ~1 s here; far more than 10x of headroom
    for t in clients:
        t.join(max(deadline - time.monotonic(), 0))
    return sorted(connected)


def _wait_for(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.01)


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
    door = D.Door(KEY, admitted.append)
    door.open()
    try:
        assert _connect_all(door.address, 12) == list(range(12))
    finally:
        door.close()


def test_a_peer_stalled_in_its_challenge_holds_up_nobody_and_is_dropped() -> None:
    """A process stopped between its connect and its answer (the cluster soak's SIGSTOP of a
    worker just restarted) held every later connection of its node on ``multiprocessing``'s
    accept thread; here the others get in at once, and it is dropped after the bound."""
    admitted: list[Connection] = []
    door = D.Door(KEY, admitted.append, handshake_s=0.5)
    door.open()
    stalled = socket.create_connection(door.address)  # connects, never answers
    try:
        time.sleep(0.1)  # its challenge is under way
        assert _connect_all(door.address, 4) == list(range(4))
        _wait_for(lambda: len(admitted) == 4)  # (the door reads their last word after them)
        stalled.settimeout(10)
        stalled.recv(1024)  # the challenge
        assert stalled.recv(1024) == b""  # closed once the bound passed
    finally:
        stalled.close()
        door.close()


def test_a_wrong_key_is_refused_and_the_connections_admitted_still_talk() -> None:
    admitted: list[Connection] = []
    door = D.Door(KEY, admitted.append)
    door.open()
    try:
        with pytest.raises(AuthenticationError):
            Client(door.address, authkey=b"x" * 16)
        client = Client(door.address, authkey=KEY)
        _wait_for(lambda: len(admitted) == 1)
        admitted[0].send("hello")  # no timeout is left on the admitted connection
        assert client.recv() == "hello"
        client.send(b"x" * 1_000_000)
        assert len(admitted[0].recv()) == 1_000_000
    finally:
        door.close()
