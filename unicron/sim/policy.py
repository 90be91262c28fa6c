"""Recovery policies the simulator compares: Unicron and the systems people use today.

Each policy is a documented *model*: a small class whose constants (dataclass fields) carry
their sources in the field docstrings, and whose hooks decide what a failure costs a task.
:class:`~unicron.sim.engine.Simulation` calls ``start`` once, then ``on_fault`` (the node
stays: SEV2/SEV3 errors and hangs), ``on_node_lost`` (a ``remove`` event: the node is gone)
and ``on_node_back`` (an ``add``). Hooks act only through the simulation's methods
(``recover``, ``resize``, ``rollback``, ``set_factor``, ...). No I/O, no clock.

How a failure is seen (its *detection method*) follows from the classifier input: ``hang``
-> statistical monitor or a timeout; ``heartbeat_lost`` -> node health or a timeout; the
communication kinds (``nccl``, ``timeout``, ``conn_*``) -> the peer's collective fails or
blocks; every other kind -> the failing process raises or exits ("crash").

Constants marked *assumption* are this project's choices where no source gives a number;
``docs/simulator.md`` lists them all and says how they move the results.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

from unicron import planner
from unicron.sim.engine import Simulation
from unicron.sim.task import Mode, TaskRun

COMM_KINDS = frozenset({"nccl", "timeout", "conn_reset", "conn_refused"})
Method = Literal["crash", "comm", "hang", "node"]

LLAMA3_STORAGE_BW_PER_NODE = 2e12 / 2048
"""Checkpoint storage bandwidth per node: Llama 3's Tectonic sustained 2 TB/s over 2,048
nodes (Dubey et al. 2024, §3.3.4), ~1 GB/s per node."""


def method_of(signal: str) -> Method:
    """How a failure of this classifier input is first seen."""
    if signal == "hang":
        return "hang"
    if signal == "heartbeat_lost":
        return "node"
    if signal in COMM_KINDS:
        return "comm"
    return "crash"


@dataclass(kw_only=True)
class Policy:
    """Base: fixed initial allocation, steady running, no failure handling of its own."""

    name: ClassVar[str] = "base"
    initial: Literal["planner", "proportional"] = "planner"
    """Initial nodes per task: the planner's reference plan (default, isolates recovery) or
    shares proportional to weight (``planner.proportional_share``, no planner at all)."""

    def ckpt_interval(self, task: TaskRun) -> float:
        """Seconds between ``task``'s persistent checkpoints (inf: rollback never happens).

        Called by the engine on every time step it books."""
        return math.inf

    def detect_s(self, task: TaskRun, method: Method) -> float:
        raise NotImplementedError

    def steady_factor(self, sim: Simulation, task: TaskRun) -> float:
        """Throughput multiplier while running normally (checkpoint stalls, redundancy)."""
        return 1.0

    def start(self, sim: Simulation) -> None:
        """Allocate the initial nodes and start every task (called once at time 0)."""
        targets = dict(sim.prepared.reference)
        if self.initial == "proportional":
            states = [
                planner.TaskState(
                    name=t.name,
                    weight=t.spec.weight,
                    min_units=t.spec.min_nodes,
                    current_units=0,
                    flops=t.perf.flops,
                    transition_s=0.0,
                )
                for t in sim.tasks.values()
            ]
            targets = planner.proportional_share(states, sim.healthy_count())
        for task in sim.tasks.values():
            task.target = targets[task.name]
            sim.resize(task, task.target)
            sim.set_factor(task, self.steady_factor(sim, task))
            sim.start(task)

    def on_fault(self, sim: Simulation, task: TaskRun, node: str, signal: str, sev: int) -> None:
        """A fault hit ``task`` (the baselines: whatever the severity, :meth:`_fail`)."""
        self._fail(sim, task, signal)

    def on_node_lost(
        self, sim: Simulation, task: TaskRun | None, node: str, signal: str, sev: int
    ) -> None:
        """``node`` left the cluster; ``task`` ran on it, if any (the baselines: :meth:`_fail`)."""
        if task is not None:
            self._fail(sim, task, signal)

    def _fail(self, sim: Simulation, task: TaskRun, signal: str) -> None:
        """How a baseline answers any failure of ``task`` seen through ``signal``."""
        raise NotImplementedError

    def on_node_back(self, sim: Simulation, node: str) -> None:
        raise NotImplementedError

    # helpers shared by the baselines
    def _load_s(self, task: TaskRun, nodes: int, bw_per_node: float) -> float:
        return task.perf.state_bytes / (bw_per_node * max(nodes, 1))

    def _grow_below_target(
        self, sim: Simulation, cost: Callable[[TaskRun], float], running_too: bool
    ) -> None:
        """Give free nodes to tasks below their target (in workload order) and restart them."""
        for task in sim.tasks.values():
            if len(task.nodes) >= task.target or not sim.free_nodes():
                continue
            if task.mode is Mode.DOWN or (task.mode is Mode.RUNNING and not running_too):
                continue
            sim.resize(task, task.target)
            if len(task.nodes) >= task.spec.min_nodes:
                sim.recover(task, [("transition", cost(task))], sim.starter(task))
