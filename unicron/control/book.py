"""A task's book: what its coordinator knows of the task, and the effects decided so far.

One :class:`TaskBook` per task, owned by its :class:`~unicron.control.coordinator.Coordinator`
and read and written only under the coordinator's lock. It holds the slot table
(:class:`~unicron.control.slots.SlotTable`), the membership (members, epoch, the task's
:class:`TaskState`), the nodes' heartbeats, the settings, the detectors (step monitor, CPU
times) and the escalation policy. The judges (:mod:`~unicron.control.membership`,
:mod:`~unicron.control.health`, :mod:`~unicron.control.readmission`,
:mod:`~unicron.control.failures`) are functions of a book: they move its slots and its
membership and append what reaches outside it to :attr:`TaskBook.effects`
(:mod:`~unicron.control.effects`), which the coordinator carries out or hands back. The store
and the filesystem reach a judge only as values the coordinator passes in, or through
:meth:`TaskBook.has_checkpoint` (the one filesystem question, asked only when a decision
needs it).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unicron.control import replicas
from unicron.control.effects import Effect, LogEvent, Tell
from unicron.control.escalation import Escalation
from unicron.control.slots import SlotTable
from unicron.detect.busy import CpuTimes
from unicron.detect.classify import Action, Verdict
from unicron.detect.monitor import StepMonitor
from unicron.messages import AgentAction, Kill, Spawn

__all__ = ["CoordinatorSettings", "Outcome", "TaskBook", "TaskState", "whole"]


class TaskState(enum.Enum):
    """PENDING -> RUNNING (first epoch announced) <-> WAITING (fewer live workers than the
    minimum while capacity can come back: restarts, health probes) -> DONE (a member finished
    the last step) or FAILED (no way back to the minimum, no replica and no checkpoint holding
    the state, replicas that disagree, or the give-up deadline passed while waiting)."""

    PENDING = "pending"
    RUNNING = "running"
    WAITING = "waiting"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, kw_only=True)
class CoordinatorSettings:
    min_workers: int = 1
    """the task is worth nothing below this many workers: it waits (or fails) instead"""
    replica_ranks: int = 1
    """ranks per replica (``tp * pp``: ``pp`` blocks of ``tp`` slots of one node): an epoch
    holds whole replicas only (:func:`unicron.control.replicas.whole`)"""
    tp: int = 1
    """tensor-parallel ranks per pipeline stage of the task's own layout"""
    layouts: tuple[tuple[int, int], ...] = ()
    """the ``(tp, pp)`` layouts the task may run at, its own first (empty: only its own; else
    a replica is ``tp * pp`` ranks of the epoch's: :func:`unicron.control.membership.layout`)"""
    rate: Callable[[int, int, int], float] | None = None
    """the performance model's achieved FLOP/s of the task at ``(tp, pp)`` on that many slots
    (0: no such layout fits), which picks among :attr:`layouts` (:func:`layout_rate`);
    ``None``: the layout training the most slots wins"""
    start_timeout_s: float = 120.0
    """the first epoch starts with the ready workers after this long, if they are enough"""
    zero: bool = False
    """the optimizer state is sharded across replicas, each share kept by two members of a
    place's data-parallel group (``zero: 1``, :mod:`unicron.runtime.zero`): no member holds
    all of it (:meth:`TaskBook.other_holders`)"""

    @property
    def own(self) -> tuple[int, int]:
        """The task's own ``(tp, pp)`` layout."""
        return self.tp, self.replica_ranks // self.tp

    checkpoint: Path | None = None
    """the directory of the task's persistent checkpoints: when every replica is gone the task
    goes on from the newest one (if there is one) instead of failing"""
    committed_before: int | None = 0
    """steps a previous run of the task committed (``--resume``; ``None``: unknown), from
    which ``steps_redone`` of a fallback to a checkpoint is counted"""
    heartbeat_timeout_s: float = 2.0
    """a node whose agent has not been heard from for this long is lost (SEV1, excluded)"""
    suspect_after_s: float = 0.5
    """a node silent for this long is *suspect*; a suspect node is lost at once when a living
    worker elsewhere reports a failed collective (the in-band symptom of a lost peer), so a
    node loss need not wait out the whole heartbeat timeout"""
    readmit_after_s: float = 60.0
    """an excluded slot, or a slot of an excluded (not lost) node, gets a health probe this
    long after its exclusion, twice as long after each further one; a probe that passes brings
    it (and its node) back: a new worker joins the next epoch. ``math.inf``: never"""
    error_grace_s: float = 2.5
    """an in-band error of the current epoch with no process or node failure within this long
    is healed by a reattempt: a new epoch of the same members (fresh process group), keeping
    every local sum. Longer than the heartbeat timeout, so a lost node is not mistaken for a
    flaky link"""
    give_up_after_s: float = 600.0
    """a task below its minimum waits this long for capacity (restarts, readmitted slots and
    nodes), then fails; ``math.inf``: wait for ever"""
    nodes_return: bool = False
    """lost nodes may come back (a cluster: the agent registers again, or the planner gives
    the task other slots): a task left only with slots of lost nodes waits for them
    (``give_up_after_s``) instead of failing at once, as ``unicron run``'s does"""
    stall_factor: float = 20.0
    """a member waiting on its peers outside a step (joining an epoch, reducing) for longer
    than this many step times (see ``stall_floor_s``) is stalled"""
    stall_floor_s: float = 5.0
    """... and never before this many seconds"""
    stall_cold_s: float = 120.0
    """the stall deadline before the task has a pace (its first epoch: imports, first
    connections)"""
    stall_transfer_bytes_per_s: float = 50e6
    """a conservative bandwidth for moving the task's state to a joiner: the stall deadline
    grows by the state size over it"""

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"min_workers must be >= 1, got {self.min_workers}")
        for name in ("start_timeout_s", "heartbeat_timeout_s", "give_up_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.readmit_after_s > 0:
            raise ValueError(f"readmit_after_s must be > 0, got {self.readmit_after_s}")
        if not 0 < self.suspect_after_s <= self.heartbeat_timeout_s:
            raise ValueError(
                f"suspect_after_s must be in (0, heartbeat_timeout_s], got {self.suspect_after_s}"
            )
        if not self.error_grace_s > self.heartbeat_timeout_s:
            raise ValueError(
                f"error_grace_s must be > heartbeat_timeout_s ({self.heartbeat_timeout_s}), "
                f"got {self.error_grace_s}"
            )
        for name in ("stall_factor", "stall_floor_s", "stall_cold_s"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.stall_transfer_bytes_per_s > 0:
            raise ValueError(
                f"stall_transfer_bytes_per_s must be > 0, got {self.stall_transfer_bytes_per_s}"
            )


@dataclass
class Outcome:
    """How the task ended, for the runner's exit code and report."""

    state: TaskState
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    usage: bool = False  # failed on bad input (a worker's check before training): exit 2


def whole(shards: Iterable[tuple[tuple[int, int], int]]) -> bool:
    """Whether ``shards`` (``((tp, pp), place)``, :meth:`TaskBook.shards`) hold every place
    of some layout: the task's whole state."""
    places: dict[tuple[int, int], set[int]] = {}
    for lay, at in shards:
        places.setdefault(lay, set()).add(at)
    return any(len(got) == lay[0] * lay[1] for lay, got in places.items())


class TaskBook:
    """Everything one task's coordinator knows of the task (see the module docstring)."""

    def __init__(
        self,
        *,
        task: str,
        label: str,
        slots: dict[int, int],
        settings: CoordinatorSettings,
        escalation: Escalation,
        monitor: StepMonitor | None,
        checkpoint_exists: Callable[
            [Path | None, tuple[int, int], Sequence[tuple[int, int]]], bool
        ],
    ) -> None:
        self.task = task  # scopes its store keys: unique on the store
        self.label = label  # its name in the event log
        self.settings = settings
        self.escalation = escalation
        self.monitor = monitor
        self.slots = SlotTable(slots)
        escalation.bind(self.slots.records())
        self._checkpoint_exists = checkpoint_exists
        # -- membership
        self.state = TaskState.PENDING
        self.epoch = 0
        self.members: tuple[int, ...] = ()
        self.layout: tuple[int, int] = (0, 0)  # the epoch's (tp, pp); (0, 0): the task's own
        self.epoch_layouts: dict[int, tuple[int, int]] = {}  # each epoch's, as announced
        self.epoch_members: dict[int, tuple[int, ...]] = {}  # each epoch's, as announced
        # the current epoch's shards held by members as they entered it: its possible sources
        # (health.epoch_entered), by epoch (only the current one is kept)
        self.sources: dict[int, set[tuple[tuple[int, int], int]]] = {}
        self.outcome: Outcome | None = None
        # (layout, place) of the final files written: replica 0's done reports (membership.py)
        self.final_written: set[tuple[tuple[int, int], int]] = set()
        self.control_errors = 0  # reports the coordinator failed to apply (failures.py)
        self.started_at: float | None = None
        self.waiting_since: float | None = None
        self.waiting_reason = ""
        self.trained = False  # a step committed: a fresh worker's model is no longer the state
        self.commits: set[tuple[int, int]] = set()  # (epoch, step) reported committed
        self.commit_epoch = -1  # the newest epoch a step committed in
        self.logged_before = (-1, -1)  # (epoch, step): commits already in the event log
        # nodes whose first census since this coordinator took the task over (Coordinator.adopt)
        # is not in: it says which workers outlived the old coordinator
        self.adopting: set[int] = set()
        self.last_error = ""
        # -- what the workers told
        self.microbatches: int | None = None  # per global batch, learned from the workers
        self.state_bytes = 0  # the task's state (model + optimizer), learned from the workers
        self.cpu = CpuTimes()  # starved or hung: the workers' CPU time (unicron.detect.busy)
        # -- nodes
        self.nodes: set[int] = set()  # nodes whose agent is attached
        self.heartbeats: dict[int, float] = {}  # node -> when its agent was last heard from
        self.asked_s: dict[int, float] = {}  # node -> the rhythm its last answer asked for
        self.lateness: dict[int, tuple[float, float]] = {}  # node -> (late by, at) (health)
        self.suspects_from = 0.0  # no suspect confirmed before (adoption: agents reconnect)
        self.logged_pace_s: float | None = None  # an adopted task's step time, from its log
        self.adopted_at: float | None = None  # adopted then; None once a step committed since
        self.moved_at: float | None = None  # the store moved or the task was adopted then
        self.read_until: dict[int, float] = {}  # node -> its reports are all in up to then
        self.lost_nodes: set[int] = set()
        # slots the cluster could give beyond the task's own (free, or other running tasks'
        # above their minimums: planning.spare_slots), set by each tick of the cluster's
        self.spare_slots = 0
        self.last_tick: float | None = None
        self.exited = False  # a worker exited since the store's ``usage`` key was last read
        # -- decided, not yet carried out
        self.effects: list[Effect] = []

    # -- questions ---------------------------------------------------------------------------
    def active(self) -> bool:
        """RUNNING or WAITING."""
        return self.state in (TaskState.RUNNING, TaskState.WAITING)

    def over(self) -> bool:
        """The task is done or failed (waiting workers are leaving)."""
        return self.state in (TaskState.DONE, TaskState.FAILED)

    @property
    def size(self) -> int:
        """Ranks per replica in the current epoch (``tp * pp`` of its layout)."""
        return self.size_at(self.layout)

    def size_at(self, layout: tuple[int, int]) -> int:
        """Ranks per replica at ``layout`` (``(tp, pp)``; ``(0, 0)``: the task's own)."""
        tp, pp = self.lay_at(layout)
        return tp * pp

    @property
    def lay(self) -> tuple[int, int]:
        """The current epoch's ``(tp, pp)``, the task's own spelled out."""
        return self.lay_at(self.layout)

    def lay_at(self, layout: tuple[int, int]) -> tuple[int, int]:
        """``layout`` spelled out (``(0, 0)``: the task's own)."""
        return layout if layout[0] else self.settings.own

    def place(self, slot: int) -> int:
        """``slot``'s place in its replica at the task's own layout: the shard its worker
        builds when it starts (:class:`~unicron.messages.Spawn`)."""
        own = self.settings.own
        if own[0] * own[1] == 1:
            return 0
        return replicas.place(self.slots, slot, own)

    def other_holders(self, slot: int) -> list[int]:
        """The live slots other than ``slot`` that surely hold a copy of what it holds (model
        parallel: its shard, at the same place of another replica, counted at the layout
        each holds its state in: :meth:`shards`). Where ``slot`` enters another layout (it
        holds the one shard or the other) both need a copy; a holder that enters one is
        sure of neither, and counts for none. With :attr:`CoordinatorSettings.zero` a
        member has none unless :meth:`_shares_doubled`: it may keep a share's last copy."""
        if self.settings.zero and slot in self.members and not self._shares_doubled(slot):
            return []
        others = [h for h in self.slots.holders() if h != slot]
        sure = {h: got for h in others if len(got := self.shards(h)) == 1}
        mine = self.shards(slot)
        if not all(any(got == {shard} for got in sure.values()) for shard in mine):
            return []  # a shard of its has no sure copy: losing it may lose the state
        return [h for h in others if h in sure and sure[h] <= mine]

    def _shares_doubled(self, slot: int) -> bool:
        """ZeRO with a buddy: each share of the optimizer state is on two members of the
        place's data-parallel group once a step committed in the epoch (its ledger exchange
        redistributed the shares of members lost before); losing ``slot`` then loses nothing
        while every other member of the group is alive and not being killed. (Found beside
        CPU burners: two members of a three-member epoch killed as hung in one step, each
        counting on the other's copy: a share lost, the task failed.)"""
        if self.commit_epoch != self.epoch:
            return False
        held, lay, size = set(self.slots.holders()), self.lay, self.size

        def at(m: int) -> int:
            return replicas.place(self.slots, m, lay) if size > 1 else 0

        mine = at(slot)
        return all(m in held for m in self.members if m != slot and at(m) == mine)

    def shards(self, slot: int) -> set[tuple[tuple[int, int], int]]:
        """What the worker in ``slot`` may hold of the task's state, as ``((tp, pp), place)``:
        its shard at the layout of its state (:attr:`Slot.state_lay`) and, while it enters
        an epoch at another (:attr:`Slot.entering_lay`: which of the two it holds then is not
        known here), its shard there too. A layout of one rank a replica has one place: 0."""
        o = self.slots[slot]
        out: set[tuple[tuple[int, int], int]] = set()
        for at in {o.state_lay, o.entering_lay or o.state_lay}:
            lay = self.lay_at(at)
            out.add((lay, replicas.place(self.slots, slot, lay) if lay != (1, 1) else 0))
        return out

    def shards_of(self, slots: Iterable[int]) -> set[tuple[tuple[int, int], int]]:
        """What the workers in ``slots`` may hold of the task's state together (:meth:`shards`
        of each)."""
        return {shard for s in slots for shard in self.shards(s)}

    def state_held(self) -> bool:
        """Some live slots hold the task's state: at the layout each holds it in
        (:meth:`shards`; while it enters an epoch at another, either), every place's shard,
        or one holder of a layout of one rank a replica (the whole model). A member of a
        TP=1 epoch still holds the whole model while the epoch back at TP=2 is only
        announced or being entered (found beside CPU burners: a hang kill then failed the
        task as if its state were gone). A live member that entered the current epoch counts
        too: its state is handed over there, and its first step's report may be held for the
        exchange's rhythm (if the hand-over fails, its worker exits for want of a source),
        where a member holding its shard, or members holding all of the state, entered it
        too (:meth:`_entered`)."""
        held = [*self.slots.holders(), *self._entered()]
        if not held:
            return False
        if not self.trained:
            return True  # no step committed: any worker builds the state again
        return whole(self.shards_of(held))

    def _entered(self) -> list[int]:
        """Live members, not being killed, whose workers entered the current epoch where a
        member that held their shard at the epoch's layout, or members that held all of the
        state (at another layout it is resharded from all of it), entered it too
        (:attr:`sources`): without one no hand-over there gave them anything (found beside
        CPU burners: the last holder failed in its own step before it entered the epoch its
        joiners entered; they counted as holders, and the task failed a restart later on
        their "no member of the epoch holds the model state" instead of the holder's
        error)."""
        sources = self.sources.get(self.epoch, set())
        every, now = whole(sources), self.lay_at(self.layout)
        return [
            m
            for m in self.members
            if (o := self.slots[m]).alive
            and o.killed_at is None
            and o.progress is not None
            and o.progress.epoch == self.epoch
            and (every or any(lay == now for lay, _ in self.shards(m) & sources))
        ]

    def confirm_entered(self) -> None:
        """When the task goes on after a loss only because members that entered the current
        epoch count (:meth:`state_held`: the holders alone do not hold all of the state),
        those of them with a shard the holders lack hold it from now on, at the epoch's
        layout: the task bet on them, and they are the sources of the next epoch (found in
        review: a joiner the task waited on, as the last holder, counted for nothing once the
        next epoch was announced). A joiner the holders did not need is left as it is: an
        entry is said before the rendezvous, and it may never have been given anything (made
        a holder, it hid the last real copy from the judges that spare one). Called by
        :func:`unicron.control.membership.reform` once it goes on."""
        held = self.shards_of(self.slots.holders())
        if not self.trained or whole(held):
            return
        lay = self.epoch_layouts.get(self.epoch, self.layout)
        for m in self._entered():
            if self.shards(m) - held:
                o = self.slots[m]
                o.has_state, o.state_lay, o.entering_lay = True, lay, None

    def has_checkpoint(self) -> bool:
        """The task has a persistent checkpoint to fall back on (read from its directory)."""
        settings = self.settings
        return self._checkpoint_exists(settings.checkpoint, settings.own, settings.layouts)

    def state_survives(self, slot: int) -> bool:
        """Whether the task's state outlives the worker in ``slot``: another live replica
        holds it, or there is a checkpoint."""
        return bool(self.other_holders(slot)) or self.has_checkpoint()

    def known_until(self, now: float) -> dict[int, float]:
        """Per slot, the moment up to which its worker's reports are in (its agent's last
        read; ``now`` for a node not heard from yet, or lost)."""
        return {
            s: now if o.node in self.lost_nodes else min(now, self.read_until.get(o.node, now))
            for s, o in self.slots.items()
        }

    # -- effects -----------------------------------------------------------------------------
    def emit(self, name: str, /, **fields: Any) -> None:
        """An event-log record."""
        self.effects.append(LogEvent(name, fields))

    def send(self, node: int, action: AgentAction) -> None:
        """An action for the agent of ``node``."""
        self.effects.append(Tell(node, action))

    def started(self, slot: int) -> None:
        """A worker is being started in ``slot`` (this coordinator's ``Spawn``, or a new
        agent's own start): a model it builds, the task's state only before the first commit."""
        s = self.slots[slot]
        s.start(self.epoch)
        s.has_state = s.fresh = not self.trained
        self.forget(slot)

    def new_agent(self, node: int, now: float) -> None:
        """A new agent of ``node`` is heard from at ``now``: nothing asked of it yet, none of
        the old one's lateness (:func:`unicron.control.health.lateness`)."""
        self.forget_node(node)
        self.heartbeats[node] = now

    def forget_node(self, node: int) -> None:
        """Drop what this coordinator knows of the agent of ``node``: when it was heard, how
        far its reports go, the rhythm asked of it, its lateness."""
        for table in (self.heartbeats, self.read_until, self.asked_s, self.lateness):
            table.pop(node, None)

    def spawn(self, slot: int) -> None:
        """Start a worker in ``slot`` (a restart, a readmission)."""
        self.started(slot)
        self.send(self.slots[slot].node, Spawn(slot, place=self.place(slot)))

    def kill(self, slot: int, verdict: Verdict | None, now: float) -> None:
        """Stop the worker in ``slot``; its exit comes back as a failure. Until then it
        counts as holding no state (:meth:`SlotTable.holders`), and as a kill under way
        (:meth:`SlotTable.kills_under_way`)."""
        s = self.slots[slot]
        s.killed_at, s.kill_verdict = now, verdict
        self.send(s.node, Kill(slot, verdict))

    def forget(self, slot: int) -> None:
        """Drop what the detectors know of the worker in ``slot`` (gone, or restarting)."""
        self.slots[slot].forget()
        self.cpu.forget(slot)
        if self.monitor is not None:
            self.monitor.forget(slot)

    def action(self, action: Action, slot: int, reason: str, severity: int, now: float) -> None:
        """An ``action`` event about ``slot``."""
        self.emit(
            "action",
            ts=now,
            task=self.label,
            epoch=self.epoch,
            rank=slot,
            slot=slot,
            node=self.slots[slot].node,
            action=str(action),
            severity=severity,
            reason=reason,
        )

    def detected(
        self,
        slot: int,
        step: int | None,
        verdict: Verdict,
        ts: float,
        method: str,
        *,
        reason: str | None = None,
        **extra: Any,
    ) -> None:
        """One ``error_detected`` event about the worker in ``slot``."""
        self.emit(
            "error_detected",
            ts=ts,
            task=self.label,
            rank=slot,
            slot=slot,
            node=self.slots[slot].node,
            step=step,
            kind=verdict.kind,
            severity=int(verdict.severity),
            method=method,
            reason=reason or verdict.reason,
            **extra,
        )
