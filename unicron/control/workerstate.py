"""What an agent knows of the process in one slot (:class:`Worker`): its lifecycle
(:class:`WorkerState`, every move checked against the diagram) and the facts beside it (pid,
socket, last error, the step it computes, when its CPU time is sampled next). Used by
:class:`unicron.control.agent.Agent`, one :class:`Worker` per slot of its task.
"""

from __future__ import annotations

import enum
import subprocess
from dataclasses import dataclass
from multiprocessing.connection import Connection

from unicron import messages as M
from unicron.detect.classify import Verdict

CPU_SAMPLE_AFTER_S = 0.2
"""a step that has lasted this long gets its worker's CPU time sampled: early enough that at
the 1 s hang floor two samples lie :data:`unicron.detect.busy.MIN_GAP_S` apart"""
CPU_SAMPLE_EVERY_S = 0.2
"""and sampled again this often while it lasts (:mod:`unicron.detect.busy`)"""
WAIT_SAMPLE_AFTER_S = 2.0
"""a wait on the peers (joining an epoch, reducing a step) that has lasted this long gets the
worker's CPU time sampled too: a member the others wait for may be starved rather than stuck
(:func:`unicron.control.health.check_stalls` asks). Well within the stall floor (5 s), and
past an ordinary reduce: a task that trains costs no reads"""
WAIT_SAMPLE_EVERY_S = 0.5
"""... every this often while the wait lasts (waits can last minutes: a restarted peer); two
readings :data:`unicron.detect.busy.MIN_GAP_S` apart are all the judge compares"""


class WorkerState(enum.Enum):
    """Where the process of one slot stands, as its agent sees it. Every change goes through
    :meth:`Worker.to`, which refuses a move not drawn here::

        NEW --spawn--> STARTING --ready--> READY --entered--> MEMBER --done--> DONE
                          |                  |                  | <-entered-  |
                          +------------------+--leave-----------+--> LEAVING  |
                          |                  |                  |       |     |
                          +------------------+--exit------------+-------+-----+--> GONE

        spawn:  any state -> STARTING (a new incarnation; one still running is killed first)
        ready:  STARTING -> READY                (it built its model and waits for an epoch)
        entered: READY -> MEMBER                 (it joined an epoch; it stays a member between
                                                  epochs: it reports ready once per process)
        done:   MEMBER | READY -> DONE           (it reported the task's last step; READY: a
                                                  resumed run that had no step left)
        entered: DONE -> MEMBER                  (a finished worker stays until the task is
                                                  over, and serves a newer epoch that needs
                                                  what it holds)
        leave:  STARTING | READY | MEMBER | DONE -> LEAVING   (killed: its slot goes to another
                                                  task)
        exit:   STARTING | READY | MEMBER | DONE | LEAVING -> GONE   (it exited, was cut off,
                                                  or vanished with its node)

    A report that does not apply where the worker stands leaves it there (an ``entered`` read
    after its ``leave``). A finished worker's exit 0 is the normal end, any other a failure. A
    process runs in every state but NEW and GONE (:attr:`Worker.alive`). A kill owed to a
    process whose pid is not known yet (:attr:`Worker.kill_pending`) is no state of its
    lifecycle: it is carried out as soon as the pid is.
    """

    NEW = "new"  # no process yet: the slot's first spawn is still to come
    STARTING = "starting"  # started (or queued for the zygote), not ready yet
    READY = "ready"  # reported ready, entered no epoch since
    MEMBER = "member"  # entered an epoch
    DONE = "done"  # reported the last step: its exit is the normal end
    LEAVING = "leaving"  # killed because its slot goes to another task: its exit heals nothing
    GONE = "gone"  # exited (or vanished with its node)


_W = WorkerState
_LIVE = frozenset({_W.STARTING, _W.READY, _W.MEMBER, _W.DONE, _W.LEAVING})
_WORKER_NEXT: dict[WorkerState, frozenset[WorkerState]] = {
    _W.NEW: frozenset({_W.STARTING}),
    _W.STARTING: frozenset({_W.READY, _W.LEAVING, _W.GONE}),
    _W.READY: frozenset({_W.STARTING, _W.MEMBER, _W.DONE, _W.LEAVING, _W.GONE}),
    _W.MEMBER: frozenset({_W.STARTING, _W.DONE, _W.LEAVING, _W.GONE}),
    _W.DONE: frozenset({_W.STARTING, _W.MEMBER, _W.LEAVING, _W.GONE}),
    _W.LEAVING: frozenset({_W.STARTING, _W.GONE}),
    _W.GONE: frozenset({_W.STARTING}),
}
"""the moves :class:`WorkerState`'s diagram draws (staying in a state is always allowed)"""


class IllegalTransition(RuntimeError):
    """A worker asked to move where :class:`WorkerState`'s diagram does not go: a bug here."""


@dataclass
class Worker:
    """What the agent knows of the process in one slot (one incarnation at a time): its
    :class:`WorkerState`, and facts that are not its lifecycle."""

    slot: int
    incarnation: int = -1
    state: WorkerState = WorkerState.NEW
    pid: int | None = None
    conn: Connection | None = None
    popen: subprocess.Popen[bytes] | None = None
    eof_ts: float | None = None
    error: M.Error | None = None  # the last error it reported before exiting
    verdict: Verdict | None = None  # set when it was killed for a logged reason (hang, ...)
    step: int | None = None
    kill_pending: bool = False  # asked to die before its pid was known
    computing_since: float | None = None  # its step began then and has not ended yet
    waiting_since: float | None = None  # it entered an epoch or finished a step's compute
    # then, and waits on its peers (joining, reducing) with no step begun since
    cpu_read_at: float = 0.0  # when its CPU time was last sampled (unicron.detect.busy)
    tid: int | None = None  # the thread that computes its steps (its CPU time is sampled)

    def to(self, new: WorkerState) -> None:
        """Move to ``new``; :class:`IllegalTransition` if the diagram has no such move."""
        if new is not self.state and new not in _WORKER_NEXT[self.state]:
            raise IllegalTransition(f"worker in slot {self.slot}: {self.state.name} -> {new.name}")
        self.state = new

    @property
    def alive(self) -> bool:
        """Its process runs (or is being started)."""
        return self.state in _LIVE

    def sample_at(self) -> float | None:
        """When the CPU time of the thread computing its steps is sampled next (None: it
        neither computes a step nor waits on its peers): :data:`CPU_SAMPLE_AFTER_S` into a
        step, then every :data:`CPU_SAMPLE_EVERY_S`; :data:`WAIT_SAMPLE_AFTER_S` into a wait,
        then every :data:`WAIT_SAMPLE_EVERY_S` (:mod:`unicron.detect.busy`)."""
        if not self.alive or self.pid is None:
            return None
        if self.computing_since is not None and self.tid is not None:  # (sent together)
            return max(
                self.computing_since + CPU_SAMPLE_AFTER_S, self.cpu_read_at + CPU_SAMPLE_EVERY_S
            )
        if self.waiting_since is not None:
            return max(
                self.waiting_since + WAIT_SAMPLE_AFTER_S, self.cpu_read_at + WAIT_SAMPLE_EVERY_S
            )
        return None

    def timed(self, msg: M.LocalMessage, ts: float) -> None:
        """What the worker's message ``msg``, sent at ``ts``, does to the clocks of its step
        (:attr:`computing_since`) and of its wait on its peers (:attr:`waiting_since`): a
        step runs from its begin to its computed report, a wait from then, or from an
        epoch's entry (which abandons a step begun), to the next step; neither once it left
        its epoch (an in-band error not retried in place) or finished."""
        if isinstance(msg, M.StepBegan):
            self.step, self.tid = msg.step, msg.tid
            self.computing_since, self.waiting_since = ts, None
        elif isinstance(msg, (M.EpochEntered, M.StepComputed)):
            self.computing_since, self.waiting_since = None, ts
        elif isinstance(msg, M.WorkerDone) or (
            isinstance(msg, M.Error) and msg.in_band and not msg.in_place
        ):
            self.computing_since = self.waiting_since = None

    @property
    def sampled_tid(self) -> int | None:
        """The thread whose CPU time is sampled: the one computing its steps, or, before its
        first step told it, the main thread (whose id is the process's)."""
        return self.pid if self.tid is None else self.tid

    # -- the moves, by what happened ----------------------------------------------------------
    def spawned(self) -> None:
        """A new incarnation is started."""
        self.to(_W.STARTING)

    def readied(self) -> None:
        """It reported ready (built its model; it waits for an epoch)."""
        if self.state is _W.STARTING:
            self.to(_W.READY)

    def entered(self) -> None:
        """It entered an epoch (a finished one: a newer epoch that needs what it holds)."""
        if self.state in (_W.READY, _W.DONE):
            self.to(_W.MEMBER)

    def done(self) -> None:
        """It reported the task's last step."""
        if self.state in (_W.READY, _W.MEMBER):
            self.to(_W.DONE)

    def leave(self) -> None:
        """It is killed because its slot goes to another task."""
        if self.state in (_W.STARTING, _W.READY, _W.MEMBER, _W.DONE):
            self.to(_W.LEAVING)

    def exited(self) -> None:
        """Its process is gone (exited, cut off, or vanished with its node)."""
        if self.alive:
            self.to(_W.GONE)
