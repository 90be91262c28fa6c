"""A task's coordinator: one per task. Owns the task's membership and decides every epoch.

The cluster service (:mod:`unicron.control.cluster`, which ``unicron run`` also runs, on this
machine) builds one per task, on a client connection to the cluster's store (keys scoped by
task and epoch, :mod:`unicron.control.protocol`); a coordinator built without one serves a
``TCPStore`` of its own (the unit tests). It turns what the task's supervisors report (a
worker ready, failed, raised, began or finished a step, entered an epoch, finished) into
decisions through the escalation policy (:mod:`unicron.control.escalation`), runs the task's
detectors (the step monitor, :mod:`unicron.detect.monitor`, over every worker of the task
whatever its node; the stall check, :mod:`unicron.detect.stall`; node heartbeats), and
announces epochs.

Who calls what: a supervisor (:mod:`unicron.control.agent`, on each node) calls only
:meth:`Coordinator.exchange` with its round's typed reports (:mod:`unicron.control.messages`,
in-process or through ``POST /v1/agents/{node}/tasks/{uid}/exchange``); the reply carries
the actions queued for its node (start, kill or probe a worker). The cluster calls
:meth:`~Coordinator.tick` and :meth:`~Coordinator.check_input` from its ticker, the planner's
moves (:meth:`~Coordinator.add_slot`, :meth:`~Coordinator.release_slots`),
:meth:`~Coordinator.node_returned` and, after a restart, :meth:`~Coordinator.adopt`. Every
method takes the coordinator's lock; nothing here blocks or calls an agent.

Decide, then do: the decision methods change only the coordinator's own state (slots,
members, epoch, detectors) and describe everything else as effects
(:mod:`unicron.control.effects`: an event-log record, a store key, an epoch announced, an
action for a node's agent). When the outermost decision of a call ends, an
:class:`~unicron.control.effects.Executor` carries them out in order.
:meth:`~Coordinator.decide_exchange` and :meth:`~Coordinator.decide_tick` return them instead,
undone (``tests/test_decide.py``).

Each slot's lifecycle is a :class:`SlotState` (its diagram is there); a move it does not draw
raises :class:`IllegalTransition`.

Task states (:class:`TaskState`)::

    PENDING --first epoch--> RUNNING <--> WAITING (below the minimum, capacity may come back)
       RUNNING | WAITING --> DONE (the last step committed) | FAILED (nothing left to heal,
                                                                or the give-up deadline passed)
"""

from __future__ import annotations

import contextlib
import datetime as dt
import enum
import logging
import math
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from unicron.control import messages as M
from unicron.control.effects import (
    AnnounceEpoch,
    Effect,
    Executor,
    LogEvent,
    Tell,
    WriteStoreKey,
)
from unicron.control.escalation import Decision, Escalation
from unicron.control.events import EventLog
from unicron.control.messages import AgentAction, Kill, Probe, Reply, Spawn
from unicron.control.protocol import (
    EpochInfo,
    done_key,
    epoch_info_key,
    epoch_key,
    trained_key,
    usage_key,
)
from unicron.detect.busy import Cpu, CpuTimes, Sample, own_compute_s
from unicron.detect.classify import (
    Action,
    Scope,
    Severity,
    Verdict,
    classify_detector,
    classify_exit,
)
from unicron.detect.monitor import StepMonitor
from unicron.detect.stall import Phase, Progress, find_stall, stall_deadline_s
from unicron.runtime.checkpoint import has_checkpoint

log = logging.getLogger("unicron.control.coordinator")

PROBE_BACKOFF_MAX = 8.0
"""the probe cool-down doubles per exclusion up to this many times ``readmit_after_s`` (8 min
at the default), so a slot that failed often is still probed before the default give-up
deadline (10 min) of a task waiting for it"""

FAST_EXCHANGE_S = 0.05
"""the rhythm asked of a node the coordinator waits on (:meth:`Coordinator.next_exchange_s`);
the slow rhythm is half of ``suspect_after_s``, so a healthy idle node is never suspect"""

INPUT_CHECK_S = 1.0
"""how often :meth:`Coordinator.check_input` reads the store when no worker exited meanwhile
(a store request per task per tick was most of the ticker's cost)"""

LONE_HANG_OVERRUN = 2.0
"""a step past its hang allowance is confirmed hung when every other member finished it;
with only some of them done, or alone in its epoch (no peer to vouch; killing costs a
checkpoint reload), once it has lasted this many times its allowance"""


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
    start_timeout_s: float = 120.0
    """the first epoch starts with the ready workers after this long, if they are enough"""
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


MIN_COPIES = 2
"""a straggler is dropped only if at least this many other workers hold the task's state: with
one copy left, the next fault of any kind rolls the task back to its checkpoint (the fault soak
lost 3 steps so: a slow worker dropped from two, then a crash of the last one)"""


class SlotState(enum.Enum):
    """Where one of the task's slots stands: whether a worker runs there (and is ready), and
    whether the slot is in the plan, excluded from it, or given to another task. Every change
    goes through :meth:`_Slot.to`, which refuses a move not drawn here::

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
    and STOPPING (:attr:`_Slot.alive`); READY and OUT_READY reported ready; all but STARTING,
    READY and DOWN are out of the plan (:attr:`_Slot.excluded`: no epoch includes them). A
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


class IllegalTransition(RuntimeError):
    """A slot asked to move where :class:`SlotState`'s diagram does not go: a bug here."""


@dataclass
class _Slot:
    """One slot of the task: its node, its :class:`SlotState`, and facts that are not its
    lifecycle (what its worker holds, its last error, its final report)."""

    node: int
    state: SlotState = SlotState.STARTING
    done: dict[str, Any] | None = None
    last_error: str = ""
    has_state: bool = True  # it holds the task's committed state (or will after a sync)
    fresh: bool = True  # started while no step had committed, and has computed none since

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

    # -- the moves, by what happened ----------------------------------------------------------
    def start(self) -> None:
        """A worker is (being) started here (a restart, or a lost node's new agent)."""
        self.to(_S.STARTING)

    def readied(self) -> None:
        """Its worker reported ready."""
        moves = {_S.STARTING: _S.READY, _S.DOWN: _S.READY, _S.OUT_STARTING: _S.OUT_READY}
        moves[_S.EXCLUDED] = _S.OUT_READY
        self.to(moves.get(self.state, self.state))

    def gone(self) -> None:
        """Its worker is gone (or doomed: killed, not a member of the next epoch)."""
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
            self.gone()
        elif ready:
            self.readied()
        else:
            moves = {_S.READY: _S.STARTING, _S.DOWN: _S.STARTING}
            moves |= {_S.OUT_READY: _S.OUT_STARTING, _S.EXCLUDED: _S.OUT_STARTING}
            self.to(moves.get(self.state, self.state))


@dataclass
class Outcome:
    """How the task ended, for the runner's exit code and report."""

    state: TaskState
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    usage: bool = False  # failed on bad input (a worker's check before training): exit 2


class Coordinator:
    """Membership, detection and decisions for one task (see the module docstring)."""

    def __init__(
        self,
        *,
        task: str,
        slots: dict[int, int],
        events: EventLog,
        escalation: Escalation,
        settings: CoordinatorSettings,
        monitor: StepMonitor | None = None,
        host: str = "127.0.0.1",
        store: tuple[dist.Store, str] | None = None,
        label: str | None = None,
    ) -> None:
        self.task = task  # scopes its store keys: unique on the store
        self.label = label or task  # its name in the event log
        self.events = events
        self.escalation = escalation
        self.settings = settings
        self.monitor = monitor
        self.slots = {s: _Slot(node=n) for s, n in slots.items()}
        self.nodes: set[int] = set()  # nodes whose agent is attached
        self.state = TaskState.PENDING
        self.epoch = 0
        self.members: tuple[int, ...] = ()
        self.outcome: Outcome | None = None
        self.started_at: float | None = None
        self.waiting_since: float | None = None
        self.waiting_reason = ""
        self.microbatches: int | None = None  # per global batch, learned from the workers
        self.state_bytes = 0  # the task's state (model + optimizer), learned from the workers
        self.heartbeats: dict[int, float] = {}  # node -> when its agent was last heard from
        self._read_until: dict[int, float] = {}  # node -> its reports are all in up to then
        self.lost_nodes: set[int] = set()
        self._outbox: dict[int, deque[AgentAction]] = {n: deque() for n in set(slots.values())}
        self._pending_errors: dict[int, tuple[float, Verdict, int]] = {}  # slot -> ts, v, epoch
        self._last_failure_ts = float("-inf")
        self._lock = threading.RLock()
        self._computed: dict[int, int] = {}  # slot -> last step it finished computing
        self._progress: dict[int, Progress] = {}  # slot -> where its worker last said it was
        self._mb_compute_s: dict[int, float] = {}  # slot -> its latest compute time per mb
        self._suspects: dict[int, tuple[int, Verdict, str]] = {}  # slot -> step, verdict, why
        self._cpu = CpuTimes()  # starved or hung: the workers' CPU time (unicron.detect.busy)
        self._held: dict[int, int] = {}  # slot -> the step its CPU time held a kill back in
        self._trained = False  # a step committed: a fresh worker's model is no longer the state
        self._commits: set[tuple[int, int]] = set()  # (epoch, step) reported committed
        self._last_error = ""
        self._last_tick: float | None = None
        self._excluded_at: dict[int, float] = {}  # slot -> when it was excluded (or re-probed)
        self._exclusions: dict[int, int] = {}  # slot -> times excluded: the probe backoff
        self._readmitted_at: dict[int, float] = {}  # slot -> when it last came back
        self._probing: set[int] = set()
        self._kept: set[int] = set()  # slots of an excluded node running the last copies
        self._adopted = False  # took over a running task after a restart (see adopt)
        self._logged_before = (-1, -1)  # (epoch, step): commits already in the event log
        self._released: set[int] = set()  # given back, worker gone, not yet told the cluster
        self._input_checked = -math.inf  # when check_input last read the store
        self._exited = False  # a worker exited since then (one that found bad input does)
        if store is None:  # a store of its own, served from this process
            self.store: dist.Store = dist.TCPStore(
                host, 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60)
            )
            self.store_address = f"{host}:{self.store.port}"
        else:  # a client of the cluster's store (:mod:`unicron.control.store`), which outlives us
            self.store, self.store_address = store
        self._effects: list[Effect] = []  # decided, not yet carried out
        self._depth = 0  # decisions in progress (one calls another): the outermost executes
        self.executor = Executor(store=self.store, events=events, outbox=self._outbox)

    def adopt(self, now: float, *, committed_step: int = -1) -> None:
        """Take over the task as its workers left it when the previous coordinator died: the
        current epoch and members from the store (which outlived it), every slot presumed alive
        until its agent's :class:`~unicron.control.messages.Census` says otherwise, every node
        heard from now (its agent reconnects within its backoff). Called once, before the
        first exchange, by the cluster service for each task it finds running in its state."""
        with self._deciding():
            self._adopted = True
            if not self.store.check([epoch_key(self.task)]):
                return  # no epoch was announced: it starts as a new task does
            self.epoch = int(self.store.get(epoch_key(self.task)).decode())
            # members of this epoch or older report commits the old coordinator logged
            self._logged_before = (self.epoch, committed_step)
            info = EpochInfo.from_json(self.store.get(epoch_info_key(self.task, self.epoch)))
            self.members = info.members
            self._trained = self.store.check([trained_key(self.task)])
            self.state = TaskState.RUNNING if self.members else TaskState.WAITING
            if self.state is TaskState.WAITING:
                self.waiting_since, self.waiting_reason = now, "adopted with no members"
            for slot, o in self.slots.items():
                if slot in self.members:
                    o.readied()
                o.has_state = self._trained or slot in self.members
                o.fresh = not self._trained
            for node in set(o.node for o in self.slots.values()):
                self.heartbeats[node] = now
            self._last_tick = now

    def attach(self, node: int) -> None:
        """The agent of ``node`` is up and takes its actions (:meth:`take_actions`)."""
        with self._deciding():
            self.nodes.add(node)
            self._outbox.setdefault(node, deque())

    def exchange(
        self, node: int, reports: list[M.Report], now: float, *, read_until: float | None = None
    ) -> Reply:
        """One round of the agent of ``node``: decide (:meth:`decide_exchange`), carry the
        decisions out, and answer with the node's queued actions. The only call an agent makes
        (in-process from :mod:`unicron.control.runner`'s agents, or through the cluster
        service's HTTP API)."""
        with self._lock:
            self.executor.run(self.decide_exchange(node, reports, now, read_until=read_until))
            return Reply(
                actions=tuple(self.take_actions(node)),
                over=self.over(),
                finished=self.finished(),
                next_s=self.next_exchange_s(node, now),
            )

    def decide_exchange(
        self, node: int, reports: list[M.Report], now: float, *, read_until: float | None = None
    ) -> list[Effect]:
        """Apply the ``reports`` of the agent of ``node`` in order and take its heartbeat
        (every report its workers sent before ``read_until`` is in ``reports``); run the
        detectors (:meth:`tick`) at ``now`` only when this exchange must judge at once
        (:meth:`_judge_now`), else the cluster's ticker does within its period. Return what
        that decided to do, not yet done."""
        with self._collecting() as effects:
            self.attach(node)
            # bad input first: the exits it causes (read in the same round) are not failures
            for report in sorted(reports, key=lambda r: not isinstance(r, M.BadInput)):
                try:
                    self._apply(node, report)
                except Exception:  # one bad report must not stop the task's control
                    log.exception("task %s: could not apply %r", self.task, report)
            self.heartbeat(node, now, read_until=read_until)
            if self._judge_now(node, now):
                self.tick(now)
        return effects

    def _judge_now(self, node: int, now: float) -> bool:
        """Whether an exchange of ``node`` runs the detectors itself instead of leaving them
        to the ticker: when a worker of the node is past its hang deadline as far as its
        reports go (the exchange the rhythm timed for that deadline, :meth:`next_exchange_s`:
        the hang is judged there and its kill goes out in this very reply), while a hang is
        suspected and waits on evidence (CPU samples, peers' steps), and while an in-band
        error waits out its grace period (a suspect node is then lost at once). Most
        exchanges (step reports, idle rounds) judge nothing: the detectors' cost is the
        ticker's, once per period, not once per request (docs/cluster.md, The rhythm)."""
        if not self._active():
            return False
        if self._suspects or self._pending_errors:
            return True
        if self.monitor is None:
            return False
        at = min(now, self._read_until.get(node, now))
        return any(o.node == node and self.monitor.due(s, at) for s, o in self.slots.items())

    def decide_tick(self, now: float) -> list[Effect]:
        """What the passing of time decides at ``now`` (:meth:`tick`), not yet done."""
        with self._collecting() as effects:
            self.tick(now)
        return effects

    @contextlib.contextmanager
    def _deciding(self) -> Iterator[None]:
        """Hold the lock while deciding; the outermost decision carries out its effects (in
        the order decided) as it ends, also when it raised."""
        with self._lock:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._effects:
                    effects, self._effects = self._effects, []
                    self.executor.run(effects)

    @contextlib.contextmanager
    def _collecting(self) -> Iterator[list[Effect]]:
        """Hold the lock while deciding, and hand the effects decided to the caller instead
        of carrying them out."""
        out: list[Effect] = []
        with self._lock:
            self._depth += 1
            start = len(self._effects)
            try:
                yield out
            finally:
                self._depth -= 1
                out += self._effects[start:]
                del self._effects[start:]

    def _apply(self, node: int, r: M.Report) -> None:
        slot = getattr(r, "slot", None)
        if slot is not None and slot not in self.slots:
            return  # a slot given to another task meanwhile: nothing of it matters here
        if isinstance(r, M.Detected | M.WorkerFailed) and self.finished():
            return  # the task is over (e.g. failed on bad input): its exits heal nothing
        if isinstance(r, M.Ready):
            self.worker_ready(r.slot, r.ts, microbatches=r.microbatches, state_bytes=r.state_bytes)
        elif isinstance(r, M.EpochEntered):
            self.epoch_entered(r.slot, r.epoch, r.ts)
        elif isinstance(r, M.StepBegan):
            self.step_started(r.slot, r.step, r.ts, epoch=r.epoch, cpu_s=r.cpu_s)
        elif isinstance(r, M.StepComputed):
            self.step_computed(
                r.slot,
                r.step,
                r.ts,
                compute_s=r.compute_s,
                microbatches=r.microbatches,
                cpu_s=r.cpu_s,
                queued_s=r.queued_s,
            )
        elif isinstance(r, M.CpuTime):
            self._cpu.sampled(r.slot, Sample(r.ts, r.cpu_s, r.queued_s))
        elif isinstance(r, M.Event):
            self._event(r)
        elif isinstance(r, M.Detected):
            if r.extra.get("returncode") == 0 and self.over():
                return  # left because the task ended (the agent had not heard yet): no error
            self.detected(r.slot, r.step, r.verdict, r.ts, r.method, **r.extra)
        elif isinstance(r, M.WorkerError):
            self.worker_error(r.slot, r.verdict, r.ts, in_place=r.in_place, epoch=r.epoch)
        elif isinstance(r, M.WorkerFailed):
            self.worker_failed(r.slot, r.verdict, r.ts)
        elif isinstance(r, M.WorkerLeft):
            self.worker_left(r.slot)
        elif isinstance(r, M.WorkerDone):
            self.worker_done(r.slot, r.report, r.ts)
        elif isinstance(r, M.BadInput):
            self.fail(r.message, r.ts, usage=True)
        elif isinstance(r, M.ProbeDone):
            self.probe_done(r.slot, r.ok, r.detail, r.ts)
        elif isinstance(r, M.ProbeNotStarted):
            self.probe_not_started(r.slot, r.error, r.ts)
        elif isinstance(r, M.Census):
            self.census(node, r)
        else:
            raise TypeError(f"not a report: {r!r}")

    def _event(self, r: M.Event) -> None:
        """A worker's event-log record: one ``step_end`` per committed step (every member
        reports it), the steps a fallback to a checkpoint redoes added to its
        ``transition_end``."""
        fields = dict(r.fields)
        if "task" in fields:
            fields["task"] = self.label
        if r.name == "step_end" and not self.step_committed(fields["epoch"], fields["step"], r.ts):
            return
        if r.name == "transition_end" and fields.get("state_source") == "checkpoint":
            fields["steps_redone"] = self.steps_redone(fields["step"])
        self._emit(r.name, **fields)

    def census(self, node: int, r: M.Census) -> None:
        """An agent's account of its workers, sent when it (re)connects. A coordinator that
        adopted a running task after a restart (:meth:`adopt`) learns from it which workers
        live; to one that never went away it says nothing new."""
        with self._deciding():
            if not self._adopted:
                return
            for slot, o in self.slots.items():
                if o.node != node:
                    continue
                alive = slot in r.alive
                o.seen(alive=alive, ready=slot in r.ready or (alive and slot in self.members))
                if not o.alive and slot in self.members and not o.excluded:
                    # gone while nobody listened: its exit report was lost with the old
                    # coordinator; heal it as a process failure now
                    self.worker_failed(slot, classify_exit(-9), r.ts)

    def take_actions(self, node: int) -> list[AgentAction]:
        """What the agent of ``node`` must do now, in order (called by that agent's thread)."""
        with self._lock:
            box = self._outbox.get(node)
            if not box:
                return []
            actions = list(box)
            box.clear()
            return actions

    # -- reports from agents ----------------------------------------------------------------
    def worker_ready(
        self, slot: int, now: float, *, microbatches: int | None = None, state_bytes: int = 0
    ) -> None:
        """The worker in ``slot`` built its model and waits for an epoch."""
        with self._deciding():
            self.slots[slot].readied()
            self.microbatches = microbatches or self.microbatches
            self.state_bytes = max(self.state_bytes, state_bytes)
            self.tick(now)

    def worker_failed(self, slot: int, verdict: Verdict, now: float) -> None:
        """The worker process in ``slot`` is gone (the agent already logged the detection)."""
        with self._deciding():
            self._exited = True
            s = self.slots[slot]
            s.gone()
            if s.leaving:  # given back anyway: no healing, the slot is the task's no more
                self.worker_left(slot)
                self._reform(now, f"slot {slot} released")
                return
            s.last_error = verdict.reason
            self._last_failure_ts = now
            self._forget(slot)
            if self.over():
                return
            self._last_error = verdict.reason
            kept = self._keeps_last_copies(slot)
            if s.excluded and not kept:
                # taken out already (a dropped straggler, a slot excluded on its own account)
                self._kept.discard(slot)
                self._reform(now, f"slot {slot} excluded")
                return
            decision = self.escalation.decide(
                verdict, slot=slot, node=s.node, now=now, last_copies=kept
            )
            self._action(decision.action, slot, decision.reason, int(decision.severity), now)
            excluded = decision.exclude_slot or decision.action is Action.EXCLUDE
            # the failure that tipped its node over, the slot itself under its limits: it is
            # kept like the node's living workers if the state now lives only there
            tipped = decision.exclude_node and not decision.exclude_slot
            in_place = (kept and not excluded) or (tipped and self._state_only_on(s.node, slot))
            if excluded and not in_place:
                self._exclude(slot, now)
            if decision.exclude_node or (
                verdict.scope is Scope.NODE and decision.action is Action.EXCLUDE
            ):
                self._exclude_node(s.node, verdict, now)
            if in_place:
                # restarted in place (kept): in the plan, to take the state from its
                # neighbours when it joins
                if excluded:
                    reason = (
                        f"slot {slot}: restart in place (node {s.node} is excluded but holds "
                        "the task's last copies)"
                    )
                    self._action(Action.RESTART, slot, reason, int(Severity.SEV2), now)
                self._kept.add(slot)
                s.readmit()
                self._excluded_at.pop(slot, None)
            else:
                self._kept.discard(slot)
            if not self._reform(now, f"slot {slot} lost: {verdict.kind}"):
                return
            if not s.excluded:
                self._spawn(slot)

    def worker_error(
        self, slot: int, verdict: Verdict, now: float, *, in_place: bool, epoch: int | None = None
    ) -> None:
        """An error raised inside a living worker (in-band).

        ``in_place``: the worker already retried the step in place (SEV3), and the decision is
        only recorded, unless the escalation says the retries are used up (then the worker is
        restarted). Otherwise a collective of ``epoch`` failed and the worker left it to wait
        for a newer epoch: it is healed in :meth:`tick` (a newer epoch announced meanwhile, for
        a process or node failure, heals it too).
        """
        with self._deciding():
            if not in_place:
                epoch = self.epoch if epoch is None else epoch
                if epoch >= self.epoch:
                    self._progress[slot] = Progress(epoch, Phase.LEFT, -1, now)
                self._pending_errors.setdefault(slot, (now, verdict, epoch))
                return
            decision = self._decide_in_band(slot, verdict, now)
            self._action(decision.action, slot, decision.reason, int(decision.severity), now)
            if decision.action is not Action.REATTEMPT:
                self._kill(slot, verdict)

    def _decide_in_band(self, slot: int, verdict: Verdict, now: float) -> Decision:
        """The escalation's decision on an in-band error, except for a worker kept running on
        an excluded slot or node (the last copies of the state): a transient (SEV3) error there
        is reattempted, never a reason to kill the state's last holder."""
        s = self.slots[slot]
        if s.excluded and s.alive and verdict.severity is Severity.SEV3:
            reason = (
                f"{verdict.kind} on slot {slot}: reattempt (kept on an excluded slot or node: it "
                "holds the state and goes on until it fails)"
            )
            return Decision(Action.REATTEMPT, Severity.SEV3, reason, kind=verdict.kind)
        kept = self._keeps_last_copies(slot)
        return self.escalation.decide(verdict, slot=slot, node=s.node, now=now, last_copies=kept)

    def _keeps_last_copies(self, slot: int) -> bool:
        """The worker in ``slot`` (failed, or failing) was kept running on an excluded node
        because the task's state lived only there, and the other copies still do: a failure
        of its own restarts it in place (:meth:`worker_failed`), within its own restart limit,
        so that the node keeps two copies or more until its health probe brings it back (each
        failure there used to cost a copy, and the last one a rollback to the checkpoint)."""
        node = self.slots[slot].node
        if slot not in self._kept or node not in self.escalation.excluded_nodes():
            return False
        return self._state_only_on(node, slot)

    def _state_only_on(self, node: int, slot: int) -> bool:
        """Workers other than ``slot``'s hold the task's state, all of them on ``node``."""
        others = self._other_holders(slot)
        return bool(others) and all(self.slots[h].node == node for h in others)

    def _other_holders(self, slot: int) -> list[int]:
        """The live slots other than ``slot`` that hold the task's state."""
        return [h for h in self._holders() if h != slot]

    def epoch_entered(self, slot: int, epoch: int, now: float) -> None:
        """The worker in ``slot`` entered ``epoch`` (rendezvous, ledger exchange, state)."""
        with self._deciding():
            self._progress[slot] = Progress(epoch, Phase.JOIN, -1, now)

    def step_started(
        self,
        slot: int,
        step: int,
        now: float,
        *,
        epoch: int | None = None,
        cpu_s: float | None = None,
    ) -> None:
        """The worker in ``slot`` began computing ``step``: the monitor's clock starts."""
        with self._deciding():
            known = self._progress.get(slot)
            ep = epoch if epoch is not None else (known.epoch if known else self.epoch)
            self._progress[slot] = Progress(ep, Phase.COMPUTE, step, now)
            self._cpu.began(slot, step, None if cpu_s is None else Sample(now, cpu_s))
            if self.monitor is not None:
                self.monitor.step_started(slot, step, now)

    def step_computed(
        self,
        slot: int,
        step: int,
        now: float,
        *,
        compute_s: float = math.nan,
        microbatches: int | None = None,
        cpu_s: float | None = None,
        queued_s: float | None = None,
    ) -> None:
        """The worker in ``slot`` finished computing ``step`` (it now reduces): it holds the
        state; the monitor learns the step time. Stragglers are judged on the compute time
        without ``queued_s``, the part its thread waited for a CPU (:mod:`unicron.detect.busy`):
        an oversubscribed machine's run queue is not the worker's speed."""
        with self._deciding():
            self._computed[slot] = step
            self._cpu.computed(slot, step, cpu_s)
            s = self.slots[slot]
            s.has_state, s.fresh = True, False
            known = self._progress.get(slot)
            ep = known.epoch if known else self.epoch
            self._progress[slot] = Progress(ep, Phase.REDUCE, step, now)
            own_s = own_compute_s(compute_s, queued_s)
            if microbatches:
                self._mb_compute_s[slot] = own_s / microbatches
            if self.monitor is not None:
                self.monitor.step_finished(slot, step, own_s, now, microbatches=microbatches)
            self.escalation.healthy(slot=slot, now=now)

    def step_committed(self, epoch: int, step: int, now: float) -> bool:
        """A member reports that ``step`` committed in ``epoch``. True for the first report of
        it (every member sends one; the event log keeps one). The first commit makes a freshly
        built model no longer the task's state: the coordinator is the one source of that fact
        (the ``trained`` store key, which starting workers read, is written here)."""
        with self._deciding():
            key = (epoch, step)
            if key in self._commits:
                return False
            old_epoch, old_step = self._logged_before
            if epoch <= old_epoch and step <= old_step:
                return False  # logged by the coordinator this one took over from
            self._commits.add(key)
            if not self._trained:
                self._trained = True
                self._effects.append(WriteStoreKey(trained_key(self.task), "1"))
                for o in self.slots.values():
                    if o.fresh:  # a fresh model started before the first commit: not the state
                        o.has_state = False
            return True

    def worker_slow(self, slot: int, verdict: Verdict, now: float) -> None:
        """A straggler: ask the planner whether the task's WAF is higher without it; act on
        the answer (drop the slot, or keep it and say why)."""
        with self._deciding():
            if slot not in self.members or self.state is not TaskState.RUNNING:
                return
            mb_s = self._mb_compute_s
            peers = [t for s, t in mb_s.items() if s != slot and s in self.members]
            if slot not in mb_s or not peers:
                return
            from unicron.detect.straggler import straggler_plan

            drop, reason = straggler_plan(
                world=len(self.members),
                microbatches=self.microbatches or len(self.members),
                peer_mb_s=sorted(peers)[len(peers) // 2],
                slow_mb_s=mb_s[slot],
                min_workers=self.settings.min_workers,
            )
            others = self._other_holders(slot)
            if drop and len(others) < MIN_COPIES:
                drop = False  # speed is not worth the state's last spare copy
                reason += (
                    f"; kept: without it {len(others)} worker(s) would hold the state (it is "
                    "judged again once another copy joins)"
                )
            if drop:
                self._action(Action.EXCLUDE, slot, f"straggler dropped: {reason}", 1, now)
                self._kept.discard(slot)
                self._exclude(slot, now)
                self._kill(slot, verdict)
            else:
                self._action(Action.RECONFIGURE, slot, f"straggler kept: {reason}", 1, now)

    def worker_left(self, slot: int) -> None:
        """The worker in ``slot`` exited cleanly after the task ended, without a report (it
        was waiting to join, or joined a last epoch as the others finished): the task does not
        wait for it (:meth:`finished`). Or it was stopped because its slot goes to another
        task (:meth:`release_slot`): the slot is the task's no more (:meth:`released`)."""
        with self._deciding():
            s = self.slots.get(slot)
            if s is None:
                return
            s.gone()
            if s.leaving:
                self._forget(slot)
                del self.slots[slot]
                self._released.add(slot)

    # -- the cluster's planner moves slots ---------------------------------------------------
    def add_slot(self, slot: int, node: int, now: float, reason: str) -> None:
        """The cluster gives the task ``slot`` on ``node`` (a planner decision): a worker
        starts there and joins the next epoch, at a step boundary, with the state from the
        nearest replica. A ``reconfigure`` action says why."""
        with self._deciding():
            if slot in self.slots or self.over():
                return
            s = self.slots[slot] = _Slot(node=node)
            s.has_state = s.fresh = not self._trained
            self._action(Action.RECONFIGURE, slot, f"slot {slot} added: {reason}", 1, now)
            self._send(node, Spawn(slot, fresh=True))

    def release_slots(self, slots: list[int], now: float, reason: str) -> None:
        """The cluster takes ``slots`` back for another task: one epoch (at a step boundary,
        nothing recomputed) goes on without them; once every remaining member has entered it
        their workers are stopped, and the slots are the task's no more (:meth:`released`).
        A ``reconfigure`` action per slot says why."""
        with self._deciding():
            leaving = []
            for slot in slots:
                s = self.slots.get(slot)
                if s is None or s.leaving:
                    continue
                self._action(Action.RECONFIGURE, slot, f"slot {slot} released: {reason}", 1, now)
                if not s.alive:
                    self._forget(slot)
                    del self.slots[slot]
                    self._released.add(slot)
                else:
                    s.to(SlotState.LEAVING)
                    leaving.append(slot)
            rest = tuple(m for m in self.members if m not in leaving)
            if rest != self.members and self._active():
                gone = ", ".join(map(str, leaving))
                self._announce(rest, urgent=False, now=now, reason=f"slot(s) {gone} released")

    def released(self) -> set[int]:
        """Slots given back whose worker is gone (each reported once)."""
        with self._deciding():
            out, self._released = self._released, set()
            return out

    def _stop_leavers(self) -> None:
        """Stop the workers of released slots once every member entered the epoch without
        them (they finished the step they were in; nothing of theirs is needed)."""
        for slot, s in list(self.slots.items()):
            if s.state is not SlotState.LEAVING or slot in self.members:
                continue
            entered = all(
                (p := self._progress.get(m)) is not None and p.epoch >= self.epoch
                for m in self.members
            )
            if entered or not self.members or self.over():
                s.to(SlotState.STOPPING)
                self._send(s.node, Kill(slot, None, leave=True))

    def worker_done(self, slot: int, report: dict[str, Any], now: float) -> None:
        """The worker in ``slot`` finished the last step (every member of the epoch will)."""
        with self._deciding():
            if self.state is TaskState.FAILED:
                return
            self.slots[slot].done = report
            known = self._progress.get(slot)
            self._progress[slot] = Progress(
                known.epoch if known else self.epoch, Phase.DONE, report.get("steps", -1), now
            )
            shas = {o.done["params_sha256"] for o in self.slots.values() if o.done}
            if len(shas) > 1:  # every replica applied every update: they must agree bit for bit
                self.fail(f"replicas finished with different parameters: {sorted(shas)}", now)
                return
            if self.state in (TaskState.RUNNING, TaskState.WAITING):
                self.state = TaskState.DONE
                self._effects.append(WriteStoreKey(done_key(self.task), "done"))
            if report.get("rank") == 0 or not self.outcome:
                self.outcome = Outcome(TaskState.DONE, "finished", report)

    def finished(self) -> bool:
        """True once the task is over and every member of the last epoch has reported."""
        with self._deciding():
            if self.state is TaskState.FAILED:
                return True
            if self.state is not TaskState.DONE:
                return False
            return all(
                self.slots[m].done is not None or not self.slots[m].alive for m in self.members
            )

    def probe_done(self, slot: int, ok: bool, detail: str, now: float) -> None:
        """The health probe of the excluded ``slot`` ended (called by its agent): readmit it
        (and its node, if the node was excluded) and start a worker there, or keep it out for
        twice as long (an ``action`` either way)."""
        with self._deciding():
            self._probing.discard(slot)
            o = self.slots[slot]
            if not o.excluded or o.alive or not self._active():
                return
            if o.node in self.lost_nodes:
                return  # its node went meanwhile: the slot's own health no longer matters
            if not ok:
                self._exclude(slot, now)  # again: the next wait doubles
                wait_s = self._probe_due(slot) - now
                reason = f"slot {slot} failed its health probe ({detail}); next in {wait_s:.0f} s"
                self._action(Action.EXCLUDE, slot, reason, 1, now)
                return
            excluded_s = now - self._excluded_at[slot]
            reason = f"slot {slot} passed its health probe after {excluded_s:.1f} s out: {detail}"
            node_back = o.node in self.escalation.excluded_nodes()
            if node_back:
                self.escalation.readmit(node=o.node)
                reason += f"; node {o.node} readmitted"
            self.escalation.readmit(slot=slot)
            self._action(Action.READMIT, slot, reason, 1, now)
            own = self.escalation.excluded_slots()  # slots excluded on their own account
            for k, x in sorted(self.slots.items()):
                if k != slot and not (node_back and x.node == o.node and x.excluded):
                    continue
                if k in own or k in self._probing or x.leaving:
                    continue  # its own exclusion (or probe) stands; or it is another task's
                x.readmit()
                self._kept.discard(k)
                self._readmitted_at[k] = now
                if not x.alive:  # a kept last copy of the state just stays a member
                    self._spawn(k)

    def node_returned(self, node: int, now: float) -> None:
        """The agent of the lost ``node`` is back (a new process registered under the node's
        name with the cluster service): its slots return to the task (a ``readmit`` action per
        slot); the new agent starts a worker in each, which joins the next epoch with state
        from the nearest replica. Slots excluded on their own account before the loss stay
        out."""
        with self._deciding():
            if node not in self.lost_nodes or not self._active():
                return
            self.lost_nodes.discard(node)
            self.heartbeats[node] = now
            self.escalation.readmit(node=node)
            own = self.escalation.excluded_slots()
            for slot, o in sorted(self.slots.items()):
                if o.node != node or slot in own or o.alive or o.leaving:
                    continue
                o.readmit()
                self._excluded_at.pop(slot, None)
                self._action(Action.READMIT, slot, f"node {node} is back", 1, now)
                # the new agent starts a worker in every slot of its task (no Spawn: twice)
                o.start()
                o.has_state = o.fresh = not self._trained
                self._forget(slot)

    def probe_not_started(self, slot: int, error: str, now: float) -> None:
        """The agent could not start the probe of ``slot`` (e.g. out of file descriptors):
        it is tried again after another cool-down, without counting as a failed probe."""
        with self._deciding():
            self._probing.discard(slot)
            self._excluded_at[slot] = now
            log.warning("task %s: probe of slot %d not started: %s", self.task, slot, error)

    # -- questions --------------------------------------------------------------------------
    def peer_ahead(self, slot: int, step: int) -> bool:
        """Whether another member of the current epoch finished computing ``step``: the
        evidence that ``slot``, still in that step past its deadline, hangs alone."""
        with self._deciding():
            return any(m != slot and self._computed.get(m, -1) >= step for m in self.members)

    def peers_all_ahead(self, slot: int, step: int) -> bool:
        """Whether every other member of the current epoch that can vouch for ``slot``
        (:meth:`_vouchers`) finished computing ``step``."""
        with self._deciding():
            others = self._vouchers(slot)
            return bool(others) and all(self._computed.get(m, -1) >= step for m in others)

    def alone(self, slot: int) -> bool:
        """Whether no other member of the current epoch can vouch that the step of ``slot``
        hangs rather than the machine being slow: it is the only member, or the others are
        joiners that have computed nothing yet (:meth:`_vouchers`)."""
        with self._deciding():
            return not self._vouchers(slot)

    def _vouchers(self, slot: int) -> list[int]:
        """The other members of the current epoch that compute alongside ``slot``: each has
        finished a step since it (re)started, or is computing one. A worker that joined the
        epoch while ``slot`` was in its step and has computed nothing waits in the
        rendezvous for ``slot`` itself: it says nothing about the machine's speed, and counting
        it as a peer not yet done held a hang back to twice its allowance."""
        return [
            m
            for m in self.members
            if m != slot
            and (
                m in self._computed
                or ((p := self._progress.get(m)) is not None and p.phase is Phase.COMPUTE)
            )
        ]

    def state_survives(self, slot: int) -> bool:
        """Whether the task's state outlives the worker in ``slot``: another live replica
        holds it, or there is a checkpoint (the condition ``_reform`` goes on with)."""
        with self._deciding():
            return any(s != slot for s in self._holders()) or self._has_checkpoint()

    def over(self) -> bool:
        """The task is done or failed (waiting workers are leaving)."""
        return self.state in (TaskState.DONE, TaskState.FAILED)

    def heartbeat(self, node: int, now: float, *, read_until: float | None = None) -> None:
        """The agent of ``node`` is alive (called on every round of its loop), and every
        report its workers sent before ``read_until`` has been handed over: the detectors
        judge that node's workers at that moment, never on reports still in flight."""
        with self._deciding():
            self.heartbeats[node] = now
            self._read_until[node] = now if read_until is None else read_until

    # -- the exchange rhythm (docs/cluster.md, The rhythm) --------------------------------------
    def next_exchange_s(self, node: int, now: float) -> float:
        """How soon this coordinator wants the agent of ``node`` back when it has nothing to
        report (:attr:`Reply.next_s`; an agent with reports exchanges at once anyway).

        Slow (``suspect_after_s / 2``) while nothing is due: often enough that a healthy node
        is never suspect, and an action queued between two exchanges (the ticker's) waits at
        most that long. Fast (:data:`FAST_EXCHANGE_S`) while a detector or an action waits on
        fresh reports: an in-band error in its grace period, a suspected hang, a worker with a
        slow step not yet judged a straggler (the agents hold step reports for the rhythm), an
        epoch that not every member entered yet (or a leaver not yet stopped). And timed: a
        worker of the node computing a step is read again at its hang deadline, so a hang is
        judged there, not up to one slow interval later (the detectors judge a node's workers
        only up to its last read, ``read_until``)."""
        idle = self.settings.suspect_after_s / 2
        with self._lock:
            if not self._active():
                return idle
            if self._pending_errors or self._suspects or self._in_transition():
                return FAST_EXCHANGE_S
            if self.monitor is not None and self.monitor.slow_suspected():
                return FAST_EXCHANGE_S  # the next step reports say whether it is a straggler
            wait = idle
            if self.monitor is not None:
                read = self._read_until.get(node, now)  # the agent's clock, as the deadlines
                for slot, o in self.slots.items():
                    deadline = self.monitor.hang_deadline(slot) if o.node == node else None
                    if deadline is not None and deadline > read:
                        wait = min(wait, deadline - read)
            return max(wait, FAST_EXCHANGE_S)

    def _in_transition(self) -> bool:
        """An epoch not every member has entered yet, or a leaver not yet stopped."""
        if self.state is not TaskState.RUNNING:
            return False
        return any(
            (p := self._progress.get(m)) is None or p.epoch < self.epoch for m in self.members
        ) or any(o.state is SlotState.LEAVING for o in self.slots.values())

    # -- decisions over time ----------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Notice lost nodes, hangs, stragglers and stalls, start the first epoch, grow with
        ready workers, heal in-band errors, probe excluded slots, give up a task that waited
        too long. Called by the cluster's ticker once per period, and by an exchange that must
        judge at once (:meth:`_judge_now`) or a report that may start an epoch (a worker
        ready)."""
        with self._deciding():
            self._check_heartbeats(now)
            if self.state is TaskState.PENDING:
                self._maybe_start(now)
            if not self._active():
                return
            self._heal_errors(now)
            self._check_monitor(now)
            self._check_stalls(now)
            self._probe_excluded(now)
            self._stop_leavers()
            self._grow(now)
            if self.state is TaskState.WAITING:
                self._check_give_up(now)

    def _active(self) -> bool:
        return self.state in (TaskState.RUNNING, TaskState.WAITING)

    def _grow(self, now: float) -> None:
        """Ready workers outside the membership join the next epoch (at a step boundary, or at
        once when the task is below its minimum)."""
        joiners = tuple(
            s
            for s, o in sorted(self.slots.items())
            if o.ready and o.alive and not o.excluded and s not in self.members
        )
        grown = self.members + joiners
        if joiners and len(grown) >= self.settings.min_workers:
            below = self.state is TaskState.WAITING or len(self.members) < self.settings.min_workers
            self._running(now)
            self._announce(
                grown,
                urgent=below,
                now=now,
                reason=f"slot(s) {', '.join(map(str, joiners))} ready to join",
            )

    def _check_heartbeats(self, now: float) -> None:
        stalled = (
            self._last_tick is not None and now - self._last_tick > self.settings.suspect_after_s
        )
        self._last_tick = now
        if stalled:  # this process itself did not run for a while: every agent looks silent
            for node in self.heartbeats:
                self.heartbeats[node] = max(self.heartbeats[node], now)
            return
        symptoms = [ts for ts, _, _ in self._pending_errors.values()]
        for node, last in self.heartbeats.items():
            silent = now - last
            suspect_confirmed = silent > self.settings.suspect_after_s and any(
                ts > last for ts in symptoms
            )
            if node in self.lost_nodes or not (
                silent > self.settings.heartbeat_timeout_s or suspect_confirmed
            ):
                continue
            self.lost_nodes.add(node)
            self._last_failure_ts = now
            verdict = classify_detector("heartbeat_lost")
            slots = sorted(s for s, o in self.slots.items() if o.node == node)
            self._emit(
                "error_detected",
                ts=now,
                task=self.label,
                node=node,
                kind=verdict.kind,
                severity=int(verdict.severity),
                method="heartbeat",
                silent_s=round(now - last, 3),
                reason=f"no heartbeat from node {node} for {silent:.2f} s"
                + (" and a collective failed on a living peer" if suspect_confirmed else ""),
            )
            if self.over():
                continue
            decision = self.escalation.decide(verdict, slot=slots[0], node=node, now=now)
            self._emit(
                "action",
                task=self.label,
                epoch=self.epoch,
                node=node,
                action=str(decision.action),
                severity=int(decision.severity),
                reason=decision.reason,
                slots=slots,
            )
            for s in slots:
                o = self.slots[s]
                o.exclude()
                o.gone()
                self._forget(s)
            self._last_error = decision.reason
            self._reform(now, f"node {node} lost")

    def _maybe_start(self, now: float) -> None:
        if self.started_at is None:
            self.started_at = now
        usable = [s for s, o in sorted(self.slots.items()) if not o.excluded]
        ready = tuple(s for s in usable if self.slots[s].ready)
        timed_out = now - self.started_at > self.settings.start_timeout_s
        if ready and (
            len(ready) == len(usable) or (timed_out and len(ready) >= self.settings.min_workers)
        ):
            self.state = TaskState.RUNNING
            self._announce(ready, urgent=False, now=now, reason="start")

    def _heal_errors(self, now: float) -> None:
        """An in-band error whose epoch is still the current one after the grace period (no
        process or node failure explained it with a newer epoch) gets a reattempt: a new epoch
        of the same members. Dropping it would leave the reporter waiting for an epoch that
        never comes, and its peers blocked in a collective it left."""
        for slot, (ts, verdict, epoch) in list(self._pending_errors.items()):
            if (
                self.epoch > epoch
                or slot not in self.members
                or not self.slots[slot].alive
                or self.state is TaskState.WAITING  # the epoch that ends the wait heals it
            ):
                del self._pending_errors[slot]  # a newer epoch (or its exit) heals it
            elif now - ts > self.settings.error_grace_s:
                del self._pending_errors[slot]
                decision = self._decide_in_band(slot, verdict, now)
                self._action(decision.action, slot, decision.reason, int(decision.severity), now)
                if decision.action is Action.REATTEMPT:
                    self._announce(
                        self.members,
                        urgent=True,
                        now=now,
                        reason=f"reattempt after {verdict.kind} on slot {slot}",
                    )
                else:  # escalated: restart the process; its exit is handled as a failure
                    self._kill(slot, verdict)

    def _check_monitor(self, now: float) -> None:
        """Act on the step monitor's verdicts. A step past its hang deadline is a hang only
        once every other member has finished computing that step: when several members are
        late together the machine is slow (or a collective is stuck), and killing them would
        lose work or the state. With only some peers done, or alone in its epoch, the step
        must have lasted :data:`LONE_HANG_OVERRUN` times its allowance."""
        if self.monitor is None:
            return
        for slot in list(self._suspects):
            self._check_suspect(slot, now)
        for d in self.monitor.check(now, self._known_until(now)):
            o = self.slots.get(d.worker)
            if o is None or not o.alive:
                continue
            verdict = classify_detector(d.kind)
            if d.kind == "hang":
                self._suspects[d.worker] = (d.step, verdict, d.reason)
                self._check_suspect(d.worker, now)
                continue
            self.detected(d.worker, d.step, verdict, now, "monitor", reason=d.reason)
            self.worker_slow(d.worker, verdict, now)

    def _known_until(self, now: float) -> dict[int, float]:
        """Per slot, the moment up to which its worker's reports are in (its agent's last
        read; ``now`` for a node not heard from yet, or lost)."""
        return {
            s: now if o.node in self.lost_nodes else min(now, self._read_until.get(o.node, now))
            for s, o in self.slots.items()
        }

    def _check_suspect(self, slot: int, now: float) -> None:
        step, verdict, reason = self._suspects[slot]
        p = self._progress.get(slot)
        if (
            not self.slots[slot].alive
            or p is None
            or p.phase is not Phase.COMPUTE
            or p.step != step
        ):
            del self._suspects[slot]  # it moved on, or it is gone
            return
        # the evidence: every peer finished the step (a starved machine slows several workers
        # at once, a hang one); or one did and the step has lasted twice its allowance (two
        # hangs at once) or its CPU time stood still; or, alone in the epoch, the step has
        # lasted twice its allowance. A worker whose CPU time advances is starved: left to run
        at = self._known_until(now)[slot]
        overrun = self._overrun(slot, at) >= LONE_HANG_OVERRUN
        assert self.monitor is not None
        cpu, why = self._cpu.judge(slot, step, factor=self.monitor.settings.hang_factor, now=now)
        # held, and judged again next tick: a worker starved on a loaded machine (WORKING); or
        # one whose CPU readings the agents send, only not this step's yet (a loaded machine
        # starves the agent too): without that evidence the wall clock alone decides, at the
        # larger overrun
        late = cpu is Cpu.UNKNOWN and self._cpu.sampling and not overrun
        if cpu is Cpu.WORKING or late:
            if self._held.get(slot) != step:
                self._held[slot] = step
                log.info("task %s: slot %d past its hang allowance: %s", self.label, slot, why)
            return
        # its CPU time standing still is what several late peers would otherwise have to show
        idle = cpu is Cpu.IDLE
        peer = self.peers_all_ahead(slot, step) or (
            (overrun or idle) and self.peer_ahead(slot, step)
        )
        lone = not peer and overrun and self.alone(slot)
        if not (peer or lone):
            return
        if cpu is not Cpu.UNKNOWN:
            reason += f"; {why}"
        del self._suspects[slot]
        # alone, and the task's only copy of its state: if it is merely slow it may still
        # finish, so it is reported and left running
        spare = lone and not self.state_survives(slot)
        if lone:
            reason += f"; alone in its epoch: confirmed at {LONE_HANG_OVERRUN:g}x the allowance"
        if spare:
            reason += "; not killed: no other replica and no checkpoint hold the state"
            log.warning("slot %d: %s", slot, reason)
        self.detected(slot, step, verdict, now, "monitor", reason=reason)
        if not spare:
            self._kill(slot, verdict)

    def _overrun(self, slot: int, at: float) -> float:
        """How many hang allowances the current step of ``slot`` has lasted at ``at``."""
        assert self.monitor is not None
        overrun = self.monitor.overrun(slot, at)
        return 0.0 if overrun is None else overrun

    def stall_deadline(self) -> float:
        """How long a member may wait on its peers outside a step (:mod:`unicron.detect.stall`)."""
        with self._deciding():
            s = self.settings
            pace = self.monitor.pace_s() if self.monitor is not None else None
            return stall_deadline_s(
                pace_s=pace,
                state_bytes=self.state_bytes,
                factor=s.stall_factor,
                floor_s=s.stall_floor_s,
                cold_s=s.stall_cold_s,
                transfer_bytes_per_s=s.stall_transfer_bytes_per_s,
            )

    def _check_stalls(self, now: float) -> None:
        """A transition or reduce that never ends: kill the members the others wait for (a
        hang outside a step), or start the epoch again when the collective itself is stuck."""
        if self.state is not TaskState.RUNNING or not self.members:
            return
        known = self._known_until(now)
        stall = find_stall(
            epoch=self.epoch,
            members=self.members,
            progress=self._progress,
            now=min(known[m] for m in self.members),
            deadline_s=self.stall_deadline(),
        )
        if stall is None:
            return
        if stall.stuck:
            slot = self.members[0]
            verdict = classify_detector("collective_stall")
            self.detected(slot, None, verdict, now, "stall", reason=stall.reason)
            node = self.slots[slot].node
            decision = self.escalation.decide(verdict, slot=slot, node=node, now=now)
            self._action(decision.action, slot, decision.reason, int(decision.severity), now)
            if decision.action is Action.REATTEMPT:
                self._announce(self.members, urgent=True, now=now, reason=stall.reason)
            else:
                self._kill(slot, verdict)
            for m in self.members:  # judged once: their clocks restart with the new epoch
                self._progress.pop(m, None)
            return
        verdict = classify_detector("stall")
        for slot in stall.behind:
            if not self.slots[slot].alive:
                continue
            p = self._progress.get(slot)
            self.detected(slot, p.step if p else None, verdict, now, "stall", reason=stall.reason)
            self._progress.pop(slot, None)
            self._kill(slot, verdict)
        for m in self.members:  # the waiters' clocks restart: judged once per stall
            p = self._progress.get(m)
            if p is not None and p.epoch == self.epoch:
                self._progress[m] = Progress(p.epoch, p.phase, p.step, now)

    def _check_give_up(self, now: float) -> None:
        assert self.waiting_since is not None
        if now - self.waiting_since > self.settings.give_up_after_s:
            self.fail(
                f"gave up after waiting {now - self.waiting_since:.0f} s for capacity "
                f"(give-up deadline {self.settings.give_up_after_s:g} s): {self.waiting_reason}; "
                f"last error: {self._last_error}",
                now,
            )

    def _reform(self, now: float, reason: str) -> bool:
        """After members were lost: fail the task if it cannot go on, else announce an epoch of
        the survivors, or (below the task's minimum, where it is worth nothing) wait for
        restarted or readmitted workers to bring it back. Returns False if the task failed."""
        survivors = tuple(m for m in self.members if self.slots[m].alive)
        usable = [s for s, o in self.slots.items() if not o.excluded]
        # slots that can come back: usable ones, and excluded ones a health probe may readmit
        # (not those of lost nodes: no agent to run a probe; none if probes are turned off)
        probing = math.isfinite(self.settings.readmit_after_s)
        recoverable = [
            s
            for s, o in self.slots.items()
            if not o.excluded or (probing and o.node not in self.lost_nodes)
        ]
        why = ""
        if self.state is TaskState.PENDING and len(usable) < self.settings.min_workers:
            # never started (e.g. a script that cannot even import): nothing to wait for
            why = (
                f"{len(usable)} usable slot(s) left, fewer than the minimum of "
                f"{self.settings.min_workers}, before the task started"
            )
        elif len(recoverable) < self.settings.min_workers:
            why = (
                f"{len(recoverable)} slot(s) left that can be used again, fewer than the "
                f"minimum of {self.settings.min_workers}"
            )
        elif self._active() and not self._holders() and not self._has_checkpoint():
            why = "every replica holding the model state is gone (no checkpoint to fall back on)"
        if why:
            self.fail(f"{why}; last error: {self._last_error}", now)
            return False
        if survivors == self.members and len(usable) >= self.settings.min_workers:
            return True
        if len(survivors) < self.settings.min_workers:
            self.members = survivors  # no epoch below the minimum: wait for capacity
            restarting = len(usable) >= self.settings.min_workers
            self._wait(
                now,
                f"{len(survivors)} live worker(s), fewer than the minimum of "
                f"{self.settings.min_workers}; "
                + (
                    "waiting for restarted workers"
                    if restarting
                    else f"{len(usable)} usable slot(s): waiting for excluded slots or nodes to "
                    "pass their health probe"
                ),
            )
            return True
        if survivors != self.members:
            self._announce(survivors, urgent=True, now=now, reason=reason)
        return True

    def _wait(self, now: float, reason: str) -> None:
        """Below the minimum: WAITING (an ``action`` event says why), until capacity is back
        or the give-up deadline passes."""
        if self.state is TaskState.WAITING and reason == self.waiting_reason:
            return
        if self.state is not TaskState.WAITING:
            self.waiting_since = now
        self.state, self.waiting_reason = TaskState.WAITING, reason
        log.warning("task %s waiting: %s", self.task, reason)
        self._emit(
            "action",
            ts=now,
            task=self.label,
            epoch=self.epoch,
            action="wait",
            severity=1,
            reason=f"{reason} (giving up after {self.settings.give_up_after_s:g} s)",
        )

    def _running(self, now: float) -> None:
        if self.state is TaskState.WAITING:
            assert self.waiting_since is not None
            log.warning("task %s: capacity back after %.1f s", self.task, now - self.waiting_since)
            self.state, self.waiting_since, self.waiting_reason = TaskState.RUNNING, None, ""

    def _holders(self) -> list[int]:
        """The live slots that hold the task's committed state (or will after a sync)."""
        return [s for s, o in self.slots.items() if o.alive and o.has_state]

    def _exclude(self, slot: int, now: float) -> None:
        """Take ``slot`` out of the plan until a health probe brings it back. The probe
        backoff counts the exclusions since the slot last stayed in the plan for a whole
        escalation window (``restart_window_s``): older ones are independent events."""
        back = self._readmitted_at.pop(slot, None)
        if back is not None and now - back >= self.escalation.settings.restart_window_s:
            self._exclusions[slot] = 0
        self.slots[slot].exclude()
        self._excluded_at[slot] = now
        self._exclusions[slot] = self._exclusions.get(slot, 0) + 1

    def _exclude_node(self, node: int, verdict: Verdict, now: float) -> None:
        """Take every slot of ``node`` out of the plan. Its living workers are killed only if
        the task's state lives on elsewhere (another node's replica): the last copies keep
        running rather than the task rolling back to a checkpoint, and one that fails on its
        own account is restarted in place (:meth:`_keeps_last_copies`)."""
        state_elsewhere = any(self.slots[h].node != node for h in self._holders())
        for slot, o in self.slots.items():
            if o.node != node:
                continue
            if not o.excluded:
                self._exclude(slot, now)
            if o.alive and state_elsewhere:
                o.gone()  # doomed: not a member of the next epoch
                self._kill(slot, verdict)
            elif o.alive and slot not in self.escalation.excluded_slots():
                self._kept.add(slot)

    def _probe_due(self, slot: int) -> float:
        """When the excluded ``slot`` may be probed: the cool-down doubles per exclusion (see
        :meth:`_exclude`), up to :data:`PROBE_BACKOFF_MAX` times ``readmit_after_s``."""
        backoff = min(2.0 ** (self._exclusions.get(slot, 1) - 1), PROBE_BACKOFF_MAX)
        return self._excluded_at[slot] + self.settings.readmit_after_s * backoff

    def _probe_excluded(self, now: float) -> None:
        """Ask the agents to probe the excluded slots whose cool-down is over (slots of a
        lost node stay out: it has no agent to run a probe)."""
        for slot in self._excluded_at:
            o = self.slots[slot]
            # o.alive: its worker runs (a kept last copy) or its exit is not handled yet
            if slot in self._probing or not o.excluded or o.alive or o.node in self.lost_nodes:
                continue
            if now >= self._probe_due(slot) and o.node in self.nodes:
                log.info("task %s: probing excluded slot %d", self.task, slot)
                self._send(o.node, Probe(slot))
                self._probing.add(slot)

    def _has_checkpoint(self) -> bool:
        return has_checkpoint(self.settings.checkpoint)

    def committed_steps(self) -> int | None:
        """Steps committed so far, this run and any run it resumed (``None``: unknown)."""
        with self._deciding():
            here = max((step + 1 for _, step in self._commits), default=0)
        before = self.settings.committed_before
        return None if before is None and not here else max(here, before or 0)

    def steps_redone(self, step: int) -> int | None:
        """Committed steps a fallback to the checkpoint of ``step`` computes again (the agent
        adds it to that ``transition_end``); ``None`` when unknown."""
        committed = self.committed_steps()
        return None if committed is None else max(committed - step, 0)

    def check_input(self, now: float) -> None:
        """Fail the task with exit 2 if a worker found its input unusable (a checkpoint of
        another model: it set the store's ``usage`` key and left). Called by the cluster's
        ticker; the store is read when a worker exited since the last read (such a worker
        exits right after setting the key), else at most every :data:`INPUT_CHECK_S`."""
        with self._deciding():
            if self.state is TaskState.FAILED:
                return
            if not self._exited and now - self._input_checked < INPUT_CHECK_S:
                return
            self._input_checked, self._exited = now, False
            if not self.store.check([usage_key(self.task)]):
                return
            self.fail(self.store.get(usage_key(self.task)).decode(), now, usage=True)

    def fail(self, reason: str, now: float, *, usage: bool = False) -> None:
        """Give the task up: waiting workers exit, the runner exits 1 with ``reason`` (2 with
        ``usage``: a worker found bad input before training, e.g. a model too large). Also from
        DONE: replicas that finish with different parameters fail a task that looked done."""
        with self._deciding():
            if self.state is TaskState.FAILED:
                return
            self.state = TaskState.FAILED
            self.outcome = Outcome(TaskState.FAILED, reason, usage=usage)
            self._effects.append(WriteStoreKey(done_key(self.task), "failed"))
            if not usage:  # bad input is the runner's one line on stderr
                log.error("task %s failed: %s", self.task, reason)

    # -- effects ----------------------------------------------------------------------------
    def _emit(self, name: str, /, **fields: Any) -> None:
        self._effects.append(LogEvent(name, fields))

    def _send(self, node: int, action: AgentAction) -> None:
        self._effects.append(Tell(node, action))

    def _spawn(self, slot: int) -> None:
        s = self.slots[slot]
        s.start()
        s.has_state = s.fresh = not self._trained
        self._forget(slot)
        self._send(s.node, Spawn(slot))

    def _kill(self, slot: int, verdict: Verdict | None) -> None:
        self._send(self.slots[slot].node, Kill(slot, verdict))

    def _forget(self, slot: int) -> None:
        """Drop what the detectors know of the worker in ``slot`` (gone, or restarting)."""
        self._computed.pop(slot, None)
        self._progress.pop(slot, None)
        self._suspects.pop(slot, None)
        self._mb_compute_s.pop(slot, None)
        self._cpu.forget(slot)
        if self.monitor is not None:
            self.monitor.forget(slot)

    def _announce(self, members: tuple[int, ...], *, urgent: bool, now: float, reason: str) -> None:
        self.members = members
        if not members:
            return  # nobody to tell; the next epoch is made of the workers that come back
        self.epoch += 1
        if self.monitor is not None:
            self.monitor.reset_expectation()  # membership changed: step times may too
        info = EpochInfo(
            self.epoch,
            members,
            tuple(self.slots[m].node for m in members),
            urgent,
            published_ts=now,
        )
        self._emit(
            "plan",
            ts=now,
            task=self.label,
            epoch=self.epoch,
            allocation={self.label: len(members)},
            reason=reason,
        )
        self._effects.append(AnnounceEpoch(self.task, info))
        self._emit(
            "epoch_begin",
            ts=now,
            task=self.label,
            epoch=self.epoch,
            members=list(members),
            urgent=urgent,
            reason=reason,
        )

    def _action(self, action: Action, slot: int, reason: str, severity: int, now: float) -> None:
        self._emit(
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
        """Write one ``error_detected`` event about the worker in ``slot``: the detectors here
        and the agents' (an exception reported, a process exit) alike."""
        with self._deciding():
            self._emit(
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

    def close(self) -> None:
        """Stop serving the store (after every worker is gone)."""
        del self.store
        self.executor.close()
