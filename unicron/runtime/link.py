"""The worker's end of its connection to the agent (authenticated, local).

Opened once per process, by the bootstrap before the user's script runs (so an import error
in the script is reported too) and reused by :func:`unicron.worker.train`. Sends never raise:
a report that cannot be delivered is dropped, and a lost agent is noticed by the process
supervision on the other side. A send blocks only while the socket's buffer is full, i.e.
when the agent has stopped reading (its loop reads at least every 250 ms; a report is ~100
bytes and the local buffer holds megabytes), which is the agent's failure, not training's.

The agent reads its workers' sockets once per round (:meth:`~unicron.control.agent.Agent.
round_s`: when its next exchange or timed check is due) and is woken sooner by its doorbell:
after a message that is not :func:`~unicron.messages.quiet` (an error, an epoch
entered, the worker done) the link sends the doorbell a one-byte datagram. A step's reports,
a dozen per step from a node's workers, so wake no one (docs/cluster.md, The rhythm).

One question goes the other way: a worker whose training store stopped answering asks where
it serves now (:meth:`AgentLink.where_store`), and the agent answers on the same connection.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from multiprocessing.connection import Client, Connection

from unicron.messages import Hello, LocalMessage, StoreAt, WhereStore, from_wire, quiet, to_wire
from unicron.protocol import ENV_AGENT, ENV_AUTHKEY, ENV_BELL, ENV_INCARNATION, ENV_SLOT, host_port


class AgentLink:
    """Sends messages (:data:`unicron.messages.LocalMessage`) to the agent."""

    def __init__(self, conn: Connection | None, bell: tuple[str, int] | None = None) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._bell: tuple[socket.socket, tuple[str, int]] | None = None  # (ringer, doorbell)
        if bell is not None:
            ringer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            ringer.setblocking(False)
            self._bell = (ringer, bell)

    def send(self, message: LocalMessage) -> None:
        if self._conn is None:
            return
        with self._lock:
            try:
                self._conn.send(to_wire(message))
            except OSError:
                self._conn = None
                return
            if self._bell is not None and not quiet(message):
                # the message is in the socket: wake the agent's round for it (an OSError:
                # the agent is gone, or its doorbell is full and it is awake anyway)
                ringer, doorbell = self._bell
                with contextlib.suppress(OSError):
                    ringer.sendto(b"!", doorbell)

    def where_store(self, timeout_s: float = 1.0) -> str | None:
        """The training store's ``host:port`` as the agent last heard it from the
        coordinator (:class:`~unicron.messages.WhereStore`, asked when the store stopped
        answering); ``None`` without an agent or an answer within ``timeout_s``."""
        self.send(WhereStore())  # not quiet: the doorbell wakes the agent's round for it
        with self._lock:
            try:
                while self._conn is not None and self._conn.poll(timeout_s):
                    answer = from_wire(self._conn.recv())
                    if isinstance(answer, StoreAt):
                        return answer.address
            except (OSError, EOFError, ValueError):
                self._conn = None
        return None


_link: AgentLink | None = None


def connect_agent() -> AgentLink:
    """The process's link to its agent (connecting on first use; a no-op link if none)."""
    global _link
    if _link is None:
        address = os.environ.get(ENV_AGENT)
        conn = None
        if address:
            conn = Client(host_port(address), authkey=bytes.fromhex(os.environ[ENV_AUTHKEY]))
            hello = Hello(
                slot=int(os.environ[ENV_SLOT]),
                pid=os.getpid(),
                incarnation=int(os.environ.get(ENV_INCARNATION, "0")),
            )
            conn.send(to_wire(hello))
        bell = os.environ.get(ENV_BELL)
        _link = AgentLink(conn, host_port(bell) if conn is not None and bell else None)
    return _link


def reset_after_fork() -> None:
    """A forked child must not share its parent's connection."""
    global _link
    _link = None
