"""The worker's end of its connection to the agent (authenticated, local).

Opened once per process, by the bootstrap before the user's script runs (so an import error
in the script is reported too) and reused by :func:`unicron.worker.train`. Sends never raise:
a report that cannot be delivered is dropped, and a lost agent is noticed by the process
supervision on the other side. A send blocks only while the socket's buffer is full, i.e.
when the agent has stopped reading (its loop reads every 20 ms; a report is ~100 bytes and
the local buffer holds megabytes), which is the agent's failure, not training's.
"""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import Client, Connection

from unicron.control.protocol import (
    ENV_AGENT,
    ENV_AUTHKEY,
    ENV_INCARNATION,
    ENV_SLOT,
    Hello,
    LocalMessage,
    encode,
)


class AgentLink:
    """Sends messages (:data:`unicron.control.protocol.KINDS`) to the agent."""

    def __init__(self, conn: Connection | None) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: LocalMessage) -> None:
        if self._conn is None:
            return
        with self._lock:
            try:
                self._conn.send(encode(message))
            except OSError:
                self._conn = None


_link: AgentLink | None = None


def connect_agent() -> AgentLink:
    """The process's link to its agent (connecting on first use; a no-op link if none)."""
    global _link
    if _link is None:
        address = os.environ.get(ENV_AGENT)
        conn = None
        if address:
            host, port = address.rsplit(":", 1)
            conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[ENV_AUTHKEY]))
            hello = Hello(
                slot=int(os.environ[ENV_SLOT]),
                pid=os.getpid(),
                incarnation=int(os.environ.get(ENV_INCARNATION, "0")),
            )
            conn.send(encode(hello))
        _link = AgentLink(conn)
    return _link


def reset_after_fork() -> None:
    """A forked child must not share its parent's connection."""
    global _link
    _link = None
