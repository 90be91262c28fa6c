"""The cluster: nodes, their slots, the tasks placed on them, one coordinator per task.

The service (:mod:`unicron.control.service`) turns every HTTP request into one call here;
a ticker thread calls :meth:`Cluster.tick`. Per task, the membership, detectors and
decisions are a :class:`~unicron.control.coordinator.Coordinator` (the same class
``unicron run`` drives), on a client connection to the cluster's store
(:mod:`unicron.control.store`). Everything that must survive the service's death is in
SQLite (:mod:`unicron.control.state`): a restarted service adopts every task it finds
running (:meth:`Coordinator.adopt`), the agents reconnect and tell it which workers live.

Locks: ``Cluster._lock`` guards the node and task tables only, and is never held while a
task's coordinator is called (its events come back through :meth:`_on_event`, which takes
no cluster lock), so the two locks are never taken in opposite orders.

Task states: ``queued`` (not enough free slots yet) -> ``pending`` (placed, workers
starting) -> ``running`` <-> ``waiting`` -> ``done`` | ``failed`` | ``cancelled``. A task is
known by its name until it has ended and its name is submitted again: then by its uid.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import secrets
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unicron.control import allocation as A
from unicron.control import messages as M
from unicron.control import replicas
from unicron.control import store as S
from unicron.control.coordinator import Coordinator, CoordinatorSettings, TaskState
from unicron.control.escalation import Escalation, EscalationSettings
from unicron.control.events import EventLog
from unicron.control.metrics import Metrics
from unicron.control.screen import Invalid, screen
from unicron.control.state import ACTIVE, ENDED, NodeRow, State, TaskRow, open_state
from unicron.control.taskspec import TaskSpec
from unicron.detect.monitor import MonitorSettings, StepMonitor
from unicron.errors import UsageError
from unicron.planner.hardware import GPU_PRESETS
from unicron.planner.solver import expected_time_to_failure_s
from unicron.protocol import WorkerSettings
from unicron.runtime import checkpoint as C

log = logging.getLogger("unicron.control.cluster")

TRANSITIONS_KEPT = 16
"""recent transitions per task whose median prices its next one (:meth:`Cluster._transition_s`)"""


class NotFound(LookupError):
    """An unknown task or node (HTTP 404)."""


class Conflict(RuntimeError):
    """The request contradicts the cluster's state (HTTP 409)."""


class Fenced(RuntimeError):
    """An agent of a node the cluster declared lost (HTTP 410): a partition ended, not a
    death. Its workers are out of their tasks' epochs; it must stop them and register again
    (as a new process under the node's name), which brings the node back to its tasks."""


@dataclass(frozen=True, kw_only=True)
class ClusterSettings:
    node_timeout_s: float = 2.0
    """a node whose agent has not heartbeated for this long is shown lost, and a new agent
    may register under its name (each task's coordinator judges its own workers' nodes with
    the same timeout, from its own exchanges)"""
    tick_s: float = 0.1
    """how often the ticker runs every task's detectors and places queued tasks"""
    placement: A.Placement = "planner"
    """who decides each task's worker count: the planner (default), or one of the baselines
    the benchmark compares it with, ``keep`` or ``equal`` (:mod:`unicron.control.allocation`)"""
    gpu: str = "A100-80GB"
    """what one slot is for the performance model (a preset of
    :data:`unicron.planner.GPU_PRESETS`; a node's slots are its GPUs): used only for tasks
    that describe their ``model``"""

    def __post_init__(self) -> None:
        for name in ("node_timeout_s", "tick_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.placement not in A.PLACEMENTS:
            raise ValueError(
                f"placement must be one of {', '.join(A.PLACEMENTS)}, got {self.placement!r}"
            )
        if self.gpu not in GPU_PRESETS:
            raise ValueError(f"gpu must be one of {', '.join(GPU_PRESETS)}, got {self.gpu!r}")


@dataclass
class Node:
    row: NodeRow
    last_seen: float
    lost: bool = False
    gpus: int | None = None  # CUDA devices its agent counted on registering; None: unknown


@dataclass
class Task:
    row: TaskRow
    spec: TaskSpec
    controller: Coordinator | None = None
    events: EventLog | None = None
    leaving: set[int] = field(default_factory=set)  # ranks given back, worker not yet gone
    excluded: set[int] = field(default_factory=set)  # ranks its coordinator took out of the plan
    refused: str = ""  # why a planned slot was refused (a node without the task's device)
    held_back: str = ""  # why the planner gives a queued task no slot (no layout fits)
    transitions: deque[float] = field(default_factory=lambda: deque(maxlen=TRANSITIONS_KEPT))
    """its recent transitions' durations (rank 0's ``transition_end``), seconds"""


class Cluster:
    """See the module docstring. ``host`` is the address workers and agents reach this
    machine at (the store is served there)."""

    def __init__(
        self,
        state_dir: Path,
        *,
        host: str,
        settings: ClusterSettings | None = None,
        embedded: bool = False,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.settings = settings or ClusterSettings()
        self.state: State = open_state(self.state_dir)
        self._events_to: dict[str, Path] = {}
        self.embedded = embedded
        if embedded:  # ``unicron run``: the store lives and dies with this process
            self._store_master = S.serve_here(host)
            self.store, adopted = S.StoreInfo(host, self._store_master.port, os.getpid()), False
        else:
            self.store, adopted = S.ensure(self.state_dir, host)
        self._lock = threading.RLock()
        self.started = time.time()
        self.metrics = Metrics(self.state)
        now = time.time()
        self.nodes: dict[int, Node] = {r.id: Node(r, last_seen=now) for r in self.state.nodes()}
        self._by_name = {n.row.name: n for n in self.nodes.values()}  # every request looks up
        self.tasks: dict[str, Task] = {}
        self.owners = self.state.owners()  # task name -> who submitted it
        self._by_uid: dict[str, Task] = {}  # ... and every exchange its task
        self._triggers: list[str] = []  # what happened since the last plan
        last_alive = float(self.state.meta("alive_ts") or "nan")
        self.away_s = now - last_alive if math.isfinite(last_alive) else None
        for row in self.state.tasks():
            task = Task(row, TaskSpec.model_validate(row.spec))
            self.tasks[row.name] = self._by_uid[row.uid] = task
            if row.state in ACTIVE:
                if not adopted:  # the store and every worker's epochs went with it
                    self._end(task, "failed", "the cluster's store was lost", now)
                    continue
                self._start(task, now, adopt=True)
        self.state.set_meta("alive_ts", repr(now))
        self._alive_written = now
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._pending_adds: list[tuple[str, int]] = []  # (task, node): planned, not yet free
        self.plan_error = ""  # the planner's last error, shown by status

    # -- lifecycle -------------------------------------------------------------------------
    def start_ticker(self) -> None:
        self._ticker = threading.Thread(target=self._tick_loop, name="cluster-tick", daemon=True)
        self._ticker.start()

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.settings.tick_s):
            try:
                self.tick(time.time())
            except Exception:  # the control plane keeps running whatever one round hit
                log.exception("cluster tick failed")

    def close(self, *, stop_store: bool = False) -> None:
        """Stop ticking and close the database; ``stop_store``: the cluster shuts down."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5.0)
        for task in self.tasks.values():
            if task.events is not None:
                task.events.close()
        self.state.close()
        if stop_store:
            S.stop(self.state_dir)

    # -- nodes -----------------------------------------------------------------------------
    def register(
        self,
        name: str,
        slots: int,
        address: str,
        instance: str,
        now: float,
        *,
        gpus: int | None = None,
    ) -> int:
        """An agent starts (or reconnects): its node's id. A new process under the name of a
        node that is still heartbeating is refused (:class:`Conflict`); under the name of a
        lost one it brings the node back to the tasks placed there."""
        returned: list[Task] = []
        with self._lock:
            node = self._by_name.get(name)
            if node is None:
                nid = max(self.nodes, default=-1) + 1
                node = Node(NodeRow(nid, name, slots, address, instance, now), last_seen=now)
                self.nodes[nid] = self._by_name[name] = node
                node.gpus = gpus
                self.state.save_node(node.row)
                log.info("node %s registered as node %d with %d slot(s)", name, nid, slots)
                self._triggers.append(f"node {name} registered")
                return nid
            if node.row.instance != instance:
                silent = now - node.last_seen
                if not node.lost and silent < self.settings.node_timeout_s:
                    raise Conflict(
                        f"node {name} is live (its agent heartbeated {silent:.1f} s ago); "
                        "stop it first or choose another --node-name"
                    )
                used = self._used(node.row.id)
                if slots < used:
                    raise Conflict(
                        f"node {name} comes back with {slots} slot(s); its tasks hold {used}"
                    )
                node.row = NodeRow(node.row.id, name, slots, address, instance, now)
                self.state.save_node(node.row)
                returned = [
                    t
                    for t in self.tasks.values()
                    if t.controller is not None and node.row.id in t.row.placement
                ]
                log.info("node %s (node %d) is back", name, node.row.id)
                self._triggers.append(f"node {name} back")
            node.last_seen, node.lost, node.gpus = now, False, gpus
        for task in returned:
            assert task.controller is not None
            task.controller.node_returned(node.row.id, now)
        return node.row.id

    def heartbeat(self, name: str, instance: str, now: float) -> list[dict[str, Any]]:
        """The agent of ``name`` is alive: the tasks it must run (one assignment each). An
        agent of a node declared lost meanwhile is fenced (:class:`Fenced`)."""
        with self._lock:
            node = self._live_node(name, instance, now)
            node.last_seen = now
            return [
                self._assignment(t, node.row.id)
                for t in self.tasks.values()
                if t.controller is not None and node.row.id in t.row.placement
            ]

    def exchange(
        self,
        name: str,
        instance: str,
        uid: str,
        reports: list[M.Report],
        now: float,
        read_until: float | None,
    ) -> M.Reply:
        """One round of a node's supervisor of task ``uid`` (see ``Coordinator.exchange``)."""
        with self._lock:
            node = self._live_node(name, instance, now)
            node.last_seen = now
            task = self._by_uid.get(uid)
            controller = None if task is None else task.controller
            if task is not None and controller is not None:
                reports = screen(node.row, task.row, controller.epoch, reports)
        if controller is None:  # ended (or never known): its workers leave
            return M.Reply(over=True, finished=True)
        return controller.exchange(node.row.id, reports, now, read_until=read_until)

    def _live_node(self, name: str, instance: str, now: float) -> Node:
        """The node of a heartbeat or an exchange. A node a task dropped as lost does not
        come back by speaking again (a partition healed): its workers there hold an epoch the
        task left, so its agent is told to stop them and register anew (:class:`Fenced`). A
        node only the cluster's ticker marked lost (a silence no task acted on: an agent
        starved for a few seconds on a loaded host) is simply live again."""
        node = self._node(name, instance)
        if node.lost:
            dropped = [
                t.row.name
                for t in self.tasks.values()
                if t.controller is not None
                and node.row.id in t.row.placement
                and node.row.id in t.controller.lost_nodes  # a snapshot read, no lock
            ]
            if dropped:
                raise Fenced(
                    f"node {name} was declared lost ({now - node.last_seen:.1f} s silent) and "
                    f"task(s) {', '.join(dropped)} went on without it: its workers there are "
                    "out of their epoch; stop them and register again"
                )
            log.info("node %s speaks again after %.1f s; no task dropped it", name,
                     now - node.last_seen)  # fmt: skip
            node.lost = False
        return node

    def _node(self, name: str, instance: str) -> Node:
        node = self._by_name.get(name)
        if node is None:
            raise NotFound(f"no node named {name}: register first")
        if node.row.instance != instance:
            raise Conflict(f"node {name} was taken over by another agent process")
        return node

    def _used(self, nid: int) -> int:
        return sum(t.row.placement.count(nid) for t in self.tasks.values() if t.row.state in ACTIVE)

    # -- tasks -----------------------------------------------------------------------------
    def submit(
        self,
        spec: TaskSpec,
        now: float,
        *,
        events_to: Path | None = None,
        owner: str = "admin",
    ) -> dict[str, Any]:
        """Accept a task: placed at once if its minimum fits, else queued. ``events_to``
        (``unicron run --events``; never from the API): the task's event log goes there.
        ``owner``: who submitted it (the only one but an admin who may cancel it)."""
        if not Path(spec.script).is_file():
            raise Invalid(f"script: no such file on the coordinator's host: {spec.script}")
        ck = spec.checkpoint
        if ck.resume and ck.dir:
            try:
                C.check_resume(Path(ck.dir), spec.reduce, flag="checkpoint.dir")
            except UsageError as exc:
                raise Invalid(str(exc)) from None
        with self._lock:
            if spec.name in self.tasks:
                self._archive(self.tasks[spec.name])
            self._check_checkpoint_dir_free(spec)
            # the uid prefixes every store key of the task: 128 random bits make it a secret
            # the task's workers, its agents, its owner and an admin know (docs/security.md)
            uid = spec.name if self.embedded else f"{spec.name}.{secrets.token_hex(16)}"
            row = TaskRow(spec.name, uid, spec.model_dump(), "queued", now, [])
            task = Task(row, spec)
            self.tasks[spec.name] = self._by_uid[uid] = task
            if events_to is not None:
                self._events_to[row.uid] = events_to
            self.state.save_task(row)
            self.state.set_owner(spec.name, owner)
            self.owners[spec.name] = owner
            calls = self._replan(now, f"task {spec.name} submitted")
            self._settle(now, calls)
            view = self.view(task)
        self._call(calls)
        return view

    def _archive(self, task: Task) -> None:
        """A task of the name being submitted again: refused while it lives (its workers
        too); once it has ended, it goes on under its uid (``gpt.3f9a1c``), its row, events
        and outcome with it (``unicron status|logs|report UID``), and the name is free. The
        caller holds the lock."""
        row = task.row
        if row.state not in ENDED or task.controller is not None or row.uid == row.name:
            what = row.state if task.controller is None else f"{row.state}, workers stopping"
            raise Conflict(f"a task named {row.name} exists ({what}); submit again once it ended")
        old = row.name
        self.state.rename_task(old, row.uid)
        del self.tasks[old]
        row.name = row.uid
        self.tasks[row.uid] = task
        self._pending_adds = [(m, n) for m, n in self._pending_adds if m != old]
        log.info("task %s (%s) archived as %s: the name is reused", old, row.state, row.uid)

    def _check_checkpoint_dir_free(self, spec: TaskSpec) -> None:
        """Two tasks never write into one checkpoint directory: a task that goes on from a
        cancelled one waits until that one's workers are stopped (the caller holds the lock)."""
        if not spec.checkpoint.dir:
            return
        mine = Path(spec.checkpoint.dir).resolve()
        for t in self.tasks.values():
            theirs = self._checkpoint_dir(t)
            live = t.row.state not in ENDED or t.controller is not None
            if live and theirs is not None and theirs.resolve() == mine:
                raise Conflict(
                    f"checkpoint.dir {spec.checkpoint.dir}: task {t.row.name} ({t.row.state}) "
                    "writes there; submit again when it has ended"
                )

    def cancel(self, name: str, now: float) -> dict[str, Any]:
        with self._lock:
            task = self._task(name)
            if task.row.state in ENDED:
                raise Conflict(f"task {name} already ended ({task.row.state})")
            controller = task.controller
            if controller is None:
                self._end(task, "cancelled", "cancelled before it started", now)
                return self.view(task)
            task.row.state = "cancelled"  # kept when its coordinator reports the failure
            self.state.save_task(task.row)
        controller.fail("cancelled by the user", now)
        return self.view(task)

    def _task(self, name: str) -> Task:
        task = self.tasks.get(name)
        if task is None:
            raise NotFound(f"no task named {name}")
        return task

    # -- the planner in the loop ------------------------------------------------------------
    def _replan(self, now: float, trigger: str) -> list[Callable[[], None]]:
        """Ask the planner for every task's worker count (:mod:`unicron.control.allocation`)
        on a trigger; queue the slots to add, and return the releases to make (calls into
        task coordinators, made by the caller after it lets go of the cluster lock). One
        ``plan`` event per task concerned: the allocation before and after, both WAFs, why."""
        capacity = {nid: n.slots for nid, n in self._free_capacity(now).items()}
        per_node = max(capacity.values(), default=1)  # GPUs per node, for the perf model
        for task in self.tasks.values():  # an excluded slot is nobody's until readmitted
            excluded = list(task.excluded)  # a copy: coordinators change it (_trigger_of)
            for r in excluded if task.row.state in ACTIVE else ():
                node = task.row.placement[r] if r < len(task.row.placement) else -1
                if node in capacity:
                    capacity[node] -= 1
        views = []
        for task in self.tasks.values():
            if task.row.state not in ("queued", *ACTIVE) or task.row.state == "cancelled":
                continue
            ranks = {
                r: n
                for r, n in enumerate(task.row.placement)
                if n >= 0 and r not in task.leaving and r not in task.excluded
            }
            planned = [n for name, n in self._pending_adds if name == task.row.name]
            for k, node in enumerate(planned):  # planned, not yet free: held where they go
                ranks[-1 - k] = node
            c = task.controller
            views.append(
                A.TaskView(
                    name=task.row.name,
                    weight=task.spec.weight,
                    min_workers=task.spec.workers.min,
                    max_workers=task.spec.workers.max,
                    ranks=ranks,
                    running=c is not None,
                    microbatches=None if c is None else c.microbatches,
                    model=task.spec.planner_model(),
                    global_batch=task.spec.global_batch or 0,
                    transition_s=self._transition_s(task),
                    replica_ranks=task.spec.replica_ranks,
                    parked=self._parked(task),
                )
            )
        if not views or not capacity:
            return []
        hardware = A.Hardware(GPU_PRESETS[self.settings.gpu], max(per_node, 1))
        started = time.perf_counter()
        try:
            decision = A.decide(
                views,
                capacity,
                self._d_run_s(now, len(capacity)),
                placement=self.settings.placement,
                task_event=any(t.startswith("task ") for t in trigger.split("; ")),
                hardware=hardware,
            )
        except Exception as exc:  # a planner error never stops the cluster
            self.plan_error = f"{trigger}: {type(exc).__name__}: {exc}"
            log.exception("planner failed on %s; the allocation stays as it is", trigger)
            return []
        decision_s = time.perf_counter() - started
        self.metrics.decision.observe(decision_s)
        self.plan_error = ""
        for m in decision.moves:  # a queued task left out for its model says why
            why = decision.reasons.get(m.task, "")
            self.tasks[m.task].held_back = why if m.after == 0 and "no layout" in why else ""
        if not decision.changed:
            return []
        calls: list[Callable[[], None]] = []
        before = {m.task: m.before for m in decision.moves}
        after = {m.task: m.after for m in decision.moves}
        for m in decision.moves:
            task = self.tasks[m.task]
            why = f"planner on {trigger}: {before} -> {after}"
            if m.release:
                task.leaving.update(m.release)
                c = task.controller
                assert c is not None
                calls.append(functools.partial(c.release_slots, list(m.release), now, why))
            self._pending_adds += [(m.task, n) for n in m.add_on]
            if task.events is not None and m.before != m.after:
                task.events.emit(
                    "plan",
                    ts=now,
                    task=task.row.name,
                    trigger=trigger,
                    allocation=after,
                    allocation_before=before,
                    waf_before=round(decision.waf_before, 6),
                    waf_after=round(decision.waf_after, 6),
                    reason=decision.reasons.get(m.task, ""),
                    placement=self.settings.placement,
                    decision_ms=round(decision_s * 1000.0, 3),
                )
        log.info("plan on %s: %s -> %s", trigger, before, after)
        return calls

    def _parked(self, task: Task) -> frozenset[int]:
        """The ranks of ``task`` waiting for an excluded rank of their replica (a node's
        ranks in order, ``tp * pp`` at a time: :mod:`unicron.control.replicas`)."""
        size, excluded = task.spec.replica_ranks, set(task.excluded)  # (coordinators change it)
        if size == 1 or not excluded:
            return frozenset()
        out: set[int] = set()
        placement = task.row.placement
        for node in {placement[r] for r in excluded if 0 <= r < len(placement)}:
            on = [r for r, n in enumerate(placement) if n == node]
            for group in replicas.grouped(on, size):
                if any(r in excluded for r in group):
                    out.update(r for r in group if r not in excluded)
        return frozenset(out)

    def _settle(self, now: float, calls: list[Callable[[], None]]) -> None:
        """Carry out the queued additions whose slot is free: a running task gets a new rank
        there (its coordinator's ``add_slot``, appended to ``calls``); a queued task starts
        once all its planned slots are free. Called under the cluster lock (by every tick:
        nothing to do costs nothing)."""
        if not self._pending_adds:
            return
        free = {nid: n.slots - self._used(nid) for nid, n in self._free_capacity(now).items()}
        waiting: dict[str, list[int]] = {}
        kept: list[tuple[str, int]] = []
        for name, node in self._pending_adds:
            task = self.tasks.get(name)
            if task is None or task.row.state in ENDED or task.row.state == "cancelled":
                continue
            if node not in free:
                continue  # the node went meanwhile: the next plan decides again
            if task.spec.device == "cuda" and self.nodes[node].gpus == 0:
                task.refused = (
                    f"device cuda: node {self.nodes[node].row.name} has no CUDA device; "
                    "waiting for a node with GPUs"
                )
                log.warning("task %s: refused a slot on node %s: no CUDA device", name,
                            self.nodes[node].row.name)  # fmt: skip
                continue
            if task.controller is None:
                waiting.setdefault(name, []).append(node)
                kept.append((name, node))
                continue
            if free[node] <= 0:
                kept.append((name, node))
                continue
            free[node] -= 1
            rank = len(task.row.placement)
            task.row.placement.append(node)
            self.state.save_task(task.row)
            c = task.controller
            calls.append(functools.partial(c.add_slot, rank, node, now, "planner"))
        self._pending_adds = kept
        for name, nodes in waiting.items():
            need = {n: nodes.count(n) for n in nodes}
            if all(free.get(n, 0) >= k for n, k in need.items()):
                task = self.tasks[name]
                task.row.placement = sorted(nodes)
                self._pending_adds = [(m, n) for m, n in self._pending_adds if m != name]
                for n in nodes:
                    free[n] -= 1
                self._start(task, now, adopt=False)

    def _call(self, calls: list[Callable[[], None]]) -> None:
        """Make the planned calls into task coordinators (never under the cluster lock)."""
        for call in calls:
            try:
                call()
            except Exception:
                log.exception("a planned move failed")

    def _free_capacity(self, now: float) -> dict[int, NodeRow]:
        return {
            nid: n.row
            for nid, n in sorted(self.nodes.items())
            if not n.lost and now - n.last_seen < self.settings.node_timeout_s
        }

    def _transition_s(self, task: Task) -> float:
        """What a change of ``task``'s worker count costs it, measured: the median of its
        recent transitions (an epoch plus the state its joiners took), else of every task's,
        else the allocation's prior (:data:`~unicron.control.allocation.TRANSITION_S`)."""
        own = list(task.transitions)
        seen = own or [d for t in self.tasks.values() for d in t.transitions]
        return float(statistics.median(seen)) if seen else A.TRANSITION_S

    def _d_run_s(self, now: float, nodes: int) -> float:
        """Expected time to the next failure: a prior of one failure per node and day,
        refined by the failures the cluster saw since it started (docs/planner.md)."""
        days = max(now - self.started, 0.0) / 86400.0
        rate = (1.0 + self.metrics.failures_seen) / (1.0 + days)  # per node and day
        return expected_time_to_failure_s(rate, max(nodes, 1))

    def _start(self, task: Task, now: float, *, adopt: bool) -> None:
        spec, row = task.spec, task.row
        task_dir = self.state_dir / "tasks" / row.uid
        checkpoint = self._checkpoint_dir(task)
        committed_before: int | None = max(row.committed_step + 1, 0)
        if spec.checkpoint.resume and not adopt and checkpoint is not None:
            committed_before = C.take_progress(checkpoint)
        task.events = EventLog(
            self._events_to.get(row.uid, task_dir / "events.jsonl"), enrich=self._name_node
        )
        task.events.subscribe(functools.partial(self._on_event, task))
        address = self.store.address
        task.controller = Coordinator(
            task=row.uid,
            label=row.name,
            slots=dict(enumerate(row.placement)),
            events=task.events,
            escalation=Escalation(EscalationSettings(restart_window_s=spec.restart_window)),
            settings=CoordinatorSettings(
                min_workers=spec.workers.min,
                replica_ranks=spec.replica_ranks,
                checkpoint=checkpoint,
                committed_before=committed_before,
                readmit_after_s=spec.readmit_after,
                give_up_after_s=spec.give_up_after,
            ),
            monitor=StepMonitor(MonitorSettings()),
            store=(S.connect(address), address),  # type: ignore[arg-type]
        )
        if adopt:
            task.controller.adopt(now, committed_step=row.committed_step)
            task.events.emit(
                "control_plane",
                ts=now,
                task=row.name,
                what="coordinator restarted: task adopted",
                away_s=None if self.away_s is None else round(self.away_s, 3),
                epoch=task.controller.epoch,
            )
        elif row.state == "queued":
            row.state = "pending"
            self.state.save_task(row)

    def _assignment(self, task: Task, nid: int) -> dict[str, Any]:
        """What a node's agent needs to run its part of ``task``; ``settings``: what its
        workers read from their environment (:class:`~unicron.protocol.WorkerSettings`)."""
        spec = task.spec
        checkpoint = self._checkpoint_dir(task)
        settings = WorkerSettings(
            reduce=spec.reduce,
            on_lost=spec.on_lost,
            bucket_cap_mb=spec.bucket_cap_mb,
            checkpoint="" if checkpoint is None else str(checkpoint),
            checkpoint_every=str(spec.checkpoint.every),
            checkpoint_mtbf_s=spec.checkpoint.mtbf,
            checkpoint_keep=spec.checkpoint.keep,
            resume=spec.checkpoint.resume,
            tp=spec.tp,
            pp=spec.pp,
        )
        return {
            "uid": task.row.uid,
            "name": task.row.name,
            "slots": [rank for rank, n in enumerate(task.row.placement) if n == nid],
            "script": spec.script,
            "args": spec.args,
            "inject": spec.inject,
            "threads": spec.threads,
            "store": self.store.address,
            "device": spec.device,
            "settings": dataclasses.asdict(settings),
            "env": spec.env,
        }

    def _checkpoint_dir(self, task: Task) -> Path | None:
        """Where the task's checkpoints go; ``None``: it writes none (and has none to read)."""
        ck = task.spec.checkpoint
        if ck.every == 0 and not ck.resume:
            return None
        return Path(ck.dir) if ck.dir else self.state_dir / "tasks" / task.row.uid / "checkpoints"

    def _name_node(self, e: dict[str, Any]) -> None:
        """An event that names a node by number gets its name beside it (``node_name``): the
        name is what ``unicron status``, the agent's ``--node-name`` and a person use. Called
        by the task's event log for every record, from the thread that emits it."""
        nid = e.get("node")
        node = self.nodes.get(nid) if isinstance(nid, int) else None
        if node is not None:
            e["node_name"] = node.row.name

    def _where(self, task: Task, e: dict[str, Any]) -> str:
        """Where an event happened, for a person: "slot 2 (node gpu-17)", "node gpu-17"."""
        if "slot" in e:
            slot = int(e["slot"])
            nid = task.row.placement[slot] if 0 <= slot < len(task.row.placement) else -1
            node = self.nodes.get(nid)
            return f"slot {slot}" + (f" (node {node.row.name})" if node is not None else "")
        return f"node {e.get('node_name', e.get('node'))}"

    def _on_event(self, task: Task, e: dict[str, Any]) -> None:
        """Every event of a task's log: into SQLite, the task's row and the metrics."""
        row, kind = task.row, e["event"]
        self.state.add_event(row.name, e)
        self.metrics.observe(row.name, e)
        changed = True
        if kind == "epoch_begin":
            row.epoch, row.workers = int(e["epoch"]), len(e.get("members", ()))
            if row.state == "pending":
                row.state = "running"
        elif kind == "step_end":
            row.committed_step = max(row.committed_step, int(e["step"]))
        elif kind == "transition_end" and e.get("rank") == 0 and "duration_s" in e:
            task.transitions.append(float(e["duration_s"]))
            changed = False
        elif kind == "error_detected":
            row.last_fault = f"{e.get('kind')} (SEV{e.get('severity')}) on {self._where(task, e)}"
        elif kind == "action" and e.get("action") == "wait" and row.state in ACTIVE:
            row.state = "waiting"
        else:
            changed = False
        self._trigger_of(task, e)
        if changed:
            self.state.save_task(row)

    def _trigger_of(self, task: Task, e: dict[str, Any]) -> None:
        """The task events that change what the planner sees: a slot excluded (a straggler
        dropped, a device fault, restarts that keep failing) or readmitted, a straggler
        found. The next tick replans (called from the task's coordinator, without the
        cluster lock: only appends)."""
        kind, name = e["event"], task.row.name
        slot = e.get("slot")
        if kind == "action" and e.get("action") in ("exclude", "readmit") and slot is not None:
            if e["action"] == "exclude":
                task.excluded.add(int(slot))
            else:
                task.excluded.discard(int(slot))
            done = "excluded" if e["action"] == "exclude" else "readmitted"
            self._triggers.append(f"slot {slot} of task {name} {done}")
        elif kind == "error_detected" and e.get("kind") == "straggler":
            self._triggers.append(f"straggler on slot {slot} of task {name}")

    # -- time --------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Run every task's detectors, end finished tasks, place queued ones, mark nodes
        lost, and record that the service is alive (the next start reports the gap)."""
        with self._lock:
            for node in self.nodes.values():
                if not node.lost and now - node.last_seen > self.settings.node_timeout_s:
                    node.lost = True
                    self._triggers.append(f"node {node.row.name} lost")
                    log.warning(
                        "node %s is lost (silent %.1f s)", node.row.name, now - node.last_seen
                    )
            active = [t for t in self.tasks.values() if t.controller is not None]
        for task in active:
            c = task.controller
            assert c is not None
            c.check_input(now)
            c.tick(now)
            state = c.state
            if state is TaskState.RUNNING and task.row.state == "waiting":
                task.row.state = "running"
                self.state.save_task(task.row)
            if c.finished():
                with self._lock:
                    self._finish(task, now)
        calls: list[Callable[[], None]] = []
        with self._lock:
            for task in active:
                c = task.controller
                for rank in c.released() if c is not None else ():
                    task.row.placement[rank] = -1  # the slot is free for the next task
                    task.leaving.discard(rank)
                    self.state.save_task(task.row)
            if self._triggers:  # swapped first: coordinators append without the cluster lock
                triggers, self._triggers = self._triggers, []
                calls += self._replan(now, "; ".join(triggers))
            self._settle(now, calls)
        self._call(calls)
        if now - self._alive_written >= 1.0:
            self.state.set_meta("alive_ts", repr(now))
            self._alive_written = now

    def _finish(self, task: Task, now: float) -> None:
        c = task.controller
        assert c is not None and c.outcome is not None
        outcome = c.outcome
        if task.row.state == "cancelled":
            status = "cancelled"
        else:
            status = "done" if outcome.state is TaskState.DONE else "failed"
        r = outcome.result
        assert task.events is not None
        task.events.emit(
            "task_end",
            ts=now,
            task=task.row.name,
            status="ok" if status == "done" else status,
            steps=r.get("steps"),
            final_loss=r.get("final_loss"),
            params_sha256=r.get("params_sha256"),
            reason=None if status == "done" else outcome.reason,
            wall_s=round(now - task.row.submitted_ts, 3),
        )
        # how far it got, beside its checkpoints: a resume of it says how many steps it redoes
        C.record_progress(self._checkpoint_dir(task), c.committed_steps())
        self._end(task, status, outcome.reason, now, result={**r, "usage": outcome.usage})

    def _end(
        self,
        task: Task,
        status: str,
        reason: str,
        now: float,
        result: dict[str, Any] | None = None,
    ) -> None:
        self._triggers.append(f"task {task.row.name} {status}")
        task.row.state = status
        task.row.outcome = {"status": status, "reason": reason, "ts": now, **(result or {})}
        self.state.save_task(task.row)
        if task.controller is not None:
            task.controller.close()
            task.controller = None
        if task.events is not None:
            task.events.close()
            task.events = None
        log.info("task %s %s: %s", task.row.name, status, reason)

    # -- views -------------------------------------------------------------------------------
    def view(self, task: Task) -> dict[str, Any]:
        row = task.row
        c = task.controller
        return {
            "name": row.name,
            "uid": row.uid,
            "state": row.state,
            "epoch": row.epoch,
            "step": row.committed_step,
            "workers": row.workers,
            "placement": [self.nodes[n].row.name for n in row.placement if n in self.nodes],
            "min_workers": task.spec.workers.min,
            "max_workers": task.spec.workers.max,
            "weight": task.spec.weight,
            "last_fault": row.last_fault,
            "waiting": c.waiting_reason if c is not None else task.refused or task.held_back,
            "submitted_ts": row.submitted_ts,
            "owner": self.owners.get(row.name, "admin"),
            "outcome": row.outcome,
            "plan_error": self.plan_error,  # the planner failed: the allocation was kept
        }

    def task_views(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self.view(t) for t in self.tasks.values()]

    def task_view(self, name: str) -> dict[str, Any]:
        with self._lock:
            return self.view(self._task(name))

    def node_views(self, now: float) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {
                    "name": n.row.name,
                    "id": nid,
                    "slots": n.row.slots,
                    "used": self._used(nid),
                    "address": n.row.address,
                    "state": "lost" if n.lost else "up",
                    "silent_s": round(now - n.last_seen, 3),
                }
                for nid, n in sorted(self.nodes.items())
            ]

    def events(self, name: str, after: int) -> tuple[list[dict[str, Any]], int]:
        with self._lock:
            self._task(name)
        rows = self.state.events(name, after=after)
        return [e for _, e in rows], (rows[-1][0] if rows else after)

    def prometheus(self) -> bytes:
        with self._lock:
            tasks = [(t.row.state, t.row.workers if t.row.state in ACTIVE else 0, t.row.name,
                      t.row.committed_step) for t in self.tasks.values()]  # fmt: skip
        return self.metrics.render(tasks)
