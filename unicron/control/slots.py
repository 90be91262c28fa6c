"""The slot table: every fact a task's coordinator holds about each of the task's slots.

A slot is one rank's place in the task's plan, on one node. Its :class:`Slot` carries all
that is known of it: its node, its lifecycle (:class:`SlotState`, with the diagram of its
moves), where its worker last said it was (the detectors' view: progress, the step computed,
its compute time per micro-batch, a suspected hang, a kill held back), its exclusion (when,
how often, when readmitted, a health probe running, kept as a last copy of the state), an
in-band error waiting out its grace period, and the escalation policy's memory of its
failures (:class:`~unicron.control.escalation.SlotRecord`). The :class:`SlotTable` holds
them by slot number with the queries the judges ask (the holders of the state, the slots of
a node) and remembers what a released slot leaves behind.

Who uses it: one :class:`~unicron.control.coordinator.Coordinator` owns one table (its
``slots``) through its :class:`~unicron.control.book.TaskBook`; the judges
(:mod:`~unicron.control.membership`, :mod:`~unicron.control.health`,
:mod:`~unicron.control.readmission`, :mod:`~unicron.control.failures`) read and move slots
under the coordinator's lock; the task's :class:`~unicron.control.escalation.Escalation`
keeps its per-slot history here (:meth:`SlotTable.records`). Nothing here does I/O.

A replica of several ranks (model parallelism) would be a group of slots that fail, leave
and come back together: a table-level grouping over these slots, its queries here.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from unicron.control.escalation import SlotRecord
from unicron.detect.classify import Verdict
from unicron.detect.stall import Progress

__all__ = ["IllegalTransition", "Slot", "SlotState", "SlotTable"]


class SlotState(enum.Enum):
    """Where one of the task's slots stands: whether a worker runs there (and is ready), and
    whether the slot is in the plan, excluded from it, or given to another task. Every change
    goes through :meth:`Slot.to`, which refuses a move not drawn here::

        in the plan                              excluded: out of the plan
        STARTING --ready--> READY                OUT_STARTING --ready--> OUT_READY
          ^    |              |                       |                      |
    start |    +--gone--+   gone                      +--gone--+           gone
          |             v     |                                v             |
          +------------ DOWN <+                                EXCLUDED <----+

        exclude:   STARTING -> OUT_STARTING,  READY -> OUT_READY,  DOWN -> EXCLUDED
        readmit:   OUT_STARTING -> STARTING,  OUT_READY -> READY,  EXCLUDED -> DOWN
        start:     DOWN -> STARTING (a restart);  EXCLUDED -> STARTING (a lost node's new agent)
        a worker thought gone is heard from (a late ready, an agent's census):
                   DOWN -> READY | STARTING,  EXCLUDED -> OUT_READY | OUT_STARTING
        a census:  READY -> STARTING,  OUT_READY -> OUT_STARTING (alive, not ready)

        given to another task:  STARTING | READY | OUT_STARTING | OUT_READY --release--> LEAVING
                                LEAVING --stop--> STOPPING
                                LEAVING | STOPPING --gone--> LEFT (removed from the task)
                                (DOWN and EXCLUDED slots are removed at once when released)

    A worker runs (or is being started) in STARTING, READY, OUT_STARTING, OUT_READY, LEAVING
    and STOPPING (:attr:`Slot.alive`); READY and OUT_READY reported ready; all but STARTING,
    READY and DOWN are out of the plan (:attr:`Slot.excluded`: no epoch includes them). A
    worker in OUT_READY is kept on an excluded slot: the last copy of the task's state, or one
    killed whose exit is not in yet.
    """

    STARTING = "starting"  # in the plan; a worker is being started, not ready yet
    READY = "ready"  # in the plan; its worker is ready: waiting to join, or a member
    DOWN = "down"  # in the plan; no worker (gone, and not started again yet)
    OUT_STARTING = "out_starting"  # excluded; its worker still starting
    OUT_READY = "out_ready"  # excluded; its worker still runs and is ready
    EXCLUDED = "excluded"  # excluded, no worker: a health probe may readmit it
    LEAVING = "leaving"  # given to another task: out at the next epoch, then stopped
    STOPPING = "stopping"  # given to another task, its worker told to stop
    LEFT = "left"  # given to another task, its worker gone (removed once its exit is in)


_S = SlotState
_NEXT: dict[SlotState, frozenset[SlotState]] = {
    _S.STARTING: frozenset({_S.READY, _S.DOWN, _S.OUT_STARTING, _S.LEAVING}),
    _S.READY: frozenset({_S.STARTING, _S.DOWN, _S.OUT_READY, _S.LEAVING}),
    _S.DOWN: frozenset({_S.STARTING, _S.READY, _S.EXCLUDED}),
    _S.OUT_STARTING: frozenset({_S.OUT_READY, _S.EXCLUDED, _S.STARTING, _S.LEAVING}),
    _S.OUT_READY: frozenset({_S.OUT_STARTING, _S.EXCLUDED, _S.READY, _S.LEAVING}),
    _S.EXCLUDED: frozenset({_S.DOWN, _S.STARTING, _S.OUT_READY, _S.OUT_STARTING}),
    _S.LEAVING: frozenset({_S.STOPPING, _S.LEFT}),
    _S.STOPPING: frozenset({_S.LEFT}),
    _S.LEFT: frozenset(),
}
"""the moves :class:`SlotState`'s diagram draws (staying in a state is always allowed)"""
_ALIVE = frozenset({_S.STARTING, _S.READY, _S.OUT_STARTING, _S.OUT_READY, _S.LEAVING, _S.STOPPING})
_IN_PLAN = frozenset({_S.STARTING, _S.READY, _S.DOWN})
_GIVEN = frozenset({_S.LEAVING, _S.STOPPING, _S.LEFT})

KILL_UNDER_WAY_S = 60.0
"""how long a kill sent counts as under way, its exit not reported: a kill takes the stacks'
grace (at most :data:`~unicron.protocol.STACKS_MAX_GRACE_S`, or ``py-spy``'s 30 s) and an
agent exchange; a lost node's kills end with it. The bound only keeps a lost report (an agent
restarted with its queue) from holding the judges back for good"""

_order = itertools.count()
"""stamps suspects and pending errors in the order they arose (they are judged in it)"""


class IllegalTransition(RuntimeError):
    """A slot asked to move where :class:`SlotState`'s diagram does not go: a bug here."""


@dataclass(frozen=True)
class Suspect:
    """A step past its hang deadline, waiting on evidence (peers' steps, CPU time)."""

    step: int
    verdict: Verdict
    reason: str
    order: int


@dataclass(frozen=True)
class PendingError:
    """An in-band error of ``epoch`` reported at ``ts``, waiting out its grace period."""

    ts: float
    verdict: Verdict
    epoch: int
    order: int


@dataclass
class Slot:
    """One slot of the task: its node, its :class:`SlotState`, and every other fact about it.

    Exclusion has two sides, both here: :attr:`excluded` (out of the plan: no epoch includes
    it, for its own faults, its node's, or as a dropped straggler) and ``record.excluded``
    (the escalation policy condemned the slot on its own account: it stays out until its
    health probe passes, even when its node comes back)."""

    node: int
    state: SlotState = SlotState.STARTING
    done: dict[str, Any] | None = None  # its worker's final report
    last_error: str = ""
    has_state: bool = True  # it holds the task's committed state (or will after a sync)
    # the (tp, pp) layout of the state it holds, (0, 0): the task's own (what a worker builds
    # when it starts); an epoch at another layout moves it there as it enters: from its
    # EpochEntered (said before the reshard) to its first StepBegan there (after it), both
    state_lay: tuple[int, int] = (0, 0)
    entering_lay: tuple[int, int] | None = None
    fresh: bool = True  # started while no step had committed, and has computed none since
    born: int = 0  # the book's epoch when its worker was started: a commit of that epoch or
    # an older one is its previous worker's, not this one's (0: started with the task)
    # -- what its worker last said (the detectors' view; cleared by :meth:`forget`)
    computed: int | None = None  # the last step it finished computing
    computed_epoch: int = -1  # ... in this epoch (a step retried in a new one is not done)
    progress: Progress | None = None  # where it last said it was
    mb_compute_s: float | None = None  # its latest compute time per micro-batch
    suspect: Suspect | None = None  # a suspected hang
    held: int | None = None  # the step its CPU time held a kill back in
    spared: int | None = None  # the epoch in whose join a stall's kill of it, the last copy
    # of (part of) the state, was held back (:func:`unicron.control.health.check_stalls`)
    starved: tuple[float | None, float] | None = None  # its CPU readings showed it starved
    # while its peers waited for it outside a step: the wait (its progress's time, None: no
    # progress) and when the coordinator first saw it (unicron.control.health.check_stalls)
    pending_error: PendingError | None = None  # an in-band error in its grace period
    # -- exclusion and readmission
    excluded_at: float | None = None  # when it was excluded (or its probe was re-timed)
    exclusions: int = 0  # times excluded (the probe backoff), 0: never
    readmitted_at: float | None = None  # when it last came back
    probing: bool = False  # a health probe of it runs
    kept: bool = False  # on an excluded node, running the task's last copies of the state
    killed_at: float | None = None  # when a kill was sent to its worker, whose exit is not in
    kill_verdict: Verdict | None = None  # ... and the verdict it carried (sent again if lost)
    record: SlotRecord | None = None  # the escalation's memory of its failures

    def to(self, new: SlotState) -> None:
        """Move to ``new``; :class:`IllegalTransition` if the diagram has no such move."""
        if new is not self.state and new not in _NEXT[self.state]:
            raise IllegalTransition(f"slot on node {self.node}: {self.state.name} -> {new.name}")
        self.state = new

    @property
    def alive(self) -> bool:
        """A worker process runs here, or is being started."""
        return self.state in _ALIVE

    @property
    def ready(self) -> bool:
        """Its worker reported ready (built its model) and runs."""
        return self.state in (_S.READY, _S.OUT_READY)

    @property
    def excluded(self) -> bool:
        """Out of the plan: no epoch includes it."""
        return self.state not in _IN_PLAN

    @property
    def leaving(self) -> bool:
        """Given to another task."""
        return self.state in _GIVEN

    @property
    def broken_script(self) -> bool:
        """Excluded for good: the training script itself failed here every time
        (:attr:`SlotRecord.broken_script`): no health probe readmits it."""
        return self.record is not None and self.record.broken_script

    def predates(self, epoch: int) -> bool:
        """Its worker was started before ``epoch``: a report or a commit of ``epoch`` may be
        its own (one of an epoch no later than its start is its previous worker's)."""
        return self.born < epoch

    # -- the moves, by what happened ----------------------------------------------------------
    def start(self, epoch: int) -> None:
        """A worker is (being) started here (a restart, or a lost node's new agent) while the
        task is at ``epoch``."""
        self.to(_S.STARTING)
        self.born, self.done = epoch, None  # (a new worker: it has reported nothing)
        self.killed_at, self.starved = None, None
        self.state_lay, self.entering_lay = (0, 0), None

    def readied(self) -> None:
        """Its worker reported ready."""
        moves = {_S.STARTING: _S.READY, _S.DOWN: _S.READY, _S.OUT_STARTING: _S.OUT_READY}
        moves[_S.EXCLUDED] = _S.OUT_READY
        self.to(moves.get(self.state, self.state))

    def ended(self) -> None:
        """Its worker's exit is in (its agent reported it, or its node is lost): gone, and no
        kill of it is under way any more."""
        self.gone()
        self.killed_at = None

    def gone(self) -> None:
        """Its worker is gone (or doomed: killed, not a member of the next epoch; its kill
        stays under way, :attr:`killed_at`, until :meth:`ended`)."""
        if self.state in _IN_PLAN:
            self.to(_S.DOWN)
        elif self.state in _GIVEN:
            self.to(_S.LEFT)
        else:
            self.to(_S.EXCLUDED)

    def exclude(self) -> None:
        """Out of the plan until a health probe brings it back (its worker, if any, runs on)."""
        moves = {_S.STARTING: _S.OUT_STARTING, _S.READY: _S.OUT_READY, _S.DOWN: _S.EXCLUDED}
        self.to(moves.get(self.state, self.state))

    def readmit(self) -> None:
        """Back in the plan (a passed health probe, a node that came back)."""
        moves = {_S.OUT_STARTING: _S.STARTING, _S.OUT_READY: _S.READY, _S.EXCLUDED: _S.DOWN}
        self.to(moves.get(self.state, self.state))

    def seen(self, *, alive: bool, ready: bool) -> None:
        """An agent's account of its worker (its census after a coordinator's restart)."""
        if not alive:
            self.ended()
        elif ready:
            self.readied()
        else:
            moves = {_S.READY: _S.STARTING, _S.DOWN: _S.STARTING}
            moves |= {_S.OUT_READY: _S.OUT_STARTING, _S.EXCLUDED: _S.OUT_STARTING}
            self.to(moves.get(self.state, self.state))

    # -- what the detectors know of its worker -------------------------------------------------
    def forget(self) -> None:
        """Drop what the detectors know of its worker (gone, or restarting); the monitor's and
        the CPU sampler's share is dropped by the caller."""
        self.computed = self.progress = self.mb_compute_s = self.suspect = None
        self.starved = None

    def suspected(self, step: int, verdict: Verdict, reason: str) -> None:
        """Its step ``step`` is past its hang deadline: a hang once the evidence is in."""
        order = next(_order) if self.suspect is None else self.suspect.order
        self.suspect = Suspect(step, verdict, reason, order)

    def erred(self, ts: float, verdict: Verdict, epoch: int) -> None:
        """An in-band error of ``epoch`` (the first one counts until it is healed)."""
        if self.pending_error is None:
            self.pending_error = PendingError(ts, verdict, epoch, next(_order))


class SlotTable(dict[int, Slot]):
    """The task's slots by number, with the questions the judges ask of them. Slots come in
    through :meth:`add` (the planner's moves; the task's first slots at construction) and
    leave through :meth:`remove`; what a removed slot leaves behind (its exclusion history,
    the escalation's record) waits in :attr:`departed` in case it is given back."""

    def __init__(self, placement: dict[int, int]) -> None:
        super().__init__({s: Slot(node=n) for s, n in placement.items()})
        self.departed: dict[int, Slot] = {}
        self.released: set[int] = set()  # given back, worker gone, not yet told the cluster

    def add(self, slot: int, node: int) -> Slot:
        """``slot`` on ``node`` joins the task, a new worker to start there; what it left
        behind when it was released before (its exclusion history, the escalation's record)
        comes back with it."""
        s = self.departed.pop(slot, None)
        if s is None:
            s = Slot(node=node)
        else:
            s.node, s.state, s.done, s.last_error = node, SlotState.STARTING, None, ""
            s.has_state = s.fresh = True
            s.killed_at = None  # a new worker: no kill of it under way
        self[slot] = s
        return s

    def remove(self, slot: int) -> None:
        """``slot`` leaves the task (released, its worker gone; the caller forgot its worker)
        and is reported once by :meth:`take_released`."""
        self.departed[slot] = self.pop(slot)
        self.released.add(slot)

    def take_released(self) -> set[int]:
        """Slots given back whose worker is gone, each reported once."""
        out, self.released = self.released, set()
        return out

    def holders(self) -> list[int]:
        """The live slots that hold the task's committed state (or will after a sync); a
        worker being killed holds nothing to count on (two peers killed in one breath must
        not each count on the other's copy)."""
        return [k for k, s in self.items() if s.alive and s.has_state and s.killed_at is None]

    def kills_under_way(self, now: float) -> set[int]:
        """Slots whose worker was sent a kill whose exit is not in yet (alive or doomed), sent
        less than :data:`KILL_UNDER_WAY_S` ago: the judges kill no last copy of the state
        meanwhile (that exit may end its wait)."""
        return {k for k, s in self.items()
                if s.killed_at is not None and now - s.killed_at < KILL_UNDER_WAY_S}  # fmt: skip

    def on_node(self, node: int) -> list[int]:
        """The slots of ``node``, in slot order."""
        return sorted(k for k, s in self.items() if s.node == node)

    def nodes(self) -> set[int]:
        """The nodes the task has slots on."""
        return {s.node for s in self.values()}

    def suspects(self) -> list[int]:
        """Slots with a suspected hang, in the order they became suspect."""
        found = [(s.suspect.order, k) for k, s in self.items() if s.suspect is not None]
        return [k for _, k in sorted(found)]

    def pending_errors(self) -> list[int]:
        """Slots with an in-band error in its grace period, in the order they were reported."""
        found = [(s.pending_error.order, k) for k, s in self.items() if s.pending_error]
        return [k for _, k in sorted(found)]

    def progress_of(self, slot: int) -> Progress | None:
        """Where the worker in ``slot`` last said it was (``None``: nothing, or no such slot)."""
        s = self.get(slot)
        return None if s is None else s.progress

    def computed_of(self, slot: int, epoch: int | None = None) -> int:
        """The last step the worker in ``slot`` finished computing (``epoch``: in that epoch);
        -1: none (or no slot)."""
        s = self.get(slot)
        if s is None or s.computed is None or epoch not in (None, s.computed_epoch):
            return -1
        return s.computed

    def progress(self) -> dict[int, Progress]:
        """Where each worker last said it was (the slots that said anything)."""
        return {k: s.progress for k, s in self.items() if s.progress is not None}

    def records(self) -> MutableMapping[int, SlotRecord]:
        """The escalation's per-slot memory, kept on the slots (:meth:`Escalation.bind`)."""
        return _Records(self)


class _Records(MutableMapping[int, SlotRecord]):
    """:attr:`Slot.record` of every slot, present and departed, as a mapping."""

    def __init__(self, table: SlotTable) -> None:
        self._t = table

    def _slot(self, k: int) -> Slot | None:
        return self._t.get(k) or self._t.departed.get(k)

    def __getitem__(self, k: int) -> SlotRecord:
        s = self._slot(k)
        if s is None or s.record is None:
            raise KeyError(k)
        return s.record

    def __setitem__(self, k: int, record: SlotRecord) -> None:
        s = self._slot(k)
        if s is None:  # a slot the task never had: a departed one of its own
            s = self._t.departed[k] = Slot(node=record.node)
        s.record = record

    def __delitem__(self, k: int) -> None:
        s = self._slot(k)
        if s is None or s.record is None:
            raise KeyError(k)
        s.record = None

    def __iter__(self) -> Iterator[int]:
        for slots in (self._t, self._t.departed):
            yield from [k for k, s in slots.items() if s.record is not None]

    def __len__(self) -> int:
        return sum(1 for _ in self)
