"""The cluster's tables (a :class:`Node` per agent's machine, a :class:`Task` per submitted
task) and what the planner in the loop reads of them: each task as the allocation sees it
(:func:`plan_view`), the slots it may give out (:func:`plan_capacity`), and what each
task's move costs (:func:`transition_s`) against the expected time to the next failure
(:func:`d_run_s`); and what a task looks like to a person (:func:`task_view`) or to a node's
agent (:func:`assignment`).

Pure functions over the tables, called by :class:`unicron.control.cluster.Cluster` under its
lock (its ``_replan`` asks :func:`unicron.control.allocation.decide` with them).
"""

from __future__ import annotations

import functools
import statistics
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unicron.control import allocation as A
from unicron.control import replicas
from unicron.control.coordinator import Coordinator, CoordinatorSettings
from unicron.control.events import EventLog
from unicron.control.state import ACTIVE, ENDED, NodeRow, State, TaskRow
from unicron.control.storeserver import capability
from unicron.control.taskspec import TaskSpec
from unicron.messages import Assignment
from unicron.planner.hardware import GPU_PRESETS
from unicron.planner.perf import PerfOptions
from unicron.planner.solver import expected_time_to_failure_s
from unicron.protocol import EpochInfo, WorkerSettings
from unicron.runtime import inject

__all__ = [
    "TRANSITIONS_KEPT",
    "Node",
    "Task",
    "ask",
    "assignment",
    "checkpoint_dir",
    "d_run_s",
    "fold",
    "name_node",
    "parked",
    "plan_capacity",
    "plan_event",
    "plan_view",
    "settle",
    "spare_slots",
    "task_end",
    "task_view",
    "transition_s",
    "where",
    "writer_of",
]

TRANSITIONS_KEPT = 16
"""recent transitions per task whose median prices its next one (:func:`transition_s`)"""


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
    fired: set[str] = field(default_factory=set)
    """the injected faults that fired (``fault_injected``): left out of a later assignment,
    so that an agent started again (a node back) does not fire them again"""


# -- the planner's view ----------------------------------------------------------------------
def plan_capacity(free: Mapping[int, NodeRow], tasks: Iterable[Task]) -> dict[int, int]:
    """The slots of each live node (``free``) the allocation may count: an excluded rank's
    slot is nobody's until it is readmitted."""
    capacity = {nid: n.slots for nid, n in free.items()}
    for task in tasks:
        excluded = list(task.excluded)  # a copy: coordinators change it
        for r in excluded if task.row.state in ACTIVE else ():
            node = task.row.placement[r] if r < len(task.row.placement) else -1
            if node in capacity:
                capacity[node] -= 1
    return capacity


def spare_slots(live: Mapping[int, NodeRow], tasks: Iterable[Task]) -> dict[str, int]:
    """Per running task: the slots of live nodes the planner could give it beyond its own,
    the free ones and those other running tasks hold above their minimums (a plan never
    takes a running task below its minimum). A task with fewer slots than its minimum that
    can come back waits for them instead of failing where these make up the difference
    (the cluster's tick hands each coordinator its count; ``unicron run``'s task holds every
    slot: 0). Excluded slots are nobody's (:func:`plan_capacity`)."""
    tasks = [t for t in tasks if t.row.state in ACTIVE]
    capacity = plan_capacity(live, tasks)
    held: dict[str, int] = {}
    for t in tasks:
        excluded = set(t.excluded)  # a copy: coordinators change it
        ranks = [(r, n) for r, n in enumerate(t.row.placement) if n in capacity]
        for r, n in ranks:
            capacity[n] -= r not in excluded  # the excluded are out of it already
        held[t.row.name] = sum(r not in excluded and r not in t.leaving for r, _ in ranks)
    free = sum(max(0, c) for c in capacity.values())
    above = {
        t.row.name: max(0, held[t.row.name] - t.spec.workers.min) if t.controller else 0
        for t in tasks
    }
    return {
        t.row.name: free + sum(above.values()) - above[t.row.name]
        for t in tasks
        if t.controller is not None
    }


def cancel_planned(
    pending: list[tuple[str, int]], task: str, ranks: Iterable[int], placed: int
) -> list[tuple[str, int]]:
    """``pending`` (the cluster's queued additions, ``(task, node)``) without those of
    ``task`` that a plan gives back before they were placed: its planned ranks ``placed +
    k``, the k-th queued addition of a task of ``placed`` ranks (:func:`plan_view`). Before,
    such a release was lost (no coordinator holds a planned rank) and the slot came all the
    same, while a real one had gone (the cluster soak: a task left below its minimum
    failed)."""
    drop = {r - placed for r in ranks if r >= placed}
    out, k = [], 0
    for name, node in pending:
        if name == task:
            k += 1
            if k - 1 in drop:
                continue
        out.append((name, node))
    return out


@dataclass
class Settled:
    """What one tick carries out of the cluster's queued additions (:func:`settle`)."""

    add: list[tuple[str, int]] = field(default_factory=list)
    """``(task, node)``: a new rank of a running task, in the order to add them"""
    start: dict[str, list[int]] = field(default_factory=dict)
    """a queued task's nodes, every slot planned for it free now: it starts"""
    kept: list[tuple[str, int]] = field(default_factory=list)
    """still queued: waiting for a slot to be free"""
    refused: dict[str, int] = field(default_factory=dict)
    """a task and a node without the CUDA device it asks for (the addition is dropped: the
    next plan decides again)"""


def settle(
    pending: list[tuple[str, int]],
    free: Mapping[int, int],
    tasks: Mapping[str, Task],
    gpus: Mapping[int, int | None],
) -> Settled:
    """Which of the queued additions ``pending`` (``(task, node)``, in order) the ``free``
    slots of the live nodes allow now (``gpus``: each node's CUDA devices, None: unknown).
    Running tasks first: one whose replica is one rank gets each slot as it is free; one of
    several ranks (tp x pp) gets all its queued slots at once, once every one is free, so
    that each new rank's place is computed with its whole replica known (added a rank at a
    time as nodes freed up, a replica's ranks were numbered across two planned replicas and
    built the wrong stages: found in review); then a queued task starts once all its slots
    are free. An addition for a task that ended or a node that went is dropped (the next
    plan decides again), and with it the rest of a task's of several ranks per replica (a
    part of a replica would be a short group). Pure."""
    left, out = dict(free), Settled()
    wanted: dict[str, list[int]] = {}
    dropped: set[str] = set()
    for name, node in pending:
        task = tasks.get(name)
        if task is None or task.row.state in ENDED or task.row.state == "cancelled":
            continue
        if node not in left or (task.spec.device == "cuda" and gpus.get(node) == 0):
            if node in left:
                out.refused[name] = node
            dropped.add(name)
            continue
        wanted.setdefault(name, []).append(node)
    for name in dropped:
        if tasks[name].spec.replica_ranks > 1:
            wanted.pop(name, None)
    order = sorted(wanted, key=lambda name: tasks[name].controller is None)  # running first
    for name in order:
        task, nodes = tasks[name], wanted[name]
        if task.controller is not None and task.spec.replica_ranks == 1:
            for node in nodes:
                if left[node] > 0:
                    left[node] -= 1
                    out.add.append((name, node))
                else:
                    out.kept.append((name, node))
            continue
        if any(left[n] < nodes.count(n) for n in set(nodes)):
            out.kept += [(name, n) for n in nodes]
            continue
        for n in nodes:
            left[n] -= 1
        if task.controller is None:
            out.start[name] = sorted(nodes)
        else:
            out.add += [(name, n) for n in nodes]
    return out


def plan_view(task: Task, planned: list[int], transition: float) -> A.TaskView | None:
    """``task`` as the allocation sees it (``None``: it is not to be planned): its ranks and
    their nodes (a rank leaving or excluded is not its own; ``planned``: the nodes of the
    slots queued for it, held where they go), its throughput model, its measured
    ``transition`` and its ranks parked beside an excluded partner."""
    if task.row.state not in ("queued", *ACTIVE) or task.row.state == "cancelled":
        return None
    ranks = {
        r: n
        for r, n in enumerate(task.row.placement)
        if n >= 0 and r not in task.leaving and r not in task.excluded
    }
    first = len(task.row.placement)  # queued slots get the next ranks, in queue order
    for k, node in enumerate(planned):
        ranks[first + k] = node
    c = task.controller
    return A.TaskView(
        name=task.row.name,
        weight=task.spec.weight,
        min_workers=task.spec.workers.min,
        max_workers=task.spec.workers.max,
        ranks=ranks,
        running=c is not None,
        microbatches=None if c is None else c.microbatches,
        model=task.spec.planner_model(),
        global_batch=task.spec.global_batch or 0,
        transition_s=transition,
        replica_ranks=task.spec.smallest_replica,
        tp=task.spec.smallest_layout[0],
        parked=parked(task),
        members=frozenset() if c is None else frozenset(c.members),
        optimizer_copies=2 if task.spec.zero else 1,
        planned=frozenset(range(first, first + len(planned))),
        layout=(1, 1) if c is None else c.book.lay,
        apart={r: n for r, n in placed(task).items() if r in task.excluded},
        layouts=_priced_layouts(task.spec),
    )


def _priced_layouts(spec: TaskSpec) -> tuple[tuple[int, int], ...]:
    """The layouts the allocation prices ``spec`` at: its own model-parallel ones, or none
    (the performance model's best, as for a data-parallel task: an FSDP replica's ranks are
    a block of a node, not a tensor-parallel degree)."""
    return spec.layouts if spec.layouts != ((1, 1),) and spec.fsdp == 1 else ()


def placed(task: Task) -> dict[int, int]:
    """``task``'s ranks and their nodes (a rank given back is on none)."""
    return {r: n for r, n in enumerate(task.row.placement) if n >= 0}


def replica_places(task: Task) -> dict[int, int]:
    """Each rank's place in its replica at the task's own layout
    (:mod:`unicron.control.replicas`)."""
    return replicas.places(placed(task), (task.spec.block, task.spec.pp))


def parked(task: Task) -> frozenset[int]:
    """The ranks of ``task`` waiting for an excluded rank of their replica (grouped at its
    smallest layout: :mod:`unicron.control.replicas`)."""
    lay, excluded = task.spec.smallest_layout, set(task.excluded)  # (coordinators change it)
    if lay[0] * lay[1] == 1 or not excluded:
        return frozenset()
    out: set[int] = set()
    for group in replicas.groups(placed(task), lay):
        if any(r in excluded for r in group):
            out.update(r for r in group if r not in excluded)
    return frozenset(out)


def transition_s(task: Task, tasks: Iterable[Task]) -> float:
    """What a change of ``task``'s worker count costs it, measured: the median of its recent
    transitions (an epoch plus the state its joiners took), else of every task's, else the
    allocation's prior (:data:`~unicron.control.allocation.TRANSITION_S`)."""
    seen = list(task.transitions) or [d for t in tasks for d in t.transitions]
    return float(statistics.median(seen)) if seen else A.TRANSITION_S


def d_run_s(up_s: float, failures_seen: int, nodes: int) -> float:
    """Expected time to the next failure: a prior of one failure per node and day, refined
    by the ``failures_seen`` in the cluster's ``up_s`` seconds (docs/planner.md)."""
    days = max(up_s, 0.0) / 86400.0
    rate = (1.0 + failures_seen) / (1.0 + days)  # per node and day
    return expected_time_to_failure_s(rate, max(nodes, 1))


# -- what others see of a task ---------------------------------------------------------------
def checkpoint_dir(task: Task, state_dir: Path) -> Path | None:
    """Where the task's checkpoints go; ``None``: it writes none (and has none to read)."""
    ck = task.spec.checkpoint
    if ck.every == 0 and not ck.resume:
        return None
    return Path(ck.dir) if ck.dir else state_dir / "tasks" / task.row.uid / "checkpoints"


def coordinator_settings(
    spec: TaskSpec,
    checkpoint: Path | None,
    committed_before: int | None,
    *,
    gpu: str = "",
    gpus_per_node: int = 1,
) -> CoordinatorSettings:
    """The settings of a task's coordinator (the cluster's :meth:`_start`): its task file's,
    where its ``checkpoint`` directory is and the steps committed before it starts; with the
    cluster's ``gpu`` (a preset) and a task that describes its ``model`` and may change its
    layout, the performance model picks each epoch's layout (:func:`~unicron.control.allocation.
    layout_rate`)."""
    model = spec.planner_model()
    rate = None
    if gpu and model is not None and spec.global_batch and spec.layouts != ((1, 1),):
        priced = functools.partial(
            A.layout_rate, model, spec.global_batch, GPU_PRESETS[gpu], max(gpus_per_node, 1),
            PerfOptions(optimizer_copies=2 if spec.zero else 1),
        )  # fmt: skip
        asked = [
            (tp, pp, n)
            for tp, pp in spec.layouts
            for n in range(tp * pp, spec.workers.max + 1, tp * pp)
        ]
        # priced ahead, off the coordinator's and the cluster's locks (each is a search of
        # ~0.1 s; memoised): the membership judge and the allocation ask for them
        threading.Thread(
            target=lambda: [priced(*a) for a in asked], name="layout-rates", daemon=True
        ).start()
        rate = priced if len(spec.layouts) > 1 else None
    return CoordinatorSettings(
        rate=rate,
        min_workers=spec.workers.min,
        replica_ranks=spec.replica_ranks,
        tp=spec.block,
        layouts=spec.layouts if len(spec.layouts) > 1 else (),
        checkpoint=checkpoint,
        committed_before=committed_before,
        readmit_after_s=spec.readmit_after,
        give_up_after_s=spec.give_up_after,
        nodes_return=True,  # an agent registers again; the planner gives other slots
        zero=bool(spec.zero),
    )


def assignment(
    task: Task, nid: int, store: str, store_secret: bytes, checkpoint: Path | None
) -> Assignment:
    """What node ``nid``'s agent needs to run its part of ``task``, the training ``store``'s
    address and the task's capability there under ``store_secret`` among it. The faults to
    inject leave out those that fired (:attr:`Task.fired`): an agent started again, on a node
    back, must not fire them twice (a fault that waits for ``members`` would: found in
    review)."""
    spec = task.spec
    settings = WorkerSettings(
        reduce=spec.reduce,
        on_lost=spec.on_lost,
        bucket_cap_mb=spec.bucket_cap_mb,
        checkpoint="" if checkpoint is None else str(checkpoint),
        checkpoint_every=str(spec.checkpoint.every),
        checkpoint_mtbf_s=spec.checkpoint.mtbf,
        checkpoint_keep=spec.checkpoint.keep,
        resume=spec.checkpoint.resume,
        tp=spec.block,
        pp=spec.pp,
        pp_choices=",".join(map(str, spec.depths[1:])),
        tp_choices=",".join(map(str, spec.degrees[1:])),
        zero=spec.zero,
        fsdp=spec.fsdp,
    )
    mine = [rank for rank, n in enumerate(task.row.placement) if n == nid]
    places = replica_places(task)
    return Assignment(
        uid=task.row.uid,
        name=task.row.name,
        slots=tuple(mine),
        places=tuple(places[r] for r in mine),
        script=spec.script,
        args=tuple(spec.args),
        inject=tuple(f for f in spec.inject if inject.parse(f).spec not in task.fired),
        threads=spec.threads,
        store=store,
        store_key=capability(store_secret, task.row.uid),
        device=spec.device,
        settings=settings,
        env=dict(spec.env),
    )


def task_view(task: Task, nodes: Mapping[int, Node], owner: str, plan_error: str) -> dict[str, Any]:
    """``task`` for ``unicron status`` and the API: its state, progress, placement by node
    name, limits, last fault, why it waits, owner and outcome."""
    row = task.row
    c = task.controller
    return {
        "name": row.name,
        "uid": row.uid,
        "state": row.state,
        "epoch": row.epoch,
        "step": row.committed_step,
        "workers": row.workers,
        "placement": [nodes[n].row.name for n in row.placement if n in nodes],
        "min_workers": task.spec.workers.min,
        "max_workers": task.spec.workers.max,
        "weight": task.spec.weight,
        "last_fault": row.last_fault,
        "waiting": c.waiting_reason if c is not None else task.refused or task.held_back,
        "submitted_ts": row.submitted_ts,
        "owner": owner,
        "outcome": row.outcome,
        "plan_error": plan_error,  # the planner failed: the allocation was kept
    }


# -- what a task's events change ---------------------------------------------------------------
def where(task: Task, nodes: Mapping[int, Node], e: dict[str, Any]) -> str:
    """Where an event happened, for a person: "slot 2 (node gpu-17)", "node gpu-17"."""
    if "slot" in e:
        slot = int(e["slot"])
        nid = task.row.placement[slot] if 0 <= slot < len(task.row.placement) else -1
        node = nodes.get(nid)
        return f"slot {slot}" + (f" (node {node.row.name})" if node is not None else "")
    return f"node {e.get('node_name', e.get('node'))}"


def fold(task: Task, e: dict[str, Any], nodes: Mapping[int, Node]) -> tuple[bool, str | None]:
    """Apply one event of ``task``'s log to its row and its sets: (whether the row changed,
    the planner's trigger it is or ``None``). A trigger is what changes what the planner
    sees: a slot excluded (a straggler dropped, a device fault, restarts that keep failing)
    or readmitted, a straggler found."""
    row, kind = task.row, e["event"]
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
    elif kind == "fault_injected" and "spec" in e:
        task.fired.add(str(e["spec"]))
        changed = False
    elif kind == "error_detected":
        row.last_fault = f"{e.get('kind')} (SEV{e.get('severity')}) on {where(task, nodes, e)}"
    elif kind == "action" and e.get("action") == "wait" and row.state in ACTIVE:
        row.state = "waiting"
    else:
        changed = False
    slot, name = e.get("slot"), row.name
    if kind == "action" and e.get("action") in ("exclude", "readmit") and slot is not None:
        if e["action"] == "exclude":
            task.excluded.add(int(slot))
        else:
            task.excluded.discard(int(slot))
        done = "excluded" if e["action"] == "exclude" else "readmitted"
        return changed, f"slot {slot} of task {name} {done}"
    if kind == "error_detected" and e.get("kind") == "straggler":
        return changed, f"straggler on slot {slot} of task {name}"
    return changed, None


# -- the planner's question and answer ----------------------------------------------------------
def ask(
    tasks: Mapping[str, Task],
    pending: list[tuple[str, int]],
    free: Mapping[int, NodeRow],
    *,
    gpu: str,
    placement: A.Placement,
    up_s: float,
    failures_seen: int,
    trigger: str,
) -> A.Decision | None:
    """The allocation's decision for every task on the live nodes ``free`` (``pending``:
    slots queued for a task, held where they go), or ``None`` when there is nothing to plan.
    An error of the planner is raised (the cluster keeps its allocation)."""
    capacity = plan_capacity(free, tasks.values())
    per_node = max(capacity.values(), default=1)  # GPUs per node, for the perf model
    views = []
    for task in tasks.values():
        planned = [n for name, n in pending if name == task.row.name]
        view = plan_view(task, planned, transition_s(task, tasks.values()))
        if view is not None:
            views.append(view)
    if not views or not capacity:
        return None
    return A.decide(
        views,
        capacity,
        d_run_s(up_s, failures_seen, len(capacity)),
        placement=placement,
        task_event=any(t.startswith("task ") for t in trigger.split("; ")),
        hardware=A.Hardware(GPU_PRESETS[gpu], max(per_node, 1)),
    )


def plan_event(
    decision: A.Decision, task: str, trigger: str, placement: A.Placement, decision_s: float
) -> dict[str, Any]:
    """The fields of ``task``'s ``plan`` event: the allocation before and after, both WAFs,
    the reason and how long the decision took."""
    return {
        "task": task,
        "trigger": trigger,
        "allocation": {m.task: m.after for m in decision.moves},
        "allocation_before": {m.task: m.before for m in decision.moves},
        "waf_before": round(decision.waf_before, 6),
        "waf_after": round(decision.waf_after, 6),
        "reason": decision.reasons.get(task, ""),
        "placement": placement,
        "decision_ms": round(decision_s * 1000.0, 3),
    }


def name_node(nodes: Mapping[int, Node], e: dict[str, Any]) -> None:
    """An event that names a node by number gets its name beside it (``node_name``): the name
    is what ``unicron status``, the agent's ``--node-name`` and a person use."""
    nid = e.get("node")
    node = nodes.get(nid) if isinstance(nid, int) else None
    if node is not None:
        e["node_name"] = node.row.name


def writer_of(spec: TaskSpec, tasks: Iterable[Task], state_dir: Path) -> Task | None:
    """The live task that writes into ``spec``'s checkpoint directory, if any: two tasks
    never write into one (a task that goes on from a cancelled one waits until that one's
    workers are stopped)."""
    if not spec.checkpoint.dir:
        return None
    mine = Path(spec.checkpoint.dir).resolve()
    for t in tasks:
        theirs = checkpoint_dir(t, state_dir)
        live = t.row.state not in ENDED or t.controller is not None
        if live and theirs is not None and theirs.resolve() == mine:
            return t
    return None


def logged_epoch(state: State, row: TaskRow) -> EpochInfo | None:
    """The task's last epoch as its event log records it (``epoch_begin``; ``None``: none
    logged): what a coordinator that restarted without its store announces again, on the
    new one (:meth:`Coordinator.adopt`). Called by the cluster service at start-up."""
    e = state.last_event(row.name, "epoch_begin")
    if e is None:
        return None
    members = tuple(int(m) for m in e.get("members", ()))
    nodes = tuple(row.placement[m] for m in members)
    return EpochInfo(int(e["epoch"]), members, nodes, True, float(e["ts"]),
                     int(e.get("pp", 0)), int(e.get("tp", 0)))  # fmt: skip


def logged_pace(state: State, row: TaskRow, last: int = 20) -> float | None:
    """The task's step time as its event log records it (the median ``duration_s`` of its
    ``last`` committed steps; ``None``: none logged): the pace by which a coordinator that
    adopted the task judges stalls until its own step monitor has learned one
    (:meth:`Coordinator.adopt`). Called by the cluster service at start-up."""
    durations = [float(e["duration_s"]) for e in state.last_events(row.name, "step_end", last)
                 if isinstance(e.get("duration_s"), int | float)]  # fmt: skip
    return statistics.median(durations) if durations else None


def task_end(task: Task, status: str, result: dict[str, Any], reason: str, now: float
             ) -> dict[str, Any]:  # fmt: skip
    """The fields of ``task``'s ``task_end`` event: how it ended, its steps, loss and digest,
    the reason if it did not finish, its wall time since it was submitted."""
    return {
        "task": task.row.name,
        "status": "ok" if status == "done" else status,
        "steps": result.get("steps"),
        "final_loss": result.get("final_loss"),
        "params_sha256": result.get("params_sha256"),
        "reason": None if status == "done" else reason,
        "wall_s": round(now - task.row.submitted_ts, 3),
    }
