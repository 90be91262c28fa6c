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

import functools
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unicron import messages as M
from unicron.control import allocation as A
from unicron.control.coordinator import Coordinator, TaskState
from unicron.control.escalation import Escalation, EscalationSettings
from unicron.control.events import EventLog
from unicron.control.keeper import Keeper
from unicron.control.metrics import Metrics
from unicron.control.nodetable import Conflict, NodeTable, NotFound
from unicron.control.planning import (
    Task,
    ask,
    assignment,
    cancel_planned,
    checkpoint_dir,
    coordinator_settings,
    fold,
    logged_epoch,
    logged_pace,
    name_node,
    plan_event,
    replica_places,
    settle,
    spare_slots,
    task_end,
    task_view,
    writer_of,
)
from unicron.control.screen import Heard, Invalid, screen
from unicron.control.state import ACTIVE, ENDED, NodeRow, State, TaskRow, open_state
from unicron.control.taskspec import TaskSpec
from unicron.detect.monitor import MonitorSettings, StepMonitor
from unicron.errors import UsageError
from unicron.planner.hardware import GPU_PRESETS
from unicron.runtime import checkpoint as C

log = logging.getLogger("unicron.control.cluster")


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
        # ``unicron run``'s store dies with it, a cluster's outlives it; earlier coordinators fenced
        token = self.state.next_generation()
        self.store = Keeper(self.state_dir, host, embedded=embedded, token=token)
        self._lock = threading.RLock()
        self.started = time.time()
        self.metrics = Metrics(self.state)
        now = time.time()
        self._nodes = NodeTable(
            self.state.nodes(), now, self.settings.node_timeout_s, self.state.save_node
        )
        self.nodes = self._nodes.by_id
        self.tasks: dict[str, Task] = {}
        self.owners = self.state.owners()  # task name -> who submitted it
        self._by_uid: dict[str, Task] = {}  # ... and every exchange its task
        self._heard = Heard()  # the agents' reports handed over, by index
        self._triggers: list[str] = []  # what happened since the last plan
        last_alive = float(self.state.meta("alive_ts") or "nan")
        self.away_s = now - last_alive if math.isfinite(last_alive) else None
        for row in self.state.tasks():
            task = Task(row, TaskSpec.model_validate(row.spec))
            self.tasks[row.name] = self._by_uid[row.uid] = task
            if row.state in ACTIVE:
                self._start(task, now, adopt=True)
        self.state.set_meta("alive_ts", repr(now))
        self._alive_written = now
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._pending_adds: list[tuple[str, int]] = []  # (task, node): planned, not yet free
        self.plan_error = ""  # the planner's last error, shown by status

    # -- lifecycle -------------------------------------------------------------------------
    def start_ticker(self) -> None:
        """Start judging time. The nodes and the adopted tasks' agents count as heard from
        now: the service answers from now on, and none could reach it while it started (a
        standby that takes over starts in a second or two, about a node timeout)."""
        now = time.time()
        self._nodes.heard(now)
        for c in (t.controller for t in self.tasks.values() if t.controller is not None):
            for node in c.slots.nodes():
                c.heartbeat(node, now)
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
        self.store.close(stop_store=stop_store)

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
        """An agent starts (or reconnects): its node's id (:meth:`NodeTable.register`); a
        node that comes back is returned to the tasks placed there."""
        returned: list[Task] = []
        with self._lock:
            row = NodeRow(-1, name, slots, address, instance, now)
            node, what = self._nodes.register(row, now, gpus, self._used)
            if what == "new":
                self._triggers.append(f"node {name} registered")
            elif what == "back":
                self._triggers.append(f"node {name} back")
                returned = [
                    t
                    for t in self.tasks.values()
                    if t.controller is not None and node.row.id in t.row.placement
                ]
        for task in returned:
            assert task.controller is not None
            task.controller.node_returned(node.row.id, now)
        return node.row.id

    def heartbeat(self, name: str, instance: str, now: float) -> list[M.Assignment]:
        """The agent of ``name`` is alive: the tasks it must run (one assignment each). An
        agent of a node declared lost meanwhile is fenced (:class:`Fenced`)."""
        with self._lock:
            node = self._nodes.speaking(name, instance, now, self._dropped)
            return [
                assignment(
                    t,
                    node.row.id,
                    self.store.info.address,
                    self.store.secret,
                    checkpoint_dir(t, self.state_dir),
                )
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
        first: int | None = None,
    ) -> M.Reply:
        """One round of a node's supervisor of task ``uid`` (see ``Coordinator.exchange``);
        ``first``: the index of its first report (:class:`~unicron.control.screen.Heard`)."""
        with self._lock:
            node = self._nodes.speaking(name, instance, now, self._dropped)
            task = self._by_uid.get(uid)
            controller = None if task is None else task.controller
            if task is not None and controller is not None:
                fresh, upto = self._heard.unheard(uid, name, instance, first, reports)
                try:
                    reports = screen(node.row, task.row, controller.epoch, fresh)
                except Invalid as exc:  # its position in the agent's batch
                    if exc.index is not None:
                        exc.index += len(reports) - len(fresh)
                    raise
                self._heard.note(uid, name, instance, upto)
        if controller is None:  # ended (or never known): its workers leave
            return M.Reply(over=True, finished=True)
        return controller.exchange(node.row.id, reports, now, read_until=read_until)

    def _dropped(self, nid: int) -> list[str]:
        """The running tasks placed on node ``nid`` that declared it lost and went on."""
        return [
            t.row.name
            for t in self.tasks.values()
            if t.controller is not None
            and nid in t.row.placement
            and nid in t.controller.lost_nodes  # a snapshot read, no lock
        ]

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
            writer = writer_of(spec, self.tasks.values(), self.state_dir)
            if writer is not None:
                raise Conflict(
                    f"checkpoint.dir {ck.dir}: task {writer.row.name} ({writer.row.state}) "
                    "writes there; submit again when it has ended"
                )
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
        and outcome with it (``unicron status|logs|report UID``), the name free. Under lock."""
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
        started = time.perf_counter()
        try:
            decision = ask(
                self.tasks,
                self._pending_adds,
                self._nodes.live(now),
                gpu=self.settings.gpu,
                placement=self.settings.placement,
                up_s=now - self.started,
                failures_seen=self.metrics.failures_seen,
                trigger=trigger,
            )
        except Exception as exc:  # a planner error never stops the cluster
            self.plan_error = f"{trigger}: {type(exc).__name__}: {exc}"
            log.exception("planner failed on %s; the allocation stays as it is", trigger)
            return []
        if decision is None:
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
            placed = len(task.row.placement)
            self._pending_adds = cancel_planned(self._pending_adds, m.task, m.release, placed)
            if real := [r for r in m.release if r < placed]:
                task.leaving.update(real)
                c = task.controller
                assert c is not None
                calls.append(functools.partial(c.release_slots, real, now, why))
            self._pending_adds += [(m.task, n) for n in m.add_on]
            if task.events is not None and m.before != m.after:
                fields = plan_event(decision, m.task, trigger, self.settings.placement, decision_s)
                task.events.emit("plan", ts=now, **fields)
        log.info("plan on %s: %s -> %s", trigger, before, after)
        return calls

    def _settle(self, now: float, calls: list[Callable[[], None]]) -> None:
        """Carry out the queued additions whose slots are free (:func:`settle`): a running
        task gets new ranks there (its coordinator's ``add_slot``, appended to ``calls``); a
        queued task starts. Called under the cluster lock by every tick."""
        if not self._pending_adds:
            return
        free = {nid: n.slots - self._used(nid) for nid, n in self._nodes.live(now).items()}
        done = settle(self._pending_adds, free, self.tasks,
                      {nid: self.nodes[nid].gpus for nid in free})  # fmt: skip
        for name, node in done.refused.items():
            where, task = self.nodes[node].row.name, self.tasks[name]
            task.refused = (
                f"device cuda: node {where} has no CUDA device; waiting for a node with GPUs"
            )
            log.warning("task %s: refused a slot on node %s: no CUDA device", name, where)
        added: list[tuple[Task, int, int]] = []
        for name, node in done.add:
            task = self.tasks[name]
            added.append((task, len(task.row.placement), node))
            task.row.placement.append(node)
            self.state.save_task(task.row)
        places = {t.row.name: replica_places(t) for t, _, _ in added}  # once all are known
        for t, rank, node in added:
            assert t.controller is not None
            place, add = places[t.row.name][rank], t.controller.add_slot
            calls.append(functools.partial(add, rank, node, now, "planner", place))
        self._pending_adds = done.kept
        for name, nodes in done.start.items():
            task = self.tasks[name]
            task.row.placement = nodes
            self._start(task, now, adopt=False)

    def _call(self, calls: list[Callable[[], None]]) -> None:
        """Make the planned calls into task coordinators (never under the cluster lock)."""
        for call in calls:
            try:
                call()
            except Exception:
                log.exception("a planned move failed")

    def _start(self, task: Task, now: float, *, adopt: bool) -> None:
        spec, row = task.spec, task.row
        checkpoint = checkpoint_dir(task, self.state_dir)
        committed_before: int | None = max(row.committed_step + 1, 0)
        if spec.checkpoint.resume and not adopt and checkpoint is not None:
            committed_before = C.take_progress(checkpoint)
        per_node = max((n.row.slots for n in list(self.nodes.values())), default=1)  # GPUs
        settings = coordinator_settings(spec, checkpoint, committed_before, gpu=self.settings.gpu,
                                        gpus_per_node=per_node)  # fmt: skip
        task.events = EventLog(
            self._events_to.get(row.uid, self.state_dir / "tasks" / row.uid / "events.jsonl"),
            enrich=functools.partial(name_node, self.nodes),
        )
        task.events.subscribe(functools.partial(self._on_event, task))
        task.controller = Coordinator(
            task=row.uid,
            label=row.name,
            slots={r: n for r, n in enumerate(row.placement) if n >= 0},  # -1: released
            events=task.events,
            escalation=Escalation(EscalationSettings(restart_window_s=spec.restart_window)),
            settings=settings,
            monitor=StepMonitor(MonitorSettings(straggler_cpu_check=spec.device == "cpu")),
            store=self.store.client(row.uid),
        )
        if adopt:  # the store's epochs, or the log's last one announced again on a new store
            try:
                logged = logged_epoch(self.state, row)  # where the store has no epoch of it
                task.controller.adopt(now, committed_step=row.committed_step, logged=logged,
                                      pace_s=logged_pace(self.state, row))  # fmt: skip
            except Exception as exc:  # this task fails alone; the service and the others go on
                log.exception("task %s: adoption failed", row.name)
                task.controller.fail(f"not adopted: {type(exc).__name__}: {exc}", now)
            away = None if self.away_s is None else round(self.away_s, 3)
            task.events.emit("control_plane", ts=now, task=row.name, away_s=away,
                             what="coordinator restarted: task adopted",
                             epoch=task.controller.epoch)  # fmt: skip
        elif row.state == "queued":
            row.state = "pending"
            self.state.save_task(row)

    def _on_event(self, task: Task, e: dict[str, Any]) -> None:
        """Every event of a task's log: into SQLite, the task's row (:func:`planning.fold`)
        and the metrics; one that changes what the planner sees makes the next tick replan
        (called from the task's coordinator, without the cluster lock: only appends)."""
        self.state.add_event(task.row.name, e)
        self.metrics.observe(task.row.name, e)
        changed, trigger = fold(task, e, self.nodes)
        if trigger is not None:
            self._triggers.append(trigger)
        if changed:
            self.state.save_task(task.row)

    # -- time --------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Run every task's detectors, end finished tasks, place queued ones, mark nodes
        lost, and record that the service is alive (the next start reports the gap)."""
        with self._lock:
            for node in self._nodes.mark_silent(now):
                self._triggers.append(f"node {node.row.name} lost")
            active = [t for t in self.tasks.values() if t.controller is not None]
            spare = spare_slots(self._nodes.live(now), self.tasks.values())
        keep_store(self.store, active, now)
        for task in active:
            c = task.controller
            assert c is not None
            try:
                c.check_input(now)
                c.tick(now, spare.get(task.row.name, 0))
            except Exception as exc:  # a bug in one task's decisions fails that task alone
                log.exception("task %s: its coordinator failed", task.row.name)
                c.fail(f"its coordinator failed: {type(exc).__name__}: {exc}", now)
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
        task.events.emit("task_end", ts=now, **task_end(task, status, r, outcome.reason, now))
        # how far it got, beside its checkpoints: a resume of it says how many steps it redoes
        C.record_progress(checkpoint_dir(task, self.state_dir), c.committed_steps())
        self._end(task, status, outcome.reason, now, result={**r, "usage": outcome.usage})

    def _end(self, task: Task, status: str, reason: str, now: float,
             result: dict[str, Any] | None = None) -> None:  # fmt: skip
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
        owner = self.owners.get(task.row.name, "admin")
        return task_view(task, self.nodes, owner, self.plan_error)

    def task_views(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self.view(t) for t in self.tasks.values()]

    def task_view(self, name: str) -> dict[str, Any]:
        with self._lock:
            return self.view(self._task(name))

    def node_views(self, now: float) -> list[dict[str, Any]]:
        with self._lock:
            return self._nodes.views(now, self._used)

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


def keep_store(keeper: Keeper, active: list[Task], now: float) -> None:
    """Start the store again if it was lost (its process gone or silent, or a coordinator's
    request failed and a ping is not answered either), and hand the new one to every running
    task (:meth:`Cluster.tick`). A store that answers the ping was slow, not lost (a loaded
    host): the tasks whose requests failed write again what they could not, on the same store
    (found by the cluster soak: every request that outlived its bound restarted the store,
    which lost every task's keys, and the next request failed again: a storm of stores)."""
    failed = [t for t in active if t.controller and t.controller.executor.store_failed]
    gone = keeper.lost()
    if failed and not gone:
        if keeper.answers():
            why = f"the store at {keeper.info.address} answers a ping"
            for task in failed:
                assert task.controller is not None
                task.controller.store_moved(keeper.client(task.row.uid), now, why, same=True)
            return
        gone = "a request of a coordinator failed, and a ping"
    if not gone:
        return
    why = f"the store at {keeper.info.address} is gone ({gone})"
    log.warning("%s: starting a new one", why)
    keeper.restart()
    for task in active:
        if task.controller is not None:
            task.controller.store_moved(keeper.client(task.row.uid), now, why)
