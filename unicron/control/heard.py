"""What the agent hears from its workers, and what it becomes for the coordinator.

A worker's fact is one message on both links (:mod:`unicron.messages`): ``StepComputed``
from the worker is ``StepComputed`` to the coordinator. :func:`report_of` passes such a
fact on, stamped with the slot of the connection it came on and (but for a step's reports,
which keep the worker's clock) the time the agent heard it; the agent
(:meth:`unicron.control.agent.Agent._from_worker`) keeps what has effects on the node (an
error, which it classifies; a node fault; events it logs once for the node).
:func:`news_of_node` keeps a node's log to one record of what its workers all say;
:func:`exit_reports` is the reports of a process that exited when nobody planned it; a
:class:`Doorbell` is how a worker's message that may not wait wakes the agent's round.
"""

from __future__ import annotations

import dataclasses
import socket
from collections import deque
from contextlib import suppress

from unicron import messages as M
from unicron.control.workerstate import Worker
from unicron.detect.classify import classify_exit, classify_message

__all__ = ["STEP_FACTS", "Doorbell", "exit_reports", "news_of_node", "report_of"]


STEP_FACTS = (M.StepBegan, M.StepComputed, M.WaitingOnReplica)
"""the facts whose time is the worker's own (:func:`report_of`)"""


def report_of(slot: int, msg: M.LocalMessage, now: float) -> M.Report | None:
    """The report of ``msg`` from the worker in ``slot``, read at ``now``: the same fact
    (:data:`unicron.messages.WORKER_FACTS`), with the slot its connection is (not the one
    it claims), or ``None`` for a message that is not only a fact to pass on. Its time: a
    step's reports keep the worker's own (no later than ``now``: the monitor times the
    step, not the agent's read latency); the others are stamped ``now``, when the agent
    heard them, for the coordinator acts on them at that time (a ready worker's epoch is
    announced then: a worker's earlier clock would date it, and the join's stall clock,
    back by the agent's read latency, seconds on a loaded machine)."""
    if isinstance(msg, M.StepComputed):  # a worker that counts no micro-batches says 0
        msg = dataclasses.replace(msg, microbatches=msg.microbatches or None)
    if isinstance(msg, STEP_FACTS):
        return dataclasses.replace(msg, slot=slot, ts=min(msg.ts, now))
    if isinstance(msg, M.Event):
        return dataclasses.replace(msg, ts=now)
    if isinstance(msg, M.WORKER_FACTS):
        return dataclasses.replace(msg, slot=slot, ts=now)
    return None


def news_of_node(msg: M.Event, fired: set[str], step_ends: deque[tuple[int, int]]) -> bool:
    """Whether a worker's event ``msg`` is news for the node's log, remembering it in
    ``fired`` (the faults injected) or ``step_ends`` (the commits, a bounded memory): a node
    fault fires in every worker of the node and is logged once; every member reports a
    commit and the coordinator logs the first."""
    fields = msg.fields
    if msg.name == "fault_injected" and "spec" in fields:
        if fields["spec"] in fired:
            return False
        fired.add(fields["spec"])
    if msg.name == "step_end":
        key = (int(fields.get("epoch", -1)), int(fields.get("step", -1)))
        if key in step_ends:
            return False
        step_ends.append(key)
    return True


def exit_reports(w: Worker, returncode: int | None, now: float) -> list[M.Report]:
    """The reports of an unplanned exit of ``w``'s process with ``returncode`` (``None``: its
    socket closed and no status came), seen at ``now``: how it was detected (unless the
    agent killed it, or its error was reported already) and that it failed, with the verdict
    of its error, of its exit status, or the one it was killed with."""
    detected = min(t for t in (w.eof_ts, now) if t is not None)
    out: list[M.Report] = []
    if w.verdict is not None:  # the agent killed it and already logged why
        verdict = w.verdict
    else:
        if w.error is not None:
            verdict = classify_message(w.error.type_name, w.error.message)
            method = "exception"
        else:
            verdict = classify_exit(returncode if returncode is not None else -9)
            method = "process"
        if w.error is None or returncode is None or returncode < 0:
            # no status (its socket closed, none came): nothing to say; ``None`` is not a
            # return code, and the cluster refuses an exchange carrying one whole (found by
            # the cluster soak: a node's every later report of the task refused with it)
            extra = {} if returncode is None else {"returncode": returncode}
            out.append(
                M.Detected(
                    slot=w.slot, ts=detected, step=w.step, verdict=verdict, method=method,
                    extra=extra,
                )
            )  # fmt: skip
    out.append(M.WorkerFailed(slot=w.slot, ts=detected, verdict=verdict))
    return out


class Doorbell:
    """A worker's way to wake its agent's round at once (:func:`unicron.messages.quiet`): a
    datagram to a local socket; the agent's round waits on it (:meth:`fileno`) and empties
    it (:meth:`silence`): any number of rings since the last round wake one round."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.setblocking(False)
        self._at: tuple[str, int] = self._sock.getsockname()
        self.address = "{}:{}".format(*self._at)
        """what a worker is told (:data:`unicron.protocol.ENV_BELL`)"""

    def fileno(self) -> int:
        return self._sock.fileno()

    def ring(self) -> None:
        """Wake the waiting round (from any thread)."""
        with suppress(OSError):
            self._sock.sendto(b"!", self._at)

    def silence(self) -> None:
        while True:
            try:
                self._sock.recv(16)
            except OSError:  # BlockingIOError: empty
                return

    def close(self) -> None:
        self._sock.close()
