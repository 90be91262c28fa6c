"""The agent's door: the socket its node's zygote and workers connect to, a key challenge per
connection, none able to hold up another.

The wire is ``multiprocessing.connection``'s (the processes connect with its ``Client`` and
both sides prove the node's key, :mod:`unicron.runtime.link`); :class:`Door` replaces its
``Listener`` on the agent's side for two reasons found beside CPU burners (``make
test-loaded``; ``bench/results/loaded-history.md``):

- its backlog is 1. A node's zygote and 8 workers connect at once; an accept thread that is
  starved takes them slower than they come, and the kernel drops the last ACK of those that
  overflow the queue: the client's ``connect`` has succeeded, and it waits for ever for the
  challenge of a connection that was never accepted (a worker never ready, its task started
  without its replica). :data:`BACKLOG` is the system's maximum.
- it runs each challenge on the accepting thread, one after the other, with no bound: a
  process stopped between its ``connect`` and its answer (the cluster soak's SIGSTOP of a
  worker just restarted) would hold every later connection of the node until it died. Each
  challenge here runs on a thread of its own, within :data:`HANDSHAKE_S`.

Who calls what: :class:`unicron.control.agent.Agent` makes one door per task and node, passes
its address to its processes, and gets each proven connection through ``admit`` (from the
door's threads: it queues it and rings its round).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Callable
from contextlib import suppress
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

log = logging.getLogger(__name__)

BACKLOG = socket.SOMAXCONN
"""connections the socket holds until the accept thread takes them (capped by the kernel's
``net.core.somaxconn``)"""
HANDSHAKE_S = 60.0
"""how long a connecting process has to answer the challenge: a bound on a stalled peer's
thread, not on the others, who do not wait for it"""


class Door:
    """A loopback socket on an ephemeral port (:attr:`address`) whose connections are handed to
    ``admit`` once they proved ``authkey`` (a connection that does not, or not within
    ``handshake_s``, is closed and logged). :meth:`open` starts its accept thread."""

    def __init__(
        self,
        authkey: bytes,
        admit: Callable[[Connection], None],
        *,
        handshake_s: float = HANDSHAKE_S,
    ) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=BACKLOG)
        host, port = self._sock.getsockname()[:2]
        self.address: tuple[str, int] = (host, port)
        self._key, self._admit, self._handshake_s = authkey, admit, handshake_s
        self._closed = threading.Event()

    def open(self) -> None:
        """Start accepting (a daemon thread, until :meth:`close`)."""
        threading.Thread(target=self._accept, daemon=True, name="agent-accept").start()

    def close(self) -> None:
        """Stop accepting; the connections already admitted are the caller's."""
        self._closed.set()
        with suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                log.warning("the agent's socket could not accept: %s", exc)  # EMFILE: wait
                self._closed.wait(0.1)
                continue
            threading.Thread(
                target=self._prove, args=(sock,), daemon=True, name="agent-handshake"
            ).start()

    def _prove(self, sock: socket.socket) -> None:
        """The challenge both ways, as ``multiprocessing``'s ``Listener`` runs it, bounded."""
        _bound(sock, self._handshake_s)
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self._key)
            answer_challenge(conn, self._key)
        except Exception as exc:  # a wrong key, a peer gone or stalled past the bound
            conn.close()
            log.warning("rejected a connection: %r", exc)
            return
        held = socket.socket(fileno=conn.fileno())  # the connection keeps the descriptor
        _bound(held, 0.0)
        held.detach()
        if self._closed.is_set():
            conn.close()
            return
        self._admit(conn)


def _bound(sock: socket.socket, seconds: float) -> None:
    """Reads and writes on ``sock``'s blocking descriptor fail after ``seconds`` (0: never);
    the kernel's timeouts, which ``Connection``'s plain reads and writes obey."""
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
