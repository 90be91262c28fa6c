"""A store connection whose every request ends in bounded time.

torch's TCPStore client waits without a bound for the answer to a request it sent: a store
whose process hangs (stopped, swapped out) or whose host is cut off from the network holds
the caller for ever (measured here: a ``get`` on a stopped store returned after no timeout,
only when the store went on). The control path must not: a worker blocked in its vote cannot
leave the epoch, and a coordinator blocked in a write holds its task's lock.

:class:`BoundedStore` hands each request to a thread of its own and waits at most
:data:`REQUEST_LIMIT_S` longer than the request itself may take (a ``wait``'s own timeout),
then gives the connection up: :class:`StoreTimeout`, and every later request fails at once,
as after a connection error (the store is gone as far as this connection knows). The worker's
control connection (its epochs, the vote, the rendezvous barrier) and every coordinator's
are such connections; the worker turns a :class:`StoreTimeout` into
:class:`unicron.runtime.group.StoreLost`, the coordinator into a store to replace
(:mod:`unicron.control.store`). gloo's own connection to the store is torch's (a c10d store),
used only inside collectives, which the epoch's group waits for in slices anyway.

A thread handoff costs ~20 us a request here (78 -> 98 us for a ``check`` on loopback).
"""

from __future__ import annotations

import datetime as dt
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

REQUEST_LIMIT_S = 3.0
"""how long a store request may take beyond its own timeout before the store counts as gone
(a request takes well under a millisecond on a healthy store; a worker that gives up on a
store that is only slow reports it, and its task gets a new epoch: :meth:`unicron.worker.
_Runner._leave`). It bounds a standby's takeover: the workers wait this long for the lost
leader's store before they ask where the new one serves"""

T = TypeVar("T")


class StoreTimeout(dist.DistNetworkError):
    """A request got no answer within its bound: the connection is given up."""


class _Caller:
    """The thread that makes one connection's requests, one at a time."""

    def __init__(self, store: Any, limit_s: float) -> None:
        self.store, self.limit_s = store, limit_s
        self.broken: BaseException | None = None
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # one request at a time, as the connection serves them
        self._thread = threading.Thread(target=self._run, name="unicron-store", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def call(self, fn: Callable[[Any], T], extra_s: float = 0.0) -> T:
        with self._lock:
            if self.broken is not None:
                raise StoreTimeout(f"the store connection was given up ({self.broken})")
            done = threading.Event()
            out: list[Any] = []

            def job() -> None:
                try:
                    out.append((True, fn(self.store)))
                except BaseException as exc:  # handed to the caller
                    out.append((False, exc))
                done.set()

            self._jobs.put(job)
            if not done.wait(self.limit_s + extra_s):
                self.broken = StoreTimeout(f"no answer within {self.limit_s + extra_s:.1f} s")
                self._jobs.put(None)  # the thread ends if the request ever returns
                raise self.broken
            ok, value = out[0]
            if not ok:
                if isinstance(value, dist.DistNetworkError):
                    self.broken = value
                raise value
            return value


class BoundedStore:
    """The requests the control path makes (``set``, ``get``, ``check``, ``add``, ``wait``,
    ``compare_set``, ``multi_get``) on ``store``, each bounded (see the module docstring);
    keys under ``prefix`` when given (``prefix/key``, as torch's ``PrefixStore``)."""

    def __init__(
        self, store: Any, limit_s: float = REQUEST_LIMIT_S, *, _caller: _Caller | None = None,
        prefix: str = "",
    ) -> None:  # fmt: skip
        self._caller = _caller or _Caller(store, limit_s)
        self._prefix = prefix

    def prefixed(self, prefix: str) -> BoundedStore:
        """The same connection with every key under ``prefix`` too."""
        return BoundedStore(None, _caller=self._caller, prefix=self._key(prefix))

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{key}" if self._prefix else key

    def set(self, key: str, value: str | bytes) -> None:
        k = self._key(key)
        self._caller.call(lambda s: s.set(k, value))

    def get(self, key: str) -> bytes:
        k = self._key(key)
        return self._caller.call(lambda s: s.get(k))

    def check(self, keys: list[str]) -> bool:
        ks = [self._key(k) for k in keys]
        return self._caller.call(lambda s: s.check(ks))

    def add(self, key: str, amount: int) -> int:
        k = self._key(key)
        return self._caller.call(lambda s: s.add(k, amount))

    def wait(self, keys: list[str], timeout: dt.timedelta) -> None:
        ks = [self._key(k) for k in keys]
        self._caller.call(lambda s: s.wait(ks, timeout), extra_s=timeout.total_seconds())

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        k = self._key(key)
        return self._caller.call(lambda s: s.compare_set(k, expected, desired))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        ks = [self._key(k) for k in keys]
        return self._caller.call(lambda s: s.multi_get(ks))
