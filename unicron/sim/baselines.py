"""The systems people use today, as the simulator models them: Megatron-LM checkpoint-restart
(and its variants), Varuna, Oobleck, Bamboo and torchft (:class:`~unicron.sim.policy.Policy`
subclasses; the per-model constants from the Oobleck artifact, each with its file and line).
Registered with Unicron's in :mod:`unicron.sim.policies`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from unicron import planner
from unicron.sim.engine import Simulation
from unicron.sim.policy import LLAMA3_STORAGE_BW_PER_NODE, Method, Policy, method_of
from unicron.sim.task import Mode, TaskRun

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
