"""A task's coordinator: one per task. Owns the task's membership and decides every epoch.

The cluster service (:mod:`unicron.control.cluster`, which ``unicron run`` also runs, on this
machine) builds one per task, on a client connection to the cluster's store (keys scoped by
task and epoch, :mod:`unicron.protocol`); a coordinator built without one serves a
``TCPStore`` of its own (the unit tests). It turns what the task's supervisors report (a
worker ready, failed, raised, began or finished a step, entered an epoch, finished) into
decisions, runs the task's detectors and announces epochs.

Who calls what: a supervisor (:mod:`unicron.control.agent`, on each node) calls only
:meth:`Coordinator.exchange` with its round's typed reports (:mod:`unicron.messages`,
in-process or through ``POST /v1/agents/{node}/tasks/{uid}/exchange``); the reply carries
the actions queued for its node (start, kill or probe a worker). The cluster calls
:meth:`~Coordinator.tick` and :meth:`~Coordinator.check_input` from its ticker, the planner's
moves (:meth:`~Coordinator.add_slot`, :meth:`~Coordinator.release_slots`),
:meth:`~Coordinator.node_returned` and, after a restart, :meth:`~Coordinator.adopt`. Every
method takes the coordinator's lock; nothing here blocks or calls an agent.

The shape (docs/architecture.md has the picture): this class is a shell. What it knows of
the task is a :class:`~unicron.control.book.TaskBook`: the slot table
(:mod:`unicron.control.slots`: every fact about each slot on its :class:`Slot`), the
membership, the nodes' heartbeats, the detectors. The decisions are the judges' functions of
that book: :mod:`~unicron.control.membership` (epochs, the planner's moves, the end),
:mod:`~unicron.control.health` (heartbeats, hangs, stragglers, stalls, the rhythm),
:mod:`~unicron.control.readmission` (exclusion, probes, a node back) and
:mod:`~unicron.control.failures` (the one place that acts on the escalation's decisions,
:mod:`unicron.control.escalation`). The shell holds the lock, dispatches each report to its
judge, reads the store for them (:meth:`adopt`, :meth:`check_input`), and runs the effects.

Decide, then do: the judges change only the book and describe everything else as effects
(:mod:`unicron.control.effects`: an event-log record, a store key, an epoch announced, an
action for a node's agent). When the outermost decision of a call ends, an
:class:`~unicron.control.effects.Executor` carries them out in order.
:meth:`~Coordinator.decide_exchange` and :meth:`~Coordinator.decide_tick` return them instead,
undone (``tests/test_decide.py``).

Each slot's lifecycle is a :class:`SlotState` (its diagram is there); a move it does not draw
raises :class:`IllegalTransition`. The task's states are :class:`TaskState`::

    PENDING --first epoch--> RUNNING <--> WAITING (below the minimum, capacity may come back)
       RUNNING | WAITING --> DONE (the last step committed) | FAILED (nothing left to heal,
                                                                or the give-up deadline passed)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import math
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from unicron import messages as M
from unicron.control import failures, health, membership, readmission
from unicron.control.book import CoordinatorSettings, Outcome, TaskBook, TaskState
from unicron.control.effects import Effect, Executor, on_their_way, stale
from unicron.control.escalation import Escalation
from unicron.control.events import EventLog
from unicron.control.failures import MIN_COPIES
from unicron.control.health import FAST_EXCHANGE_S, LONE_HANG_OVERRUN
from unicron.control.readmission import PROBE_BACKOFF_MAX
from unicron.control.slots import IllegalTransition, Slot, SlotState, SlotTable
from unicron.detect.busy import Sample
from unicron.detect.classify import Verdict
from unicron.detect.monitor import StepMonitor
from unicron.messages import AgentAction, Kill, Probe, Reply, Spawn
from unicron.protocol import (
    EpochInfo,
    epoch_info_key,
    epoch_key,
    state_bytes_key,
    trained_key,
    usage_key,
)
from unicron.runtime.checkpoint import has_checkpoint
from unicron.runtime.group import ControlStore

__all__ = [
    "FAST_EXCHANGE_S",
    "INPUT_CHECK_S",
    "LONE_HANG_OVERRUN",
    "MIN_COPIES",
    "PROBE_BACKOFF_MAX",
    "Coordinator",
    "CoordinatorSettings",
    "IllegalTransition",
    "Kill",
    "Outcome",
    "Probe",
    "Slot",
    "SlotState",
    "Spawn",
    "TaskState",
]

_SAMPLED = tuple(f.name for f in dataclasses.fields(Sample))
"""what an agent's :class:`~unicron.messages.CpuTime` carries into a :class:`Sample`: every
field of the one is a field of the other, by name"""

log = logging.getLogger("unicron.control.coordinator")

INPUT_CHECK_S = 1.0
"""how often :meth:`Coordinator.check_input` reads the store when no worker exited meanwhile
(a store request per task per tick was most of the ticker's cost)"""


class Coordinator:
    """The lock, the dispatch of reports to the judges, and the executor of their effects, for
    one task (see the module docstring)."""

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
        store: tuple[ControlStore, str] | None = None,
        label: str | None = None,
    ) -> None:
        self.events = events
        self.book = TaskBook(
            task=task,
            label=label or task,
            slots=slots,
            settings=settings,
            escalation=escalation,
            monitor=monitor,
            checkpoint_exists=has_checkpoint,
        )
        self._outbox: dict[int, deque[AgentAction]] = {n: deque() for n in set(slots.values())}
        self._lock = threading.RLock()
        self._input_checked = -math.inf  # when check_input last read the store
        # a client of the cluster's store (:mod:`unicron.control.store`), which outlives us
        self.store, self.store_address = store or _own_store(host)
        self._depth = 0  # decisions in progress (one calls another): the outermost executes
        self.executor = Executor(store=self.store, events=events, outbox=self._outbox)

    # -- the book, as the cluster and the tests read it ---------------------------------------
    @property
    def task(self) -> str:
        """The task's uid: scopes its store keys."""
        return self.book.task

    @property
    def label(self) -> str:
        """The task's name in the event log."""
        return self.book.label

    @property
    def settings(self) -> CoordinatorSettings:
        return self.book.settings

    @property
    def escalation(self) -> Escalation:
        return self.book.escalation

    @property
    def monitor(self) -> StepMonitor | None:
        return self.book.monitor

    @property
    def slots(self) -> SlotTable:
        """The slot table (:mod:`unicron.control.slots`)."""
        return self.book.slots

    @property
    def state(self) -> TaskState:
        return self.book.state

    @property
    def epoch(self) -> int:
        return self.book.epoch

    @property
    def members(self) -> tuple[int, ...]:
        return self.book.members

    @property
    def outcome(self) -> Outcome | None:
        return self.book.outcome

    @property
    def microbatches(self) -> int | None:
        """Micro-batches per global batch, learned from the workers (the planner's input)."""
        return self.book.microbatches

    @property
    def waiting_reason(self) -> str:
        return self.book.waiting_reason

    @property
    def lost_nodes(self) -> set[int]:
        return self.book.lost_nodes

    @property
    def nodes(self) -> set[int]:
        """The nodes whose agent is attached."""
        return self.book.nodes

    @property
    def state_bytes(self) -> int:
        """The task's state size (model and optimizer), learned from the workers."""
        return self.book.state_bytes

    # -- deciding and doing ---------------------------------------------------------------------
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
                if self._depth == 0 and self.book.effects:
                    effects, self.book.effects = self.book.effects, []
                    self.executor.run(effects)

    @contextlib.contextmanager
    def _collecting(self) -> Iterator[list[Effect]]:
        """Hold the lock while deciding; hand the effects decided to the caller, not run."""
        out: list[Effect] = []
        with self._lock:
            self._depth += 1
            start = len(self.book.effects)
            try:
                yield out
            finally:
                self._depth -= 1
                out += self.book.effects[start:]
                del self.book.effects[start:]

    # -- the agents' exchange -------------------------------------------------------------------
    def attach(self, node: int) -> None:
        """The agent of ``node`` is up and takes its actions (:meth:`take_actions`)."""
        with self._deciding():
            self.book.nodes.add(node)
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
            self.book.asked_s[node] = next_s = self.next_exchange_s(node, now)  # its lateness
            return Reply(
                actions=tuple(self.take_actions(node)),
                over=self.over(),
                finished=self.finished(),
                next_s=next_s,
            )

    def decide_exchange(
        self, node: int, reports: list[M.Report], now: float, *, read_until: float | None = None
    ) -> list[Effect]:
        """Apply the ``reports`` of the agent of ``node`` in order and take its heartbeat
        (every report its workers sent before ``read_until`` is in ``reports``); run the
        detectors (:meth:`tick`) at ``now`` only when this exchange must judge at once
        (:func:`unicron.control.health.judge_now`), else the cluster's ticker does within its
        period. Return what that decided to do, not yet done."""
        with self._collecting() as effects:
            self.attach(node)
            # bad input first: the exits it causes (read in the same round) are not failures
            for report in sorted(reports, key=lambda r: not isinstance(r, M.BadInput)):
                try:
                    self._apply(node, report)
                except Exception as exc:  # one bad report must not stop the task's control
                    log.exception("task %s: could not apply %r", self.task, report)
                    what = f"{type(report).__name__}: {type(exc).__name__}: {exc}"[:300]
                    failures.control_error(self.book, what, now)
            self.heartbeat(node, now, read_until=read_until)
            if health.judge_now(self.book, node, now):
                self.tick(now)
        return effects

    def decide_tick(self, now: float) -> list[Effect]:
        """What the passing of time decides at ``now`` (:meth:`tick`), not yet done."""
        with self._collecting() as effects:
            self.tick(now)
        return effects

    def take_actions(self, node: int) -> list[AgentAction]:
        """What the agent of ``node`` must do now, in order (called by that agent's thread)."""
        with self._lock:
            box = self._outbox.get(node)
            if not box:
                return []
            actions = list(box)
            box.clear()
            return actions

    def next_exchange_s(self, node: int, now: float) -> float:
        """How soon this coordinator wants the agent of ``node`` back when it has nothing to
        report (:attr:`Reply.next_s`; :func:`unicron.control.health.next_exchange_s`)."""
        with self._lock:
            return health.next_exchange_s(self.book, node, now)

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
            self.step_computed(r.slot, r.step, r.ts, compute_s=r.compute_s, cpu_s=r.cpu_s,
                               microbatches=r.microbatches, queued_s=r.queued_s,
                               epoch=r.epoch)  # fmt: skip
        elif isinstance(r, M.WaitingOnReplica):
            with self._lock:
                health.waiting_on_replica(self.book, r.slot, r.step, r.epoch, r.waiting, r.ts)
        elif isinstance(r, M.CpuTime):
            self.book.cpu.sampled(r.slot, Sample(**{f: getattr(r, f) for f in _SAMPLED}))
        elif isinstance(r, M.Event):
            self._event(r)
        elif isinstance(r, M.Detected):
            if r.extra.get("returncode") == 0 and self.over():
                return  # left because the task ended (the agent had not heard yet): no error
            self.book.detected(r.slot, r.step, r.verdict, r.ts, r.method, **r.extra)
        elif isinstance(r, M.WorkerError):
            self.worker_error(r.slot, r.verdict, r.ts, in_place=r.in_place, epoch=r.epoch)
        elif isinstance(r, M.WorkerFailed):
            self.worker_failed(r.slot, r.verdict, r.ts)
        elif isinstance(r, M.WorkerLeft):
            self.worker_left(r.slot)
        elif isinstance(r, M.WorkerDone):
            self.worker_done(r.slot, r.result(), r.ts)
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
        with self._deciding():
            self.book.emit(r.name, **fields)

    # -- reports from agents (each a judge's, under the lock) -----------------------------------
    def census(self, node: int, r: M.Census) -> None:
        """An agent's account of its workers, sent when it (re)connects
        (:func:`unicron.control.failures.census`)."""
        with self._deciding():
            queued = on_their_way(node, self._outbox, self.book.effects)
            failures.census(self.book, node, r, queued)

    def heartbeat(self, node: int, now: float, *, read_until: float | None = None) -> None:
        """The agent of ``node`` is alive (every round of its loop), and every report its
        workers sent before ``read_until`` is in (:func:`unicron.control.health.heartbeat`)."""
        with self._deciding():
            health.heartbeat(self.book, node, now, read_until)

    def worker_ready(
        self, slot: int, now: float, *, microbatches: int | None = None, state_bytes: int = 0
    ) -> None:
        """The worker in ``slot`` built its model and waits for an epoch."""
        with self._deciding():
            health.worker_ready(self.book, slot, microbatches, state_bytes)
            self.tick(now)

    def worker_failed(self, slot: int, verdict: Verdict, now: float) -> None:
        """The worker process in ``slot`` is gone
        (:func:`unicron.control.failures.worker_failed`)."""
        with self._deciding():
            failures.worker_failed(self.book, slot, verdict, now)

    def worker_error(
        self, slot: int, verdict: Verdict, now: float, *, in_place: bool, epoch: int | None = None
    ) -> None:
        """An error raised inside a living worker
        (:func:`unicron.control.failures.worker_error`)."""
        with self._deciding():
            failures.worker_error(self.book, slot, verdict, now, in_place=in_place, epoch=epoch)

    def epoch_entered(self, slot: int, epoch: int, now: float) -> None:
        """The worker in ``slot`` entered ``epoch`` (rendezvous, ledger exchange, state)."""
        with self._deciding():
            health.epoch_entered(self.book, slot, epoch, now)

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
            health.step_started(self.book, slot, step, now, epoch, cpu_s)

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
        epoch: int | None = None,
    ) -> None:
        """The worker in ``slot`` finished computing ``step`` (it now reduces)
        (:func:`unicron.control.health.step_computed`)."""
        with self._deciding():
            health.step_computed(self.book, slot, step, now, compute_s=compute_s,
                                 microbatches=microbatches, cpu_s=cpu_s, queued_s=queued_s,
                                 epoch=epoch)  # fmt: skip

    def step_committed(self, epoch: int, step: int, now: float) -> bool:
        """A member reports that ``step`` committed in ``epoch``: True for the first report
        of it (:func:`unicron.control.membership.step_committed`)."""
        with self._deciding():
            return membership.step_committed(self.book, epoch, step)

    def worker_left(self, slot: int) -> None:
        """The worker in ``slot`` exited cleanly after the task ended, or was stopped because
        its slot goes to another task (:func:`unicron.control.membership.worker_left`)."""
        with self._deciding():
            membership.worker_left(self.book, slot)

    def worker_done(self, slot: int, report: dict[str, Any], now: float) -> None:
        """The worker in ``slot`` finished the last step (every member of the epoch will)."""
        with self._deciding():
            membership.worker_done(self.book, slot, report, now)

    def probe_done(self, slot: int, ok: bool, detail: str, now: float) -> None:
        """The health probe of the excluded ``slot`` ended (called by its agent;
        :func:`unicron.control.readmission.probe_done`)."""
        with self._deciding():
            readmission.probe_done(self.book, slot, ok, detail, now)

    def probe_not_started(self, slot: int, error: str, now: float) -> None:
        """The agent could not start the probe of ``slot``: tried again after another
        cool-down, not a failed probe."""
        with self._deciding():
            readmission.probe_not_started(self.book, slot, error, now)

    # -- the cluster: its ticker, its planner, its nodes ------------------------------------------
    def tick(self, now: float, spare: int | None = None) -> None:
        """Notice lost nodes, hangs, stragglers, stalls; start, grow, heal in-band errors, probe
        excluded slots, give up a task that waited too long. Called by the cluster's ticker each
        period (``spare``: :func:`~unicron.control.planning.spare_slots`), and by an exchange
        that must judge at once or a report that may start an epoch (a worker ready)."""
        with self._deciding():
            b = self.book
            b.spare_slots = b.spare_slots if spare is None else spare
            health.check_heartbeats(b, now)
            if b.state is TaskState.PENDING:
                membership.maybe_start(b, now)
            if not b.active():
                return
            failures.heal_errors(b, now)
            health.check_monitor(b, now)
            health.check_stalls(b, now)
            readmission.probe_excluded(b, now)
            membership.stop_leavers(b)
            membership.grow(b, now)
            if b.state is TaskState.WAITING:
                membership.check_give_up(b, now)

    def adopt(self, now: float, *, committed_step: int = -1, logged: EpochInfo | None = None,
              pace_s: float | None = None) -> None:  # fmt: skip
        """Take over the task as its workers left it when the previous coordinator died: the
        current epoch and members from the store (which outlived it) or, from a new store,
        the ``logged`` one (the event log's last), announced again there
        (:func:`membership.store_moved`); every slot presumed alive until its agent's
        :class:`~unicron.messages.Census` says otherwise, every node heard from now
        (its agent reconnects within its backoff); ``pace_s``, the logged step time, judges
        stalls until the monitor has its own. Called once, before the first exchange, by the
        cluster service for each task it finds running in its state."""
        with self._deciding():
            info, trained, size = _stored(self.store, self.task) or (logged, committed_step >= 0, 0)
            membership.adopt(self.book, now, info, trained=trained, committed=committed_step,
                             state_bytes=size)  # fmt: skip
            self.book.logged_pace_s = pace_s
            if info is not None and info is logged:
                membership.store_moved(self.book, now, f"a new one serves at {self.store_address}")

    def check_input(self, now: float) -> None:
        """Fail the task with exit 2 if a worker found its input unusable (a checkpoint of
        another model: it set the store's ``usage`` key and left). Called by the cluster's
        ticker; the store is read when a worker exited since the last read (such a worker
        exits right after setting the key), else at most every :data:`INPUT_CHECK_S`."""
        with self._deciding():
            b, key = self.book, usage_key(self.task)
            if b.state is TaskState.FAILED or (
                not b.exited and now - self._input_checked < INPUT_CHECK_S
            ):
                return
            self._input_checked, b.exited = now, False
            try:
                if self.store.check([key]):
                    membership.fail(b, self.store.get(key).decode(), now, usage=True)
            except dist.DistNetworkError:  # the store is gone: the cluster starts a new one
                self.executor.store_failed = True

    def store_moved(self, store: tuple[ControlStore, str], now: float, why: str, *,
                    same: bool = False) -> None:  # fmt: skip
        """The store was lost (``why``); ``store`` serves now (``same``: the old one, only
        slow): :func:`membership.store_moved` (the cluster's tick)."""
        with self._deciding():
            self.store, self.store_address = store
            self.executor.store, self.executor.store_failed = self.store, False
            where = "it serves on" if same else f"a new one serves at {store[1]}"
            membership.store_moved(self.book, now, f"{why}; {where}", lost=not same)

    def add_slot(self, slot: int, node: int, now: float, reason: str, place: int) -> None:
        """The cluster gives the task ``slot`` on ``node`` at ``place`` in its replica (a
        planner decision): see :func:`unicron.control.membership.add_slot`."""
        with self._deciding():
            membership.add_slot(self.book, slot, node, now, reason, place)

    def release_slots(self, slots: list[int], now: float, reason: str) -> None:
        """The cluster takes ``slots`` back for another task: one epoch (at a step boundary,
        nothing recomputed) goes on without them; once every remaining member has entered it
        their workers are stopped, and the slots are the task's no more (:meth:`released`).
        A ``reconfigure`` action per slot says why."""
        with self._deciding():
            membership.release_slots(self.book, slots, now, reason)

    def released(self) -> set[int]:
        """Slots given back whose worker is gone (each reported once)."""
        with self._deciding():
            return self.slots.take_released()

    def node_returned(self, node: int, now: float) -> None:
        """A new agent process registered under ``node``'s name with the cluster service
        (:func:`unicron.control.failures.agent_back`). A ``Kill`` or ``Spawn`` queued for the
        old agent is dropped: the new one would take it for its fresh workers (found in
        review: a hang's Kill killed the worker the new agent had just started)."""
        with self._deciding():
            self._outbox[node] = deque(a for a in self._outbox.get(node, ()) if not stale(a))
            failures.agent_back(self.book, node, now)

    def fail(self, reason: str, now: float, *, usage: bool = False) -> None:
        """Give the task up: waiting workers exit, the runner exits 1 with ``reason`` (2 with
        ``usage``: a worker found bad input before training, e.g. a model too large). Also from
        DONE: replicas that finish with different parameters fail a task that looked done."""
        with self._deciding():
            membership.fail(self.book, reason, now, usage=usage)

    # -- questions ------------------------------------------------------------------------------
    def over(self) -> bool:
        """The task is done or failed (waiting workers are leaving)."""
        return self.book.over()

    def finished(self) -> bool:
        """True once the task is over and every member of the last epoch has reported."""
        with self._deciding():
            return membership.finished(self.book)

    def stall_deadline(self) -> float:
        """How long a member may wait on its peers outside a step (:mod:`unicron.detect.stall`)."""
        with self._deciding():
            return health.stall_deadline(self.book)

    def committed_steps(self) -> int | None:
        """Steps committed so far, this run and any run it resumed (``None``: unknown)."""
        with self._deciding():
            return membership.committed_steps(self.book)

    def steps_redone(self, step: int) -> int | None:
        """Committed steps a fallback to the checkpoint of ``step`` computes again (the agent
        adds it to that ``transition_end``); ``None`` when unknown."""
        committed = self.committed_steps()
        return None if committed is None else max(committed - step, 0)

    def close(self) -> None:
        """Stop serving the store (after every worker is gone)."""
        del self.store
        self.executor.close()


def _own_store(host: str) -> tuple[ControlStore, str]:
    """A store served from this process, and its address (a coordinator built without the
    cluster's: the unit tests)."""
    store = dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60)
    )
    return store, f"{host}:{store.port}"


def _stored(store: ControlStore, task: str) -> tuple[EpochInfo, bool, int] | None:
    """The current epoch of ``task`` on ``store``, whether the task has trained and its
    state's size in bytes (0: not known; ``None``: no epoch there, a new store): what
    :meth:`Coordinator.adopt` takes over."""
    if not store.check([epoch_key(task)]):
        return None
    epoch = int(store.get(epoch_key(task)).decode())
    info = EpochInfo.from_json(store.get(epoch_info_key(task, epoch)))
    size = 0  # a hint for the finish bound: unknown if unreadable
    with contextlib.suppress(ValueError):
        if store.check([state_bytes_key(task)]):
            size = int(store.get(state_bytes_key(task)))
    return info, store.check([trained_key(task)]), size
