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

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

import numpy as np

from unicron import planner
from unicron.sim import measured
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


ARTIFACT_COMMIT = "796655600207cfb59fae5804740ff720f7428fc5"
"""The Oobleck SOSP'23 artifact (github SymbioticLab/Oobleck, branch sosp23-artifact) whose
``tools/simulator/*_simulator.py`` per-model constants the baselines use."""

ARTIFACT_POINTS: dict[str, tuple[str, float]] = {
    # our model name -> (the artifact's model, parameters) the per-model constants belong to
    "bert-large": ("BERT-large", 0.34e9),
    "gpt2-medium": ("GPT-2-ours", 0.35e9),
    "gpt-350m": ("GPT-3-medium", 0.35e9),
    "gpt-2.7b": ("GPT-3-2_7b", 2.7e9),
    "gpt-6.7b": ("GPT-3-6_7b", 6.7e9),
}
"""Models the artifact has constants for; others are interpolated on the parameter count
between the GPT points (:func:`per_model`)."""

VARUNA_CHECKPOINT_S = {
    "bert-large": 15.8,
    "gpt2-medium": 11.5,
    "gpt-350m": 11.2,
    "gpt-2.7b": 50.0,
    "gpt-6.7b": 120.0,
}
"""Varuna's checkpoint stall per model (varuna_simulator.py ``checkpointing_overhead``)."""
VARUNA_RESTART_S = {
    "bert-large": 60.2,
    "gpt2-medium": 71.5,
    "gpt-350m": 67.5,
    "gpt-2.7b": 465.0,
    "gpt-6.7b": 581.0,
}
"""Varuna's restart in a new configuration (varuna_simulator.py: the global rendezvous waits
``local_rendezvous_timeout_delta - checkpointing_overhead``: 76-15.8, 83-11.5, 78.7-11.2,
515-50, 701-120 s)."""
BAMBOO_REBALANCE_S = {
    "bert-large": 76.0,
    "gpt2-medium": 80.0,
    "gpt-350m": 100.0,
    "gpt-2.7b": 230.0,
    "gpt-6.7b": 450.0,
}
"""Bamboo's reconfiguration after a loss (bamboo_simulator.py
``local_rendezvous_timeout_delta``)."""
OOBLECK_RECONFIGURE_S = {
    "bert-large": 2.0,
    "gpt2-medium": 2.0,
    "gpt-350m": 3.0,
    "gpt-2.7b": 6.0,
    "gpt-6.7b": 10.0,
}
"""Oobleck's reconfiguration (oobleck_simulator.py ``local_rendezvous_timeout_delta``; its
global rendezvous costs 0)."""


def per_model(table: dict[str, float], task: TaskRun) -> float:
    """A per-model artifact constant for ``task``'s model: the artifact's own value where it
    has the model, else linear in the parameter count between the GPT points (extrapolated
    with the nearest segment's slope, never below the smallest point's value)."""
    name = task.spec.model
    if name in table:
        return table[name]
    pts = sorted((ARTIFACT_POINTS[k][1], v) for k, v in table.items() if k.startswith("gpt-"))
    x = float(task.perf.model.params)
    if x <= pts[0][0]:
        return pts[0][1]
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    for a, b in itertools.pairwise(pts):
        if x <= b[0]:
            (x0, y0), (x1, y1) = a, b
            break
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(kw_only=True)
class Megatron(Policy):
    """Megatron-LM checkpoint-restart, as its users run it: restart on the nodes it has.

    Every failure stops the whole job: it is seen when the failing process exits
    (``exit_detect_s``) or, when nothing exits (a hang, a lost node, a broken link), only when
    the distributed timeout fires (``timeout_s``). The job then restarts (``restart_s``) on
    the nodes it can get (up to its target, at least ``min_nodes``: a smaller data-parallel
    degree, the planner's F for that size), loads the last checkpoint and redoes the work
    since it. Returned nodes are taken at the next periodic checkpoint: a restart from it,
    no work lost (assumption: an operator restarts to regain nodes, not on every arrival).
    Checkpoints are synchronous and stall training for their save time every
    ``checkpoint_interval_s``. :class:`MegatronWait` keeps a fixed world size instead.
    """

    name: ClassVar[str] = "megatron"
    timeout_s: float = 600.0
    """Distributed timeout: Megatron-LM ``--distributed-timeout-minutes`` default 10; the
    ``megatron-30m`` variant uses 30 (PyTorch's pre-2.2 default process-group timeout)."""
    exit_detect_s: float = 60.0
    """A crashed rank noticed by the launcher, which tears the job down (assumption)."""
    restart_s: float = 300.0
    """Whole-job restart: schedule, launch, NCCL init, data loader (assumption)."""
    checkpoint_interval_s: float = 3600.0
    """Persistent checkpoint interval (assumption; typical of large runs)."""
    storage_bw_per_node: float = LLAMA3_STORAGE_BW_PER_NODE
    """Checkpoint read/write bandwidth per node."""
    fixed_world: ClassVar[bool] = False
    """Wait for the full node count before restarting (:class:`MegatronWait`)."""

    def ckpt_interval(self, task: TaskRun) -> float:
        return self.checkpoint_interval_s

    def detect_s(self, task: TaskRun, method: Method) -> float:
        return self.exit_detect_s if method == "crash" else self.timeout_s

    def _save_s(self, task: TaskRun) -> float:
        return self._load_s(task, task.target, self.storage_bw_per_node)

    def steady_factor(self, sim: Simulation, task: TaskRun) -> float:
        return max(0.0, 1.0 - self._save_s(task) / self.checkpoint_interval_s)

    def _restart_cost(self, task: TaskRun) -> float:
        return self.restart_s + self._load_s(task, len(task.nodes), self.storage_bw_per_node)

    def _fail(self, sim: Simulation, task: TaskRun, signal: str) -> None:
        if task.mode is Mode.IDLE:
            return
        if task.mode is Mode.RUNNING:
            sim.rollback(task)
        d = self.detect_s(task, method_of(signal))
        sim.recover(task, [("detection", d)], lambda _t: self._restart(sim, task))

    def _enough(self, task: TaskRun) -> bool:
        need = task.target if self.fixed_world else task.spec.min_nodes
        return len(task.nodes) >= max(need, 1)

    def _restart(self, sim: Simulation, task: TaskRun) -> None:
        sim.resize(task, task.target)
        if not self._enough(task):
            sim.set_mode(task, Mode.IDLE)  # wait for nodes
            return
        sim.recover(task, [("transition", self._restart_cost(task))], sim.starter(task))

    def on_node_back(self, sim: Simulation, node: str) -> None:
        for task in sim.tasks.values():
            if task.mode is Mode.IDLE and task.target > 0:
                sim.resize(task, task.target)
                if self._enough(task):
                    sim.recover(task, [("transition", self._restart_cost(task))], sim.starter(task))
            elif (
                not self.fixed_world
                and task.mode is Mode.RUNNING
                and len(task.nodes) < task.target
                and not task.extra.get("grow_pending")
            ):  # grow at the next periodic checkpoint: restart from it, no work lost
                task.extra["grow_pending"] = 1
                wait = max(0.0, self.checkpoint_interval_s - task.ckpt_clock)
                sim.schedule(sim.now + wait, self._grower(sim, task))

    def _grower(self, sim: Simulation, task: TaskRun) -> Callable[[float], None]:
        return lambda _t: self._grow(sim, task)

    def _grow(self, sim: Simulation, task: TaskRun) -> None:
        task.extra["grow_pending"] = 0
        if task.mode is not Mode.RUNNING or len(task.nodes) >= task.target:
            return
        if not sim.free_nodes():
            return
        sim.checkpointed(task)
        sim.resize(task, task.target)
        sim.recover(task, [("transition", self._restart_cost(task))], sim.starter(task))


@dataclass(kw_only=True)
class Megatron30(Megatron):
    """:class:`Megatron` with a 30-minute distributed timeout."""

    name: ClassVar[str] = "megatron-30m"
    timeout_s: float = 1800.0


@dataclass(kw_only=True)
class MegatronWait(Megatron):
    """:class:`Megatron` with a fixed world size: after a failure it waits (idle) until it has
    its full node count again (a spare, or the lost node repaired)."""

    name: ClassVar[str] = "megatron-wait"
    fixed_world: ClassVar[bool] = True


@dataclass(kw_only=True)
class Varuna(Policy):
    """Varuna (Athlur et al., EuroSys'22): checkpoint-based job morphing.

    As its paper and the Oobleck artifact's ``varuna_simulator.py`` model it: a checkpoint
    every ``checkpoint_every_iters`` iterations (a stall of the per-model
    :data:`VARUNA_CHECKPOINT_S`) and one right after each reconfiguration. On a lost node
    the job restarts from its last checkpoint in a new configuration for the nodes it has
    (:data:`VARUNA_RESTART_S`, taking free nodes up to its target), so it never waits for a
    replacement but loses the work since the checkpoint. When nodes return it morphs up: it
    checkpoints first (no work lost, the checkpoint counts) and restarts. Errors that leave
    the node in place restart the job from the checkpoint; hangs are found at the
    distributed timeout (Varuna has no hang detector).
    """

    name: ClassVar[str] = "varuna"
    timeout_s: float = 600.0
    """Distributed timeout, as :class:`Megatron`."""
    exit_detect_s: float = 60.0
    """As :class:`Megatron` (assumption)."""
    node_detect_s: float = 30.0
    """Varuna's manager notices a lost VM by its heartbeat (assumption)."""
    checkpoint_every_iters: int = 10
    """Iterations between checkpoints (varuna_simulator.py ``checkpoint_per_iter``)."""
    max_stall_fraction: float = 0.1
    """Checkpoints no more often than keeps their stall under this share of the time
    (assumption: a user with short iterations checkpoints less often; the artifact's own
    scenarios stall ~6 %, so this bound does not bind there)."""
    cost_scale: float = 1.0
    """Multiplier on the artifact's per-model checkpoint and restart times (sensitivity)."""
    artifact_step_count: bool = False
    """Count the steps a rollback discards toward the next every-10-iterations checkpoint,
    as varuna_simulator.py does (its ``num_steps_complete`` is not rolled back with the
    work). False: the schedule follows the restored iteration number, as Varuna restoring
    a checkpoint does. The cross-check uses it to show where the two models part."""
    train_through_restart: bool = False
    """Mechanism *train-through-restart*, the artifact's Varuna (varuna_simulator.py at
    :data:`ARTIFACT_COMMIT`: ``simulate_spot_instance_remove`` line 1243 starts the global
    rendezvous but leaves the running configuration's step events in the queue; they keep
    firing, and counting, until ``simulate_rendezvous_timeout`` bumps
    ``rendezvous_version``, line 1284; the first of them checkpoints, ``node_will_be_removed``,
    line 1465): after a lost node, roll back to the checkpoint, then keep training on the
    nodes left for the whole detection and restart, checkpoint when the step in flight
    ends, and switch to the new configuration when the restart ends (its step in flight
    lost). False (default): the job is down for the detection and the restart, as a job
    that lost one of its pipeline's stages is; the artifact's old configuration trains
    without the lost node, which the real Varuna cannot (the cross-check turns it on)."""

    def ckpt_interval(self, task: TaskRun) -> float:
        floor = self.checkpoint_s(task) * (1.0 - self.max_stall_fraction) / self.max_stall_fraction
        return max(self.checkpoint_every_iters * _iter_s(task), floor)

    def checkpoint_s(self, task: TaskRun) -> float:
        return self.cost_scale * per_model(VARUNA_CHECKPOINT_S, task)

    def restart_cost_s(self, task: TaskRun) -> float:
        return self.cost_scale * per_model(VARUNA_RESTART_S, task)

    def detect_s(self, task: TaskRun, method: Method) -> float:
        return {"crash": self.exit_detect_s, "node": self.node_detect_s}.get(method, self.timeout_s)

    def steady_factor(self, sim: Simulation, task: TaskRun) -> float:
        every = self.ckpt_interval(task)
        return every / (every + self.checkpoint_s(task))

    def _fail(self, sim: Simulation, task: TaskRun, signal: str) -> None:
        if task.mode is Mode.IDLE:
            return
        through = self.train_through_restart and method_of(signal) == "node"
        if through and (task.mode is Mode.RUNNING or "varuna_restart" in task.extra):
            if task.mode is not Mode.RUNNING:  # the restart's checkpoint stall: resume
                sim.cancel(task)
                sim.start(task)
            sim.rollback(task, keep_clock=self.artifact_step_count)
            self._train_through(sim, task, self.detect_s(task, "node") + self.restart_cost_s(task))
            return
        task.extra.pop("varuna_restart", None)
        if task.mode is Mode.RUNNING:
            sim.rollback(task, keep_clock=self.artifact_step_count)
        d = self.detect_s(task, method_of(signal))
        sim.recover(task, [("detection", d)], lambda _t: self._morph(sim, task))

    def _train_through(self, sim: Simulation, task: TaskRun, window_s: float) -> None:
        """:attr:`train_through_restart`: run on for ``window_s``, checkpoint after the step
        in flight, then take the new configuration (a later loss starts a new window)."""
        gen = task.extra.get("varuna_restart", 0) + 1
        task.extra["varuna_restart"] = gen
        step = _iter_s(task)
        in_flight = step - sim.partial_step_s(task, step)

        def saved(_t: float) -> None:  # the checkpoint counts once written, not when begun
            sim.checkpointed(task, keep_phase=True)
            sim.start(task)

        def ckpt(_t: float) -> None:
            if task.extra.get("varuna_restart") == gen and task.mode is Mode.RUNNING:
                sim.recover(task, [("transition", self.checkpoint_s(task))], saved)

        def switch(_t: float) -> None:
            if task.extra.get("varuna_restart") != gen:
                return
            del task.extra["varuna_restart"]
            sim.lose_running(task, sim.partial_step_s(task, _iter_s(task)))
            sim.cancel(task)
            self._morph_now(sim, task)

        sim.schedule(sim.now + min(in_flight, window_s), ckpt)
        sim.schedule(sim.now + window_s, switch)

    def _morph_now(self, sim: Simulation, task: TaskRun) -> None:
        """The new configuration starts at once (its restart already ran, trained through)."""
        sim.resize(task, task.target)
        if len(task.nodes) < task.spec.min_nodes:
            sim.set_mode(task, Mode.IDLE)
            return
        sim.start(task)

    def _morph(self, sim: Simulation, task: TaskRun) -> None:
        sim.resize(task, task.target)
        if len(task.nodes) < task.spec.min_nodes:
            sim.set_mode(task, Mode.IDLE)
            return
        self._restart(sim, task, save_first=False)

    def _restart(self, sim: Simulation, task: TaskRun, *, save_first: bool) -> None:
        """Restart in the new configuration; one iteration later, checkpoint (credited)."""
        phases = [("transition", self.restart_cost_s(task))]
        if save_first:
            sim.checkpointed(task, keep_phase=True)
            phases.insert(0, ("transition", self.checkpoint_s(task)))

        def first_step(_t: float) -> None:
            sim.start(task)
            tok = task.token
            sim.schedule(sim.now + _iter_s(task), lambda _u: self._post_morph_ckpt(sim, task, tok))

        sim.recover(task, phases, first_step)

    def _post_morph_ckpt(self, sim: Simulation, task: TaskRun, tok: int) -> None:
        if task.mode is not Mode.RUNNING or task.token != tok:
            return
        sim.checkpointed(task, keep_phase=True)
        sim.recover(task, [("transition", self.checkpoint_s(task))], sim.starter(task))

    def on_node_back(self, sim: Simulation, node: str) -> None:
        for task in sim.tasks.values():
            if len(task.nodes) >= task.target or not sim.free_nodes():
                continue
            if task.mode is Mode.IDLE:
                self._morph(sim, task)
            elif task.mode is Mode.RUNNING:
                sim.resize(task, task.target)
                self._restart(sim, task, save_first=True)


def _iter_s(task: TaskRun) -> float:
    """Iteration time at the task's current size (the reference one scaled by F)."""
    n = min(len(task.nodes), len(task.perf.flops) - 1)
    ref = task.ref_waf / task.spec.weight if task.spec.weight > 0 else 0.0
    now = task.perf.flops[n] if n > 0 else 0.0
    it = task.perf.iter_time_s
    if now > 0 and ref > 0:
        return float(it * ref / now)
    return it


@dataclass(kw_only=True)
class Oobleck(Policy):
    """Oobleck (Jang et al., SOSP'23): pipeline templates and in-memory replicas.

    A lost node is handled without a checkpoint: the job re-instantiates its pipelines from
    precomputed templates on the nodes it has, copying missing layers from the other
    pipelines' replicas (the per-model :data:`OOBLECK_RECONFIGURE_S`); the interrupted
    iteration is lost: the part of it done when the failure comes (oobleck_simulator.py
    marks the step in flight wasted and books a ``step_delta``).
    Errors that leave the node in place are handled the same way. Nodes that come back are
    taken at the next reconfiguration, not at once (the artifact's Oobleck adds waiting
    nodes only when it reconfigures); a task left below its minimum takes them at once.
    It cannot take nodes from other tasks; hangs are found at the distributed timeout.
    """

    name: ClassVar[str] = "oobleck"
    timeout_s: float = 600.0
    """Distributed timeout, as :class:`Megatron`."""
    failure_detect_s: float = 5.0
    """Oobleck's agents see a worker or node drop through their connections (assumption)."""
    lost_step_scale: float = 1.0
    """Multiplier on the interrupted step's lost part (sensitivity; 1: what was done of it)."""
    cost_scale: float = 1.0
    """Multiplier on the artifact's per-model reconfiguration time (sensitivity)."""

    def reconfigure_s(self, task: TaskRun) -> float:
        return self.cost_scale * per_model(OOBLECK_RECONFIGURE_S, task)

    def detect_s(self, task: TaskRun, method: Method) -> float:
        return self.timeout_s if method == "hang" else self.failure_detect_s

    def _fail(self, sim: Simulation, task: TaskRun, signal: str) -> None:
        if task.mode is Mode.IDLE:
            return
        if task.mode is Mode.RUNNING:
            lost = sim.partial_step_s(task, _iter_s(task)) * self.lost_step_scale
            sim.lose_running(task, lost)
        d = self.detect_s(task, method_of(signal))
        sim.recover(task, [("detection", d)], lambda _t: self._reconfigure(sim, task))

    def _reconfigure(self, sim: Simulation, task: TaskRun) -> None:
        sim.resize(task, task.target)  # waiting nodes join at this reconfiguration
        if len(task.nodes) < task.spec.min_nodes:
            sim.set_mode(task, Mode.IDLE)
            return
        sim.recover(task, [("transition", self.reconfigure_s(task))], sim.starter(task))

    def on_node_back(self, sim: Simulation, node: str) -> None:
        self._grow_below_target(sim, self.reconfigure_s, running_too=False)


@dataclass(kw_only=True)
class Bamboo(Policy):
    """Bamboo (Thorpe et al., NSDI'23): redundant computation.

    Every node also holds and computes its pipeline successor's layers, which (1) costs
    throughput all the time: the artifact's measured Bamboo throughput is
    ``redundancy_factor`` of Oobleck's on the same nodes, and (2) needs memory for two
    stages: a task runs only on node counts where the planner fits a model with twice the
    layers (the artifact's Bamboo runs out of memory for GPT-3 medium and larger; our
    memory model is the planner's, on the scenario's GPU). A lost node fails over to its
    redundant copy; the pipeline is then rebuilt smaller (the per-model
    :data:`BAMBOO_REBALANCE_S`) and the part of the interrupted iteration done is lost
    (bamboo_simulator.py books one ``step_delta``). Returning nodes are added by another
    rebuild. Hangs are found at the distributed timeout.
    """

    name: ClassVar[str] = "bamboo"
    timeout_s: float = 600.0
    """Distributed timeout, as :class:`Megatron`."""
    failure_detect_s: float = 5.0
    """Bamboo's agents see a worker or node drop (assumption, as Oobleck)."""
    redundancy_factor: float = 0.288
    """Bamboo's throughput over Oobleck's on the same nodes, both measured: the mean over 15..30
    nodes of the ratio of the BERT-large ``tputs`` tables in the artifact's
    bamboo_simulator.py and oobleck_simulator.py (0.23..0.33; 119.3 / 368.2 on 30 nodes)."""
    cost_scale: float = 1.0
    """Multiplier on the artifact's per-model rebuild time (sensitivity)."""
    memory_limit: bool = True
    """Run only where twice the layers fit (False: ignore Bamboo's extra memory)."""
    failover_in_flight: bool = True
    """Mechanism *failover-in-flight* (Bamboo's redundant computation, Thorpe et al. NSDI'23
    section 4; bamboo_simulator.py at :data:`ARTIFACT_COMMIT`, ``simulate_spot_instance_remove``
    lines 1073-1104 and ``simulate_training_step_complete`` lines 1257-1267): a lost node's
    successor already holds its stage, so the step in flight is not lost: it finishes, the
    rest of it ``fallback_slowdown`` times slower, and only then is the pipeline rebuilt
    (:data:`BAMBOO_REBALANCE_S`). False: the step in flight is lost and the loss is
    detected first (``failure_detect_s``), as for a failure Bamboo cannot fail over (a fault
    that leaves the node, a hang, or a second loss before the rebuild)."""
    fallback_slowdown: float = 1.5
    """Step time while a node computes two stages after a failover (bamboo_simulator.py
    ``fallback_slowdown``, line 225)."""
    measured_tables: bool = True
    """Mechanism *measured-bamboo-tables*: for a model the artifact measured Bamboo on
    (:data:`BAMBOO_OVER_OOBLECK`), scale ``redundancy_factor`` by that model's own ratio
    over BERT-large's; False: BERT-large's ratio for every model."""
    out_of_memory: frozenset[str] = frozenset()
    """Mechanism *measured-oom*: models the real Bamboo ran out of memory on, on the
    scenario's GPUs (not derived: our memory model fits them); the cross-check sets the
    artifact's, :data:`BAMBOO_ARTIFACT_OOM`. Empty by default: no such measurement on our
    scenarios' GPUs."""
    booked_useful: float | None = None
    """Mechanism *redundant-bookkeeping*, for the effective-time measure only: the share of a
    running second booked as useful step time. None (default): the steady factor, as for
    every policy. The cross-check sets the artifact's 0.1971 (bamboo_simulator.py line 128:
    ``redundant_ratio = 1 - 0.1971`` of every step is redundant computation)."""

    def rebalance_s(self, task: TaskRun) -> float:
        return self.cost_scale * per_model(BAMBOO_REBALANCE_S, task)

    def factor(self, task: TaskRun) -> float:
        """Bamboo's throughput over the planner's F on the same nodes."""
        name = task.spec.model
        if self.measured_tables and name in BAMBOO_OVER_OOBLECK:
            return (
                self.redundancy_factor
                * BAMBOO_OVER_OOBLECK[name]
                / BAMBOO_OVER_OOBLECK["bert-large"]
            )
        return self.redundancy_factor

    def detect_s(self, task: TaskRun, method: Method) -> float:
        return self.timeout_s if method == "hang" else self.failure_detect_s

    def steady_factor(self, sim: Simulation, task: TaskRun) -> float:
        return self.factor(task)

    def start(self, sim: Simulation) -> None:
        for task in sim.tasks.values():
            if self.memory_limit:
                task.flops = task.perf.flops * (_doubled_table(sim, task) > 0)
            if task.spec.model in self.out_of_memory:
                task.flops = task.perf.flops * 0.0
            task.booked_useful = self.booked_useful
        super().start(sim)

    def _fail(self, sim: Simulation, task: TaskRun, signal: str) -> None:
        if task.mode is Mode.IDLE:
            return
        step = _iter_s(task) / self.factor(task)
        failover = task.extra.pop("bamboo_failover", None) is None
        if failover and self.failover_in_flight and method_of(signal) == "node":
            if task.mode is Mode.RUNNING:
                self._failover(sim, task, step)
                return
        elif task.mode is Mode.RUNNING:
            sim.lose_running(task, sim.partial_step_s(task, step))
        d = self.detect_s(task, method_of(signal))
        sim.recover(
            task, [("detection", d), ("transition", self.rebalance_s(task))], sim.starter(task)
        )

    def _failover(self, sim: Simulation, task: TaskRun, step_s: float) -> None:
        """:attr:`failover_in_flight`: finish the step in flight slowed down, then rebuild."""
        rest = (step_s - sim.partial_step_s(task, step_s)) * self.fallback_slowdown
        task.extra["bamboo_failover"] = 1
        sim.set_factor(task, self.factor(task) / self.fallback_slowdown)
        tok = task.token

        def rebuild(_t: float) -> None:
            if task.token != tok or task.extra.pop("bamboo_failover", None) is None:
                return
            sim.set_factor(task, self.factor(task))
            sim.recover(task, [("transition", self.rebalance_s(task))], sim.starter(task))

        sim.schedule(sim.now + rest, rebuild)

    def on_node_back(self, sim: Simulation, node: str) -> None:
        self._grow_below_target(sim, self.rebalance_s, running_too=True)


BAMBOO_OVER_OOBLECK = {"bert-large": 0.288, "gpt2-medium": 0.220}
"""Bamboo's measured throughput over Oobleck's on the same nodes, per model: the mean over
15..30 nodes of the ratio of the model's ``tputs`` tables in the artifact's
bamboo_simulator.py and oobleck_simulator.py (the models it ran Bamboo on)."""
BAMBOO_ARTIFACT_OOM = frozenset({"gpt-350m", "gpt-2.7b", "gpt-6.7b"})
"""Models the artifact's Bamboo ran out of memory on (bamboo_simulator.py lines 581, 652,
723: ``# OOM``, a throughput table of zeros, for GPT-3 medium, 2.7B and 6.7B)."""


def _doubled_table(sim: Simulation, task: TaskRun) -> np.ndarray:
    """F(k) of a model with twice ``task``'s layers (nonzero where Bamboo's memory fits)."""
    wl = sim.workload
    model = task.perf.model
    doubled = replace(model, name=f"{model.name}-x2", layers=2 * model.layers)
    n = len(task.perf.flops) - 1
    table = planner.throughput_table(
        doubled,
        task.spec.global_batch,
        n * wl.gpus_per_node,
        wl.gpu_type(),
        wl.gpus_per_node,
        unit=wl.gpus_per_node,
    )
    out = np.zeros(n + 1)
    out[: len(table)] = table[: n + 1]
    return np.maximum.accumulate(out)


@dataclass(kw_only=True)
class TorchFT(Policy):
    """torchft-like per-step fault tolerance (replica groups, a quorum per step).

    A task is ``target // min_nodes`` replica groups of ``min_nodes`` nodes. A failure stalls
    the step until it is seen (an error at once; a hang or a dead node only at the collective
    ``timeout_s``); then the surviving groups go on at once while the failed group restarts
    (``restart_s``) and heals from a peer, or waits for a free node if its node is gone.
    While a group is missing the global batch shrinks: throughput drops by its share and the
    samples it would have trained are counted as lost (the optimizer sees a smaller batch:
    not the failure-free update).
    """

    name: ClassVar[str] = "torchft"
    timeout_s: float = 60.0
    """torchft Manager's collective/quorum timeout default (60 s)."""
    error_detect_s: float = 1.0
    """An error surfaces in the step that hit it (assumption)."""
    restart_s: float = 60.0
    """Restart the group's processes (assumption)."""
    heal_bw_per_node: float = 25e9 * 8
    """Live state recovery from a peer group: 8 x 200 Gb/s NICs per node (A800 preset)."""

    def detect_s(self, task: TaskRun, method: Method) -> float:
        return self.timeout_s if method in ("hang", "node") else self.error_detect_s

    def _groups(self, task: TaskRun) -> int:
        return max(1, task.target // task.spec.min_nodes)

    def _refresh(self, sim: Simulation, task: TaskRun) -> None:
        """Rate = F(target) x live groups / groups, whatever nodes are still held."""
        groups, out = self._groups(task), task.extra.get("out", 0)
        live = max(0, groups - out) / groups
        held = task.perf.flops[min(len(task.nodes), len(task.perf.flops) - 1)]
        full = task.perf.flops[task.target]
        scale = full / held if held > 0 else 0.0
        sim.set_factor(task, scale * live, sample_loss=1.0 - live)

    def _rejoin_after(self, sim: Simulation, task: TaskRun, delay: float) -> None:
        def rejoin(_t: float) -> None:
            task.extra["out"] = max(0, task.extra.get("out", 0) - 1)
            self._refresh(sim, task)
            if task.mode is not Mode.DOWN:
                sim.start(task)

        heal = task.perf.state_bytes / self.heal_bw_per_node
        sim.schedule(sim.now + delay + self.restart_s + heal, rejoin)

    def _stall(self, sim: Simulation, task: TaskRun, signal: str) -> float:
        task.extra["out"] = min(self._groups(task), task.extra.get("out", 0) + 1)
        d = self.detect_s(task, method_of(signal))

        def resume(_t: float) -> None:
            self._refresh(sim, task)
            sim.start(task)

        sim.recover(task, [("detection", d)], resume)
        return d

    def on_fault(self, sim: Simulation, task: TaskRun, node: str, signal: str, sev: int) -> None:
        d = self._stall(sim, task, signal)
        self._rejoin_after(sim, task, d)

    def on_node_lost(
        self, sim: Simulation, task: TaskRun | None, node: str, signal: str, sev: int
    ) -> None:
        if task is None:
            return
        d = self._stall(sim, task, signal)
        sim.resize(task, task.target)
        if len(task.nodes) >= task.target:
            self._rejoin_after(sim, task, d)
        else:
            task.extra["waiting"] = task.extra.get("waiting", 0) + 1

    def on_node_back(self, sim: Simulation, node: str) -> None:
        for task in sim.tasks.values():
            if task.mode is Mode.IDLE and task.target > 0 and not task.extra.get("waiting"):
                sim.resize(task, task.target)  # never started (its nodes came later)
                if len(task.nodes) >= task.spec.min_nodes:
                    self._refresh(sim, task)
                    sim.recover(task, [("transition", self.restart_s)], sim.starter(task))
                continue
            while task.extra.get("waiting", 0) > 0 and sim.free_nodes():
                sim.resize(task, len(task.nodes) + 1)
                task.extra["waiting"] -= 1
                self._rejoin_after(sim, task, 0.0)


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
        return task.perf.state_bytes / (self.storage_bw_per_node * max(len(task.nodes), 1))

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
        if task.mode is Mode.RUNNING and not self.peer_heals(task):
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


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        Unicron,
        UnicronAll,
        Megatron,
        Megatron30,
        MegatronWait,
        Oobleck,
        Varuna,
        Bamboo,
        TorchFT,
    )
}
"""Policy name -> class, in report order (``--policies`` takes these names)."""


def make_policy(name: str, *, initial: Literal["planner", "proportional"] = "planner") -> Policy:
    """A policy with its default constants; ``initial`` applies to the baselines only."""
    cls = POLICIES[name]
    if issubclass(cls, Unicron):
        return cls.measured()
    return cls(initial=initial)


A = "Oobleck artifact"
CONSTANTS: tuple[tuple[str, str, str], ...] = (
    # (policy, field, source) for every constant docs/simulator.md lists; the value is the
    # policy's default (Unicron's: make_policy's, read from bench/results).
    ("unicron", "exception_detect_s", "measured: bench/results/error.json, comm kinds"),
    ("unicron", "exit_detect_s", "measured: bench/results/crash.json, error.json"),
    ("unicron", "node_detect_s", "measured: bench/results/node.json detection_heartbeat_s"),
    ("unicron", "hang_floor_s", "measured: bench/results/hang.json detection_s"),
    ("unicron", "hang_factor", "DESIGN.md: hang threshold 3 x step"),
    ("unicron", "regroup_s", "assumption: MegaScale (NSDI'24) section 3.5, init < 30 s"),
    ("unicron", "host_copy_bw_per_gpu", "assumption: PCIe 4.0 x16, ~25 GB/s per GPU"),
    ("unicron", "storage_bw_per_node", "Llama 3 (arXiv 2407.21783) 3.3.4: 2 TB/s / 2,048 nodes"),
    ("unicron", "checkpoint_mtbf_s", "the runtime's checkpoint.mtbf default (3 h)"),
    ("megatron", "timeout_s", "Megatron-LM --distributed-timeout-minutes default 10"),
    ("megatron", "exit_detect_s", "assumption: launcher tears the job down"),
    ("megatron", "restart_s", "assumption: schedule, launch, NCCL init"),
    ("megatron", "checkpoint_interval_s", "assumption: typical of large runs"),
    ("megatron", "storage_bw_per_node", "Llama 3 (arXiv 2407.21783) 3.3.4: 2 TB/s / 2,048 nodes"),
    ("varuna", "node_detect_s", "assumption: manager heartbeat"),
    ("varuna", "checkpoint_every_iters", f"{A} varuna_simulator.py checkpoint_per_iter"),
    ("varuna", "max_stall_fraction", "assumption: artifact's scenarios stall ~6 %"),
    ("varuna", "cost_scale", f"{A}: per-model checkpoint and restart times (x1)"),
    ("oobleck", "failure_detect_s", "assumption: agents' connections drop"),
    ("oobleck", "lost_step_scale", f"{A} oobleck_simulator.py: the step in flight is wasted"),
    ("oobleck", "cost_scale", f"{A}: per-model reconfiguration 2-10 s (x1)"),
    ("bamboo", "redundancy_factor", f"{A}: Bamboo / Oobleck BERT-large tputs, 15-30 nodes"),
    ("bamboo", "cost_scale", f"{A}: per-model rebuild 76-450 s (x1)"),
    ("torchft", "timeout_s", "torchft Manager timeout default 60 s"),
    ("torchft", "error_detect_s", "assumption"),
    ("torchft", "restart_s", "assumption"),
    ("torchft", "heal_bw_per_node", "A800 preset: 8 x 200 Gb/s NICs"),
)
"""Every tunable constant of the policies with its source (docs/simulator.md's table)."""
