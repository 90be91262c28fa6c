"""Unicron as the simulator models it (:class:`Unicron`), and the same with every layout
healing from peers (:class:`UnicronAll`, the paper's claim): in-band detection at the
runtime's measured latencies, the real planner on every node event, peer-state healing and
partial-results reuse where the runtime does them, its background checkpoint elsewhere.
Registered with the baselines in :mod:`unicron.sim.policies`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np

from unicron import planner
from unicron.sim import measured
from unicron.sim.engine import Simulation
from unicron.sim.policy import LLAMA3_STORAGE_BW_PER_NODE, Method, Policy, method_of
from unicron.sim.task import Mode, TaskRun


@dataclass(kw_only=True)
class Unicron(Policy):
    """Unicron (He et al. 2023): in-band detection, cost-aware replanning, fast transition.

    Detection latencies are the runtime's measured ones (:mod:`unicron.sim.measured` reads
    them from ``bench/results``; :func:`make_policy` passes them in). SEV3 reattempts
    in place (one iteration); SEV2 restarts the process in its slot and pulls the state from
    the nearest peer; SEV1 (node lost) replans every task with the real planner
    (:func:`unicron.planner.solve`, transition costs from
    :func:`~unicron.planner.transition_time_s`, D_run from the observed failure rate).
    Returning nodes trigger a replan too (grow back when it pays). Partial-results reuse
    means an interrupted step costs nothing; state comes from peers, never a checkpoint.

    Only where the runtime heals that way (:attr:`heals`): by default a task whose layout is
    not a data-parallel replica of the whole model with replicated state (tensor, pipeline
    or context parallel, or its optimizer state sharded: what the planner picks for most
    tasks) recovers as the runtime would recover it today, from its persistent checkpoint:
    rank 0 writes one in the background every :meth:`ckpt_interval` (Young/Daly, as
    ``checkpoint: {every: auto}``), a SEV1 or SEV2 failure rolls the task back to it and
    reloads it at :attr:`storage_bw_per_node`; Unicron's detection and planning stay.
    """

    name: ClassVar[str] = "unicron"
    exception_detect_s: float = 0.2
    """A communication error seen by the peers (measured: bench/results error.json)."""
    exit_detect_s: float = 0.5
    """A crashed or raising process (measured: crash.json, error.json)."""
    node_detect_s: float = 3.0
    """A lost node, through node health (measured: node.json ``detection_heartbeat_s``)."""
    hang_factor: float = 3.0
    """Statistical hang threshold: hang_factor x step (DESIGN.md), at least ``hang_floor_s``."""
    hang_floor_s: float = 1.5
    """The hang detector's floor (measured: hang.json ``detection_s``)."""
    regroup_s: float = 30.0
    """Rebuild the process groups and restart a worker at cluster scale (named assumption,
    :data:`unicron.sim.measured.ASSUMPTIONS`)."""
    prior_rate_per_node_day: float = 419 / (2048 * 54)
    """Failure-rate prior for D_run before failures are seen (Llama 3, see trace.py)."""
    transition_fixed_s: float | None = None
    """A transition's cost measured on the runtime (the sim-to-real scenario passes the
    figure of its own real run); None: the planner's ``transition_time_s`` (state at the GPU
    preset's bandwidth + ``regroup_s``)."""
    join_s: float = 0.0
    """Seconds a task that grows keeps running at its old size while its new workers start,
    on nodes where it already has a warm process (it ran there since the node came up). 0:
    the new workers are ready at once. The sim-to-real scenario passes its measured figure."""
    join_cold_s: float = 0.0
    """As :attr:`join_s`, on a node new to the task (its first worker there starts a fresh
    process that imports torch: seconds on a CPU machine)."""
    heals: Literal["runtime", "all"] = "runtime"
    """Which layouts heal from peers (state from a peer, partial-results reuse, moves
    without a checkpoint): ``runtime``, those the runtime heals today (data-parallel
    replicas of the whole model with replicated state, :attr:`TaskPerf.peer_healable`);
    ``all``, every layout, as the paper claims for Megatron's 3D parallelism (beyond the
    runtime: the ``unicron-all`` policy)."""
    storage_bw_per_node: float = LLAMA3_STORAGE_BW_PER_NODE
    """Checkpoint write and read bandwidth per node, for layouts that do not heal from peers
    (as Megatron's)."""
    host_copy_bw_per_gpu: float = 25e9
    """The step-time cost of a checkpoint for those layouts: the state's copy to host memory
    before the background write (assumption: PCIe 4.0 x16, ~25 GB/s per GPU)."""
    checkpoint_mtbf_s: float = 3 * 3600.0
    """The MTBF prior of the runtime's automatic interval (``checkpoint.mtbf`` default)."""
    preempt_below_min: bool = False
    """Off (as the runtime, ``unicron/control/allocation.py``): a replan reserves every
    task's minimum and shares the rest. On: the solver may leave a task below its minimum
    to give its nodes to others, which the runtime does not do (beyond the runtime)."""
    nodes_lost: int = field(default=0, init=False)
    """Node losses seen so far (the observed failure rate for D_run)."""
    _states: dict[str, tuple[tuple[int, float, bool, int, int], planner.TaskState]] = field(
        default_factory=dict, init=False, repr=False
    )
    _warm: set[tuple[str, str]] = field(default_factory=set, init=False, repr=False)
    """(task, node): the task has run on the node since the node came up."""

    _started: set[str] = field(default_factory=set, init=False, repr=False)
    """Tasks that ran (as the runtime's started tasks, their minimum is reserved; one never
    placed is queued there and reserves nothing)."""
    _sim: Simulation | None = field(default=None, init=False, repr=False)
    """The simulation it runs in (set by :meth:`start`; :meth:`ckpt_interval` needs it)."""

    def start(self, sim: Simulation) -> None:
        self._sim = sim
        super().start(sim)
        self._warm = {(t.name, n) for t in sim.tasks.values() for n in t.nodes}
        self._started = {t.name for t in sim.tasks.values() if t.mode is Mode.RUNNING}

    @classmethod
    def measured(cls) -> Unicron:
        """Unicron with the runtime's measured detection latencies and the named assumptions."""
        m = measured.load()
        return cls(
            exception_detect_s=m.exception_detect_s,
            exit_detect_s=m.exit_detect_s,
            node_detect_s=m.node_detect_s,
            hang_floor_s=m.hang_floor_s,
            regroup_s=measured.ASSUMPTIONS["regroup_s"][0],
        )

    def peer_heals(self, task: TaskRun) -> bool:
        """Whether ``task``, on its nodes now, heals from its peers (:attr:`heals`)."""
        return self._heals_on(task, len(task.nodes))

    def _heals_on(self, task: TaskRun, nodes: int) -> bool:
        ok = task.perf.peer_healable
        return self.heals == "all" or ok is None or bool(ok[min(nodes, len(ok) - 1)])

    def _gpus(self, sim: Simulation, task: TaskRun) -> int:
        return max(len(task.nodes), 1) * sim.workload.gpus_per_node

    def _copy_s(self, sim: Simulation, task: TaskRun) -> float:
        return task.perf.state_bytes / (self.host_copy_bw_per_gpu * self._gpus(sim, task))

    def _storage_s(self, task: TaskRun) -> float:
        return self._load_s(task, len(task.nodes), self.storage_bw_per_node)

    def checkpoint_interval_s(self, sim: Simulation, task: TaskRun) -> float:
        """The runtime's automatic interval for a task that does not heal from peers: Young/
        Daly from the step-time cost of a checkpoint and the MTBF prior, raised to the
        background write's time (:func:`unicron.runtime.checkpoint.choose_interval`)."""
        yd = math.sqrt(2.0 * self._copy_s(sim, task) * self.checkpoint_mtbf_s)
        return max(yd, self._storage_s(task))

    def ckpt_interval(self, task: TaskRun) -> float:
        sim = self._sim
        if sim is None or self.peer_heals(task):
            return math.inf
        return self.checkpoint_interval_s(sim, task)

    def steady_factor(self, sim: Simulation, task: TaskRun) -> float:
        if self.peer_heals(task):
            return 1.0
        return max(0.0, 1.0 - self._copy_s(sim, task) / self.checkpoint_interval_s(sim, task))

    def detect_s(self, task: TaskRun, method: Method) -> float:
        if method == "hang":
            return max(self.hang_factor * task.perf.iter_time_s, self.hang_floor_s)
        return {"crash": self.exit_detect_s, "comm": self.exception_detect_s}.get(
            method, self.node_detect_s
        )

    def transition_s(self, sim: Simulation, task: TaskRun) -> float:
        if self.transition_fixed_s is not None:
            return self.transition_fixed_s
        if not self.peer_heals(task):  # every rank reloads the checkpoint
            return self.regroup_s + self._storage_s(task)
        wl = sim.workload
        bw = wl.gpu_type().inter_node_bw * wl.gpus_per_node
        return planner.transition_time_s(task.perf.model, bw, self.regroup_s)

    def on_fault(self, sim: Simulation, task: TaskRun, node: str, signal: str, sev: int) -> None:
        if task.mode is Mode.IDLE:
            return
        d = self.detect_s(task, method_of(signal))
        if sev <= 2 and task.mode is Mode.RUNNING and not self.peer_heals(task):
            sim.rollback(task)  # the restarted rank's state is on no peer: the checkpoint's
        fix = task.perf.iter_time_s if sev >= 3 else self.transition_s(sim, task)
        if sev <= 1:
            sim.recover(task, [("detection", d)], lambda _t: self._replan(sim, task))
            return
        sim.recover(task, [("detection", d), ("transition", fix)], sim.starter(task))

    def on_node_lost(
        self, sim: Simulation, task: TaskRun | None, node: str, signal: str, sev: int
    ) -> None:
        self.nodes_lost += 1
        self._warm = {(t, n) for t, n in self._warm if n != node}
        if task is None:
            return
        if task.mode is Mode.RUNNING:
            # judged by the layout it ran when the node went (the node is already off it)
            if self._heals_on(task, len(task.nodes) + 1):
                sim.checkpointed(task)  # whole in its peers: what follows checkpoints from here
            else:
                sim.rollback(task)
        d = self.detect_s(task, method_of(signal))
        sim.recover(task, [("detection", d)], lambda _t: self._replan(sim, task))

    def on_node_back(self, sim: Simulation, node: str) -> None:
        self._replan(sim, None)

    def _d_run_s(self, sim: Simulation) -> float:
        nodes = sim.healthy_count()
        node_days = max(sim.now, 1.0) * sim.workload.nodes / 86400.0
        prior_events = 1.0
        rate = (prior_events + self.nodes_lost) / (
            prior_events / max(self.prior_rate_per_node_day, 1e-9) + node_days
        )
        return planner.expected_time_to_failure_s(rate, max(nodes, 1))

    def _state(
        self, task: TaskRun, cost: float, faulted: bool, base: int, spare: int
    ) -> planner.TaskState:
        """The planner's view of ``task`` above its reserved ``base`` units, with ``spare``
        units to share, reused while it is unchanged (building one copies the task's F
        table: a tenth of a replan's time at 100 tasks)."""
        key = (len(task.nodes), cost, faulted, base, spare)
        hit = self._states.get(task.name)
        if hit is not None and hit[0] == key:
            return hit[1]
        f = task.perf.flops if task.perf.plan_flops is None else task.perf.plan_flops
        if base:
            top = len(f) - 1
            # beyond its max_nodes a task's F drops to 0: no gain there, never a loss
            f = np.maximum(f[np.minimum(base + np.arange(spare + 1), top)] - f[base], 0.0)
        state = planner.TaskState(
            name=task.name,
            weight=task.spec.weight,
            min_units=max(task.spec.min_nodes - base, 0),
            current_units=min(max(len(task.nodes) - base, 0), len(f) - 1),
            flops=f,
            transition_s=cost,
            must_transition=faulted,
        )
        self._states[task.name] = (key, state)
        return state

    def _replan(self, sim: Simulation, faulted: TaskRun | None) -> None:
        """Run the real planner over every task and move the tasks whose nodes change.

        Unless :attr:`preempt_below_min`, every started task's minimum is reserved first and
        the solver shares the rest, as the runtime's allocation does (a task never placed is
        queued and reserves nothing); when the minimums do not fit, nothing moves."""
        units = sim.healthy_count()
        base = {
            t.name: t.spec.min_nodes
            if t.name in self._started and not self.preempt_below_min
            else 0
            for t in sim.tasks.values()
        }
        spare = units - sum(base.values())
        cost = {t.name: self.transition_s(sim, t) for t in sim.tasks.values()}
        if spare < 0:  # the minimums do not fit: nobody moves (the runtime's rule)
            alloc = {t.name: len(t.nodes) for t in sim.tasks.values()}
        else:
            states = [
                self._state(t, cost[t.name], t is faulted, base[t.name], spare)
                for t in sim.tasks.values()
            ]
            plan = planner.solve(states, spare, self._d_run_s(sim))
            alloc = {n: base[n] + u for n, u in plan.allocation.items()}
        changed: list[TaskRun] = []
        had = {t.name: len(t.nodes) for t in sim.tasks.values()}
        self._started |= {n for n, k in alloc.items() if k >= sim.tasks[n].spec.min_nodes}
        ordered = sorted(sim.tasks.values(), key=lambda t: alloc[t.name] - len(t.nodes))
        for task in ordered:  # shrink first, then grow
            want = alloc[task.name]
            if want != len(task.nodes) or task is faulted:
                sim.resize(task, want)
                task.target = want
                changed.append(task)
        for task in changed:
            sim.set_factor(task, self.steady_factor(sim, task))
            if self._heals_on(task, had[task.name]) and not self.peer_heals(task):
                sim.checkpointed(task)  # its checkpoints start with the new layout
            if len(task.nodes) < task.spec.min_nodes:
                sim.cancel(task)
                sim.set_mode(task, Mode.IDLE)
                continue
            grows = len(task.nodes) > had[task.name] >= task.spec.min_nodes
            delay = self._join_delay(task, had[task.name])
            if delay > 0 and grows and (task.mode is Mode.RUNNING or task is faulted):
                self._join_later(sim, task, had[task.name], cost[task.name], delay, faulted)
                continue
            self._warm |= {(task.name, n) for n in task.nodes}
            move = cost[task.name]
            if task is not faulted and task.mode is Mode.RUNNING and not self.peer_heals(task):
                # a layout change without peer healing: a checkpoint first (nothing lost),
                # then every rank reloads it on the new nodes
                sim.checkpointed(task)
                move += self._storage_s(task)
            sim.recover(task, [("transition", move)], sim.starter(task))

    def _join_delay(self, task: TaskRun, old: int) -> float:
        """How long the new workers of ``task`` (its nodes past the first ``old``) take to
        start: :attr:`join_cold_s` if one of them is on a node new to it, else :attr:`join_s`."""
        cold = any((task.name, n) not in self._warm for n in task.nodes[old:])
        return self.join_cold_s if cold else self.join_s

    def _join_later(
        self,
        sim: Simulation,
        task: TaskRun,
        old: int,
        cost: float,
        delay: float,
        faulted: TaskRun | None,
    ) -> None:
        """``task`` grows from ``old`` nodes: it runs at its old size for ``delay`` (the new
        workers start; a task that lost a node first transitions onto its survivors, as the
        runtime does), then transitions onto all its nodes."""
        new_rate = task.rate()
        task.nodes, kept = task.nodes[:old], task.nodes
        old_rate = task.rate()
        task.nodes = kept
        sim.set_factor(task, old_rate / new_rate if new_rate > 0 else 1.0)
        if task is faulted:
            sim.recover(task, [("transition", cost)], sim.starter(task))
        else:
            sim.cancel(task)
        tok = task.token

        def join(_now: float) -> None:
            if task.token != tok:  # a later replan or fault took over
                return
            self._warm |= {(task.name, n) for n in task.nodes}
            sim.set_factor(task, self.steady_factor(sim, task))
            sim.recover(task, [("transition", cost)], sim.starter(task))

        sim.schedule(sim.now + delay, join)


@dataclass(kw_only=True)
class UnicronAll(Unicron):
    """:class:`Unicron` with every layout healing from peers (``heals="all"``): the paper's
    claim for Megatron's 3D parallelism, beyond the runtime until it heals model-parallel
    replicas. Reported beside ``unicron`` to show what that would add."""

    name: ClassVar[str] = "unicron-all"
    heals: Literal["runtime", "all"] = "all"
