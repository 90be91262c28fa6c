"""The cluster service's training store, kept: adopted or started, watched, started again.

Held by :class:`unicron.control.cluster.Cluster` (``unicron coordinator``, and ``unicron run``
whose store is its child), whose ticker asks :meth:`Keeper.lost` every tick and, when the
store is lost, restarts it and hands the new one to every running task's coordinator
(:func:`unicron.control.cluster.keep_store`). The store's own process is
:mod:`unicron.control.store` (no torch there: this module's client is torch's).
docs/cluster.md, When the store dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from unicron.control.store import (
    RECORD,
    STARTING,
    StoreInfo,
    alive,
    client,
    ensure,
    secret_of,
    start,
    stop,
)
from unicron.control.storeserver import FENCE_KEY, capability
from unicron.protocol import store_answers
from unicron.runtime.bounded import BoundedStore

PING_S = 1.0
"""how often the cluster's ticker pings its store (:meth:`Keeper.lost`)"""
PING_LIMIT_S = 2.0
"""a ping unanswered for this long: the store is lost (an answer takes ~0.1 ms here)"""


class Keeper:
    """The cluster service's store: adopted or started (:func:`~unicron.control.store.ensure`;
    ``unicron run``'s, its child: :func:`~unicron.control.store.start` with ``die_with_us``),
    watched (:meth:`lost`) and started again (:meth:`restart`)."""

    def __init__(self, state_dir: Path, host: str, *, embedded: bool, token: int = 0) -> None:
        self.state_dir, self.host, self.embedded = state_dir, host, embedded
        self.token = token
        """this coordinator's fencing token (:meth:`client`; the state's generation)"""
        self.proc: subprocess.Popen[bytes] | None = None  # ``unicron run``'s child
        self.adopted = False
        """the store recorded in the state directory answered (a restarted service): the
        tasks' epochs are there"""
        if embedded:
            self.info, self.proc = start(state_dir, host, die_with_us=True)
        else:
            self.info, self.adopted = ensure(state_dir, host)
        self.secret = secret_of(state_dir)
        self._pinged = time.monotonic()

    def lost(self) -> str:
        """Why the store is gone ("" while it is not): its process ended (asked every call, a
        system call), or it did not answer a ping within :data:`PING_LIMIT_S` (asked every
        :data:`PING_S`: a process alive but stopped or hung).

        A ping refused or cut off early is given the rest of its bound to see the process
        end: a killed process closes its sockets before its end is visible, and a busy
        machine stretches that gap (the loaded series saw a killed store called silent)."""
        if self._ended():
            return "its process ended"
        if time.monotonic() - self._pinged < PING_S:
            return ""
        self._pinged = time.monotonic()
        if store_answers(self.info.address, PING_LIMIT_S):
            return ""
        here = self.proc is not None or self.info.host == self.host
        while here and time.monotonic() < self._pinged + PING_LIMIT_S:
            if self._ended():
                return "its process ended"
            time.sleep(0.01)
        return f"it did not answer a ping within {PING_LIMIT_S:g} s"

    def _ended(self) -> bool:
        """Whether the store's process is seen to have ended: this process's child by its
        exit status, another process on this host by :func:`~unicron.control.store.alive`;
        a store another host serves never (it is asked by ping only)."""
        if self.proc is not None:
            return self.proc.poll() is not None
        return self.info.host == self.host and not alive(self.info)

    def answers(self) -> bool:
        """Whether the store answers a ping within :data:`PING_LIMIT_S` (asked after a
        coordinator's request to it failed: slow or gone)."""
        return store_answers(self.info.address, PING_LIMIT_S)

    def restart(self) -> StoreInfo:
        """A new store on the lost one's port where it is free, recorded as :func:`ensure`
        records one; the lost one reaped if it was this process's child."""
        if self.proc is None and self.info.host == self.host:  # silent: gone for good
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.info.pid, signal.SIGKILL)
            deadline = time.monotonic() + 2.0
            while alive(self.info) and time.monotonic() < deadline:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(self.info.pid, os.WNOHANG)  # ours: reaped
                time.sleep(0.01)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(self.info.pid, os.WNOHANG)
        elif self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=5.0)
        info, proc = start(self.state_dir, self.host, die_with_us=self.embedded,
                           port=self.info.port)  # fmt: skip
        if self.embedded:
            self.proc = proc
        else:
            os.replace(self.state_dir / STARTING, self.state_dir / RECORD)
        self.info = info
        return info

    def client(self, uid: str) -> tuple[BoundedStore, str]:
        """A connection for task ``uid``'s coordinator (its capability on every key; every
        request bounded by :data:`PING_LIMIT_S`, :mod:`unicron.runtime.bounded`: the
        coordinator's requests run in the cluster's ticker, which a silent store must not
        hold long) and the address. It writes this coordinator's fencing token first: from
        then on an earlier coordinator's writes of the task are refused, however late they
        arrive (:mod:`unicron.control.storeserver`, Fencing)."""
        address = self.info.address
        bounded = BoundedStore(client(address, capability(self.secret, uid)), PING_LIMIT_S)
        bounded.set(f"{uid}/{FENCE_KEY.decode()}", str(self.token))
        return bounded, address

    def close(self, *, stop_store: bool) -> None:
        """``unicron run``'s store ends with it; a cluster's only with ``stop_store``."""
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10.0)
        elif stop_store:
            stop(self.state_dir)
