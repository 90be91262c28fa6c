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
  challenge here runs on a thread of its own; the accept thread ends one that is not done
  within :data:`HANDSHAKE_S`, and holds at most :data:`MAX_PENDING` at once (more are closed
  at once: a flood of silent connections costs no more than that many threads).

Who calls what: :class:`unicron.control.agent.Agent` makes one door per task and node, passes
its address to its processes, and gets each proven connection through ``admit`` (from the
door's threads: it queues it and rings its round). Before it reads a dead worker's last words
it lets the door :meth:`~Door.settle`: a worker that dies at once (a script that cannot
import) may have sent its error on a connection still in the backlog or its challenge when
the zygote's report of its exit is read.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

log = logging.getLogger(__name__)

BACKLOG = socket.SOMAXCONN
"""connections the socket holds until the accept thread takes them (capped by the kernel's
``net.core.somaxconn``)"""
HANDSHAKE_S = 60.0
"""how long a connecting process has to prove the key, from its accept: a bound on a stalled
peer's thread, not on the others, who do not wait for it"""
MAX_PENDING = 64
"""challenges under way at once; a connection beyond them is closed unanswered (a node's
zygote, workers and restarts need a handful)"""
REAP_S = 0.25
"""how often the accept thread, while challenges are under way, ends those past their bound
(with none under way it sleeps in ``accept``: an idle door costs no wake-ups)"""


class Door:
    """A loopback socket on an ephemeral port (:attr:`address`) whose connections are handed to
    ``admit`` once they proved ``authkey`` (a connection that does not, or not within
    ``handshake_s`` of its accept, is closed and logged). :meth:`open` starts its accept
    thread; ``admit`` is called from the challenges' threads, never after :meth:`close`."""

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
        self._lock = threading.Lock()
        self._pending: dict[socket.socket, float] = {}
        """each challenge under way: its socket and when its bound passes (monotonic)"""
        self._opened = False  # its accept thread started: that thread closes the socket

    def open(self) -> None:
        """Start accepting (a daemon thread, until :meth:`close`)."""
        with self._lock:
            self._opened = True
        threading.Thread(target=self._accept, daemon=True, name="agent-accept").start()

    def close(self) -> None:
        """Stop accepting and end the challenges under way; the connections already admitted
        are the caller's. The accept thread, woken by the shutdown, closes the socket as it
        ends (closed here, its poll could wait on a number the process has given to another
        descriptor)."""
        with self._lock:
            self._closed.set()
            pending, self._pending = list(self._pending), {}
            opened = self._opened
        for sock in pending:
            _end(sock)
        with suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread waiting in poll
        if not opened:
            self._sock.close()

    def _accept(self) -> None:
        """The accept thread: waits for a connection (``poll``; :meth:`close`'s shutdown wakes
        it), then takes it and records its challenge under the lock in one move, so that
        :meth:`settle` never sees a connection neither waiting nor under way."""
        try:
            waiting = select.poll()
            with self._lock:
                if self._closed.is_set():
                    return
                waiting.register(self._sock, select.POLLIN)
                self._sock.setblocking(False)
            while self._take(waiting):
                pass
        finally:
            self._sock.close()

    def _take(self, waiting: select.poll) -> bool:
        """Wait for one connection and start its challenge (False: the door is closed)."""
        self._reap(time.monotonic())
        # only this thread adds challenges: none under way, none to end meanwhile
        waiting.poll(REAP_S * 1000 if self._pending else None)
        with self._lock:
            if self._closed.is_set():
                return False
            try:
                sock, _ = self._sock.accept()
            except BlockingIOError:  # the bound's tick: nobody
                return True
            except OSError as exc:
                log.warning("the agent's socket could not accept: %s", exc)  # EMFILE: wait
                sock = None
            if sock is not None:  # (this thread's alone until recorded)
                sock.setblocking(True)  # whatever the process's default: Connection reads
            full = sock is not None and len(self._pending) >= MAX_PENDING
            if sock is not None and not full:
                self._pending[sock] = time.monotonic() + self._handshake_s
        if sock is None:
            self._closed.wait(0.1)
            return True
        if full:
            log.warning("closed a connection: %d challenges under way", MAX_PENDING)
            sock.close()
            return True
        try:
            threading.Thread(
                target=self._prove, args=(sock,), daemon=True, name="agent-handshake"
            ).start()
        except RuntimeError as exc:  # no thread to be had (pids.max): try the next one
            log.warning("closed a connection: %s", exc)
            with self._lock:
                self._pending.pop(sock, None)
            sock.close()
            self._closed.wait(0.1)
        return True

    def settle(self, within_s: float) -> bool:
        """Wait, at most ``within_s``, until every connection made so far was admitted or
        refused: none waits in the backlog, no challenge is under way. Returns whether it
        did (False: a stalled or starved one is still there; the caller reads on without
        it). Called by the agent's thread for a worker that died with no connection it
        knows (:meth:`unicron.control.agent.Agent._drain_worker`); one ``poll`` when the
        door is quiet."""
        until = time.monotonic() + within_s
        backlog = select.poll()
        registered = False
        while True:
            with self._lock:  # the accept thread takes and records a connection under it
                if self._closed.is_set():
                    return True
                if not registered:
                    backlog.register(self._sock, select.POLLIN)
                    registered = True
                busy = bool(self._pending) or bool(backlog.poll(0))
            if not busy:
                return True
            if time.monotonic() >= until:
                return False
            time.sleep(0.005)

    def _reap(self, now: float) -> None:
        """End the challenges past their bound: their reads see the end of the stream."""
        with self._lock:
            late = [sock for sock, until in self._pending.items() if now > until]
            for sock in late:
                del self._pending[sock]
        for sock in late:
            _end(sock)

    def _prove(self, sock: socket.socket) -> None:
        """The challenge both ways, as ``multiprocessing``'s ``Listener`` runs it, on a
        duplicate of the descriptor (the accept thread may end ``sock`` past the bound)."""
        try:
            conn = Connection(os.dup(sock.fileno()))
        except OSError:  # ended already (closed, or past its bound before this thread ran)
            sock.close()
            return
        failed: Exception | None = None
        try:
            deliver_challenge(conn, self._key)
            answer_challenge(conn, self._key)
        except Exception as exc:  # a wrong key, a peer gone, a challenge ended past the bound
            failed = exc
        with self._lock:  # admitted only if neither the bound nor close() ended it meanwhile
            ended = self._pending.pop(sock, None) is None
            ok = failed is None and not ended
            if ok:
                self._admit(conn)
            closed = self._closed.is_set()
        if failed is not None:
            _report(failed, ended=ended, closed=closed, bound_s=self._handshake_s)
        sock.close()  # the duplicate lives on in the connection
        if not ok:
            conn.close()


def _report(exc: Exception, *, ended: bool, closed: bool, bound_s: float) -> None:
    """Say why a challenge failed, at the level its cause deserves. A wrong key, or a peer
    that did not answer within the bound, is worth a warning (a stranger, or a process
    stalled); the door's own :meth:`~Door.close` ending a challenge, and a peer gone in the
    middle of one (a process killed as it connected: a run that ends, a fault injected), are
    the ordinary course of things: a warning there reached the user's terminal as a second
    line beside a run's one-line error (``make test-loaded``, stop 69)."""
    if isinstance(exc, AuthenticationError):
        log.warning("rejected a connection: %s", exc)
    elif closed:
        log.debug("ended a challenge under way at the door's close: %r", exc)
    elif ended:
        log.warning("ended a connection that did not prove the key within %g s", bound_s)
    else:
        log.debug("a connection closed during its challenge: %r", exc)


def _end(sock: socket.socket) -> None:
    """Wake a read blocked on ``sock`` (the end of the stream) and close it."""
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
