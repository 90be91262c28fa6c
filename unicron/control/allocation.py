"""The cluster's allocation: how many slots each task gets, and which slots move.

:func:`decide` is called by :class:`~unicron.control.cluster.Cluster` on every trigger (a task
submitted or ended, a node lost or back, a slot excluded or readmitted, a straggler found).
Under the default placement (``planner``) it asks the planner's solver
(:func:`unicron.planner.solve`) for the worker counts that maximise the cluster's weighted
achieved throughput, counting each task's transition against the expected time to the next
failure, then turns the counts into moves: which of a task's launch ranks to give back (on
the nodes where it holds the fewest, so that it stays packed) and on which nodes a growing or
starting task gets its slots (the nodes it is on first). Packed, but never on one node where
the task has two replicas or more and a second node has room: a node lost then leaves a
replica whose state heals the others, where one node holding them all would send the task
back to its checkpoint, redoing the steps since. Pure: no clock, no I/O.

Throughput model, in one unit for every task (worker-equivalents: what ``u`` workers do,
counted in what one worker does at its best):

- a task that describes its ``model`` (and ``global_batch``) in its file is priced by the
  planner's performance model (:func:`unicron.planner.throughput_table`): the achieved FLOP/s
  of its fastest layout on ``u`` slots of the cluster's GPU type (``unicron coordinator
  --gpu``; a node's slots are its GPUs), divided by the best FLOP/s per GPU over all counts.
  A count on which no layout fits is worth 0, and a count that divides badly is worth less
  than its neighbours; the reason names the layout (``tp2 pp1 dp3 ...``);
- any other task makes ``M / ceil(M / u)`` micro-batch rounds' worth of progress on ``u``
  workers (``M`` micro-batches per step: a step lasts as many rounds as its busiest worker
  computes); until its workers report ``M`` it is taken as linear.

Each task's transition costs its own measured time (:attr:`TaskView.transition_s`: the
cluster passes the median of its recent ``transition_end`` durations, an epoch plus its
state transfer), against the expected time to the next failure.

Two baseline placements (``unicron coordinator --placement``; docs/cluster.md) exist to
measure what the planner gains (``python -m bench.simreal``): ``keep`` places tasks with the
planner when a task is submitted or ends (its initial slots) and moves nothing between tasks
on node and slot events (a task shrinks when it loses a node and regains only its own slots,
which its coordinator readmits); ``equal`` gives every task an equal share of the live
slots on every trigger (``floor(slots / tasks)`` each, one more to each of the first
``slots mod tasks`` in submission order; within each task's min and max), whatever the
weights.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from unicron.control import replicas
from unicron.planner import (
    GPUSpec,
    ModelSpec,
    ParallelConfig,
    PerfOptions,
    TaskState,
    layout_table,
    solve,
    throughput_table,
)
from unicron.planner.perf import fitting_layouts

TRANSITION_S = 2.0
"""what a change of a task's worker count costs it before any transition of the cluster was
measured (an epoch, a state transfer to joiners; ~0.1-0.4 s measured on this machine's
example, 5-20x headroom)"""


@dataclass(frozen=True)
class Hardware:
    """What one slot is, for the performance model: its GPU type and how many a node holds."""

    gpu: GPUSpec
    gpus_per_node: int


Placement = Literal["planner", "keep", "equal"]
PLACEMENTS: tuple[Placement, ...] = ("planner", "keep", "equal")


@dataclass(frozen=True, kw_only=True)
class TaskView:
    """One task as the allocation sees it."""

    name: str
    weight: float
    min_workers: int
    max_workers: int
    ranks: dict[int, int]
    """launch rank -> node of every slot it holds now (empty when queued), and of the slots
    queued for it (:attr:`planned`)"""
    running: bool
    """started (its count never drops below its minimum, nor to 0, by a plan)"""
    microbatches: int | None = None
    model: ModelSpec | None = None
    """the planner's description of what it trains (its task file's ``model``), or None"""
    global_batch: int = 0
    """sequences per step, for :attr:`model`"""
    transition_s: float = TRANSITION_S
    """what a change of its worker count costs it, seconds (measured by the cluster)"""
    replica_ranks: int = 1
    """ranks per replica (``tp * pp``): its counts are multiples of it, and whole replicas
    move together (blocks of :attr:`tp` slots of one node, :mod:`unicron.control.replicas`)"""
    tp: int = 1
    """tensor-parallel ranks per pipeline stage of its replica: a block of that many slots
    of one node"""
    parked: frozenset[int] = frozenset()
    """ranks (in :attr:`ranks`) whose replica has an excluded rank: they wait for it, idle,
    and a plan neither counts them nor gives them back (the replica is whole again once the
    excluded rank passes its health probe)"""
    members: frozenset[int] = frozenset()
    """ranks in the task's current epoch: they hold its state, or get it in the epoch's
    transition (a rank readmitted or added since holds none yet); a shrinking task gives
    back the others first"""
    optimizer_copies: int = 1
    """keepers of each share of a sharded optimizer state in the performance model: 2 for a
    task with ``zero: 1`` (:attr:`unicron.planner.PerfOptions.optimizer_copies`)"""
    planned: frozenset[int] = frozenset()
    """ranks (in :attr:`ranks`) only planned: slots queued for it, numbered after its placed
    ranks in the order they will be added, so that they group as they will once placed"""
    layout: tuple[int, int] = (1, 1)
    """``(tp, pp)`` its current epoch runs at: what it gives back leaves every other placed
    rank its place in its replica at it (:func:`_keeps_places`)"""
    apart: dict[int, int] = field(default_factory=dict)
    """rank -> node of its excluded ranks: in no count and never given back, but in its
    coordinator's slot table, where they take part in the grouping into replicas"""
    layouts: tuple[tuple[int, int], ...] = ()
    """the ``(tp, pp)`` layouts a model-parallel task runs at (its coordinator picks among
    them): :attr:`model` is priced at those only; empty: at the performance model's best
    layout on each count (a data-parallel task, whose ``model`` describes what it trains)"""


@dataclass(frozen=True)
class Move:
    """The plan for one task: ranks it gives back, nodes it gets a new slot on (one entry per
    slot), and its worker counts before and after."""

    task: str
    before: int
    after: int
    release: tuple[int, ...] = ()
    add_on: tuple[int, ...] = ()


@dataclass(frozen=True)
class Decision:
    moves: tuple[Move, ...]
    waf_before: float
    waf_after: float
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return any(m.before != m.after for m in self.moves)


def throughput(t: TaskView, units: int, hardware: Hardware | None = None) -> np.ndarray:
    """Relative throughput of ``t`` on 0..units workers (capped at its maximum), in
    worker-equivalents (see the module docstring): from the performance model when ``t``
    describes its model and ``hardware`` is known and some count fits, else from its
    micro-batches."""
    priced = _priced(t, units, hardware)
    out = np.zeros(units + 1)
    for u in range(1, units + 1):
        k = (
            min(u, t.max_workers) // t.replica_ranks * t.replica_ranks
        )  # ranks beyond whole replicas idle
        if k == 0:
            continue
        if priced is not None:
            out[u] = priced[k]
        else:
            m = t.microbatches
            out[u] = k if not m else m / math.ceil(m / k)
    return out


def _priced(t: TaskView, units: int, hardware: Hardware | None) -> np.ndarray | None:
    """The performance model's achieved FLOP/s of ``t`` on 0..units slots over the best
    FLOP/s per slot (all 0 when no count fits), or None: no model or no hardware."""
    if t.model is None or hardware is None or units < 1 or t.global_batch < 1:
        return None
    if t.layouts:  # the fastest of its own layouts, each on its whole replicas
        table = np.array([_own(t, u, hardware)[0] for u in range(units + 1)])
    else:
        table = throughput_table(t.model, t.global_batch, units, hardware.gpu,
                                 hardware.gpus_per_node, options=_options(t))  # fmt: skip
    per_slot = max(float(table[u]) / u for u in range(1, units + 1))
    return np.zeros(units + 1) if per_slot <= 0 else np.asarray(table) / per_slot


def _own(t: TaskView, slots: int, hardware: Hardware) -> tuple[float, ParallelConfig | None]:
    """The fastest of ``t``'s own :attr:`~TaskView.layouts` on ``slots`` (each on as many
    whole replicas as fit): its achieved FLOP/s (0: none fits) and its configuration."""
    best: tuple[float, ParallelConfig | None] = (0.0, None)
    assert t.model is not None
    for tp, pp in t.layouts:
        gpus = min(slots, t.max_workers) // (tp * pp) * (tp * pp)
        cfg = layout_config(t.model, t.global_batch, hardware.gpu, hardware.gpus_per_node,
                            _options(t), tp, pp, gpus)  # fmt: skip
        if cfg is not None and cfg.achieved_flops > best[0]:
            best = (cfg.achieved_flops, cfg)
    return best


@functools.lru_cache(maxsize=4096)
def layout_config(
    model: ModelSpec,
    global_batch: int,
    gpu: GPUSpec,
    gpus_per_node: int,
    options: PerfOptions,
    tp: int,
    pp: int,
    gpus: int,
) -> ParallelConfig | None:
    """The performance model's fastest configuration of ``model`` at ``global_batch`` on
    ``gpus`` GPUs laid out ``tp`` x ``pp`` x data parallel (its micro-batch, recomputation
    and sharding searched, no context parallelism), None where none fits. Memoised (a search
    of about 0.1 s): the allocation prices a task's own layouts with it, and the membership
    judge picks among them (:func:`layout_rate`)."""
    if gpus < 1:
        return None
    for cfg in fitting_layouts(model, global_batch, gpus, gpu, gpus_per_node, options):
        if (cfg.tp, cfg.pp, cfg.layout.cp if cfg.layout else 1) == (tp, pp, 1):
            return cfg  # fastest first
    return None


def layout_rate(
    model: ModelSpec,
    global_batch: int,
    gpu: GPUSpec,
    gpus_per_node: int,
    options: PerfOptions,
    tp: int,
    pp: int,
    gpus: int,
) -> float:
    """The achieved FLOP/s of :func:`layout_config` (0 where none fits): what the membership
    judge weighs a task's layouts by (:func:`unicron.control.membership.layout`)."""
    cfg = layout_config(model, global_batch, gpu, gpus_per_node, options, tp, pp, gpus)
    return 0.0 if cfg is None else cfg.achieved_flops


def _options(t: TaskView) -> PerfOptions:
    """The performance model's options for ``t`` (its sharded optimizer's copies)."""
    return PerfOptions(optimizer_copies=t.optimizer_copies)


def layout_of(t: TaskView, workers: int, within: int, units: int, hardware: Hardware | None) -> str:
    """What the performance model says of ``t`` on ``workers`` slots, for the plan's reason:
    its layout (``on 6: tp2 pp1 dp3 ...``), that none fits on any count up to ``within``
    (the slots it could have had), or ``""`` (a task without a model, or waiting for other
    reasons). Read from the search that priced it on ``units`` slots (:func:`_priced`)."""
    if t.model is None or hardware is None or t.global_batch < 1 or units < 1:
        return ""
    gpu, gpn = hardware.gpu, hardware.gpus_per_node
    if t.layouts:
        configs = tuple(None if u == 0 else _own(t, u, hardware)[1] for u in range(units + 1))
    else:
        configs = layout_table(t.model, t.global_batch, units, gpu, gpn, options=_options(t))
    if workers < 1:
        most = min(t.max_workers, within)
        if most < 1 or any(c is not None for c in configs[1 : most + 1]):
            return ""
        return (
            f"no layout of {t.model.name} at global batch {t.global_batch} "
            + (f"at {_named(t.layouts)} " if t.layouts else "")
            + f"fits on up to {most} slot(s) of {gpu.name} ({gpn} per node)"
        )
    cfg = configs[workers]
    return f"on {workers}: " + ("no layout fits" if cfg is None else cfg.describe())


def _named(layouts: tuple[tuple[int, int], ...]) -> str:
    return " or ".join(f"tp{tp} pp{pp}" for tp, pp in layouts)


def decide(
    tasks: list[TaskView],
    capacity: dict[int, int],
    d_run_s: float,
    *,
    placement: Placement = "planner",
    task_event: bool = True,
    hardware: Hardware | None = None,
) -> Decision:
    """The allocation of ``capacity`` (live node -> slots) to ``tasks`` (see the module
    docstring). A running task keeps at least its minimum (preemption is not done here): its
    minimum is reserved, and the solver shares the rest by each task's marginal throughput;
    slots on lost nodes are not counted as held. ``task_event``: the trigger includes a task
    submitted or ended (the ``keep`` placement plans only then). ``hardware``: what a slot
    is, for tasks that describe their model (None: every task by its micro-batches)."""
    units = sum(capacity.values())
    tasks = [_park_broken(t, capacity) for t in tasks]
    held = {
        t.name: min(
            sum(1 for r, n in t.ranks.items() if n in capacity and r not in t.parked), units
        )
        for t in tasks
    }
    reserved = {t.name: t.min_workers if t.running else 0 for t in tasks}
    spare = units - sum(reserved.values())
    if spare < 0 or (placement == "keep" and not task_event):
        # not even the running tasks' minimums fit, or a baseline that never moves a slot
        # between tasks on node and slot events: nothing to move
        why = "keep placement: nothing moves on node and slot events" if spare >= 0 else ""
        return Decision(
            tuple(Move(t.name, held[t.name], held[t.name]) for t in tasks),
            0.0,
            0.0,
            dict.fromkeys((t.name for t in tasks), why),
        )
    full = [throughput(t, units, hardware) for t in tasks]
    if placement == "equal":
        target, reasons = _equal(tasks, units)
    else:
        target, reasons = _planned(tasks, full, held, reserved, spare, units, d_run_s)
    for t in tasks:
        said = layout_of(t, target[t.name], spare + reserved[t.name], units, hardware)
        if said.startswith("no layout"):
            reasons[t.name] = f"waits: {said}"
        elif said:
            reasons[t.name] = f"{reasons[t.name]}; {said}".lstrip("; ")
    waf_before = sum(
        t.weight * f[held[t.name]] for t, f in zip(tasks, full, strict=True) if held[t.name]
    )
    waf_after = sum(
        t.weight * f[target[t.name]]
        for t, f in zip(tasks, full, strict=True)
        if target[t.name] >= t.min_workers
    )
    moves = _moves(tasks, capacity, held, target)
    return Decision(tuple(moves), float(waf_before), float(waf_after), reasons)


def _park_broken(t: TaskView, capacity: dict[int, int]) -> TaskView:
    """``t`` with the ranks of each replica that has a rank on a lost node (not in
    ``capacity``) parked too. Its coordinator excludes a lost node's slots, and the cluster
    parks their partners (:func:`unicron.control.planning.parked`), but a plan may come
    first: grouped without the lost ranks, a replica's live stages paired with another
    replica's, and a give-back took half of each (a replica whose stages span nodes)."""
    lost = {r for r, n in t.ranks.items() if n not in capacity}
    if t.replica_ranks == 1 or not lost:
        return t
    # the parked ranks leave whole replicas out: the others group as the coordinator's do
    rest = {r: n for r, n in t.ranks.items() if r not in t.parked}
    lay = (t.tp, t.replica_ranks // t.tp)
    broken = {r for g in replicas.groups(rest, lay) if not lost.isdisjoint(g) for r in g}
    return replace(t, parked=t.parked | (broken - lost))


def _groups(t: TaskView, capacity: dict[int, int]) -> list[tuple[int, ...]]:
    """``t``'s ranks on live nodes as its replicas would group them
    (:func:`unicron.control.replicas.groups`; a short group is a replica never whole)."""
    on = {r: n for r, n in t.ranks.items() if n in capacity and r not in t.parked}
    return list(replicas.groups(on, (t.tp, t.replica_ranks // t.tp)))


def _keeps_places(t: TaskView, gone: list[int]) -> bool:
    """Whether giving back ``gone`` leaves every other placed rank of ``t`` its place in its
    replica at the layout its epoch runs at. A slot's place is fixed for its life
    (:mod:`unicron.control.replicas`): its worker holds that place's shard, and the
    coordinator groups the slots left in its table again once those given back are gone.
    (Found by a review: a task of two layouts gave back a block of its smallest one from the
    middle of its current one; the rest regrouped under the running epoch, other holders
    were judged by places their workers did not hold, and the next epoch lost a stage.)"""
    if t.layout[0] * t.layout[1] == 1:
        return True
    table = {r: n for r, n in t.ranks.items() if r not in t.planned} | t.apart
    out = set(gone)
    before = replicas.places(table, t.layout)
    after = replicas.places({r: n for r, n in table.items() if r not in out}, t.layout)
    return all(before[r] == p for r, p in after.items())


def _blocks(t: TaskView, capacity: dict[int, int], given: list[int]) -> list[tuple[int, ...]]:
    """``t``'s blocks at the layout it runs at (``tp`` slots of one node, and the slots of a
    node left over) that it may give back, last first: where no replica of its smallest
    layout can go without moving another rank's place (a smaller tensor-parallel degree, or
    a replica of that one across blocks of the running one)."""
    mine = {r: n for r, n in t.ranks.items()
            if n in capacity and r not in t.parked and r not in given}  # fmt: skip
    return list(reversed(replicas.groups(mine, (t.layout[0], 1))))


def _spread(free: dict[int, int], mine: dict[int, int], t: TaskView) -> list[int] | None:
    """The nodes of one replica of ``t`` whose stages no single node holds: a block of
    ``t.tp`` slots at a time, packed like whole replicas (nodes it is on, then the freest);
    ``None`` where the free slots hold no replica."""
    left, had, out = dict(free), dict(mine), list[int]()
    for _ in range(t.replica_ranks // t.tp):
        open_ = [n for n in left if left[n] >= t.tp]
        if not open_:
            return None
        n = max(open_, key=lambda n: (had[n], left[n], -n))
        left[n] -= t.tp
        had[n] += t.tp
        out.append(n)
    return out


def _equal(tasks: list[TaskView], units: int) -> tuple[dict[str, int], dict[str, str]]:
    """Equal shares of ``units`` (the ``equal`` baseline; see the module docstring)."""
    share, extra = divmod(units, len(tasks))
    target = {
        t.name: min(max(share + (1 if i < extra else 0), t.min_workers), t.max_workers)
        // t.replica_ranks
        * t.replica_ranks
        for i, t in enumerate(tasks)
    }
    over = sum(target.values()) - units
    for t in reversed(tasks):  # minimums above the share: the last submitted give way
        if over <= 0:
            break
        cut = min(over, target[t.name])
        target[t.name] -= cut
        over -= cut
    why = f"equal placement: {units} slot(s) over {len(tasks)} task(s)"
    return target, dict.fromkeys(target, why)


def _planned(
    tasks: list[TaskView],
    full: list[np.ndarray],
    held: dict[str, int],
    reserved: dict[str, int],
    spare: int,
    units: int,
    d_run_s: float,
) -> tuple[dict[str, int], dict[str, str]]:
    """The planner's worker counts: running minimums reserved, the rest solved."""
    states = []
    for t, f in zip(tasks, full, strict=True):
        base = reserved[t.name]
        marginal = np.zeros(spare + 1)
        for k in range(1, spare + 1):
            marginal[k] = f[min(base + k, units)] - f[base]
        states.append(
            TaskState(
                name=t.name,
                weight=t.weight,
                min_units=0 if t.running else t.min_workers,
                current_units=min(max(held[t.name] - base, 0), spare),
                flops=marginal,
                transition_s=t.transition_s,
            )
        )
    plan = solve(states, spare, d_run_s, rate_unit=("worker-equivalents", 1.0))
    target = {
        t.name: min(reserved[t.name] + plan.allocation[t.name], t.max_workers)
        // t.replica_ranks
        * t.replica_ranks
        for t in tasks
    }
    reasons = {
        t.name: (f"beyond its minimum of {t.min_workers}: " if t.running else "")
        + plan.reasons[t.name]
        for t in tasks
    }
    return target, reasons


def _worth(t: TaskView, g: tuple[int, ...]) -> tuple[bool, bool]:
    """How much replica ``g`` of ``t`` is worth keeping, least first: whether it is placed
    (not only planned), whether it holds the task's state (is in the current epoch)."""
    return t.planned.isdisjoint(g), not t.members.isdisjoint(g)


def _spared(
    t: TaskView, groups: list[tuple[int, ...]], given: list[int], left: int, live: dict[int, int]
) -> tuple[int, ...]:
    """The next replica ``t`` gives back, ``groups`` in order of preference (those only
    planned first, then those holding no state), ``left`` ranks it keeps: of the first kind,
    the first whose loss leaves it on two nodes or more where it keeps two replicas or more
    (a node lost then leaves a replica to heal from), else the first."""
    if left < 2 * t.replica_ranks:
        return groups[0]
    for g in groups:
        if _worth(t, g) != _worth(t, groups[0]):
            break
        out = {*given, *g, *t.parked}
        if len({n for r, n in t.ranks.items() if n in live and r not in out}) >= 2:
            return g
    return groups[0]


def _moves(
    tasks: list[TaskView], capacity: dict[int, int], held: dict[str, int], target: dict[str, int]
) -> list[Move]:
    """Which ranks each shrinking task gives back, and where each growing one gets slots."""
    free = dict(capacity)
    for t in tasks:
        for n in t.ranks.values():
            if n in free:
                free[n] -= 1
    moves: list[Move] = []
    for t in tasks:  # shrinking first: their slots free up
        if target[t.name] < held[t.name]:
            # whole replicas (those only planned first, then short ones, and those holding
            # no state), from the nodes where it holds the fewest
            count = {n: sum(1 for m in t.ranks.values() if m == n) for n in capacity}
            groups = sorted(
                _groups(t, capacity),
                key=lambda g: (
                    *_worth(t, g),
                    len(g) == t.replica_ranks,
                    count[t.ranks[g[0]]],
                    -g[0],
                ),
            )
            give_back: list[int] = []
            while held[t.name] - len(give_back) > target[t.name]:
                gone = set(give_back)
                ok = [g for g in groups if gone.isdisjoint(g) and _keeps_places(t, [*gone, *g])]
                if not ok:  # a block at the layout it runs at, if one can go
                    ok = [g for g in _blocks(t, capacity, give_back)
                          if _keeps_places(t, [*gone, *g])
                          and held[t.name] - len(give_back) - len(g) >= t.min_workers]  # fmt: skip
                if not ok:
                    break
                give_back += _spared(t, ok, give_back, target[t.name], capacity)
            for r in give_back:
                free[t.ranks[r]] += 1
            after = held[t.name] - len(give_back)
            moves.append(Move(t.name, held[t.name], after, tuple(give_back)))
    for t in tasks:
        extra = target[t.name] - held[t.name]
        if extra > 0:
            mine = {n: sum(1 for m in t.ranks.values() if m == n) for n in capacity}
            nodes: list[int] = []
            # pack: nodes it is on, then the freest; a replica on one node where one has
            # room, a second one on a second node (two failure domains); else its stages
            # on several nodes, each a block of tp slots of one node
            for _ in range(extra // t.replica_ranks):
                open_ = [n for n in free if free[n] >= t.replica_ranks]
                on = {n for n in mine if mine[n]}
                if len(on) == 1 and any(n not in on for n in open_):
                    open_ = [n for n in open_ if n not in on]
                if open_:
                    n = max(open_, key=lambda n: (mine[n], free[n], -n))
                    spread = [n] * (t.replica_ranks // t.tp)
                elif (found := _spread(free, mine, t)) is not None:
                    spread = found
                else:
                    break
                for n in spread:
                    free[n] -= t.tp
                    mine[n] += t.tp
                    nodes += [n] * t.tp
            after = held[t.name] + len(nodes)
            moves.append(Move(t.name, held[t.name], after, add_on=tuple(sorted(nodes))))
        elif extra == 0:
            moves.append(Move(t.name, held[t.name], held[t.name]))
    return moves
