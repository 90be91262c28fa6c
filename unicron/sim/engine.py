"""Discrete-event core of the simulator: cluster state, task timelines, accounting.

:func:`prepare` turns a :class:`Workload` into per-task performance data once (the planner's
:func:`~unicron.planner.throughput_table` and :func:`~unicron.planner.best_config`); then
:func:`simulate` replays one trace under one policy (:mod:`unicron.sim.policies`) and
returns a :class:`~unicron.sim.metrics.PolicyResult`. The command, the bench and the tests
call these two. Pure and deterministic: events sit in a heap ordered by (time, sequence);
no wall clock, no randomness (traces carry their own seed).

Accounting. Each task has a reference rate ``ref_waf`` (its WAF with its share of the
healthy cluster under the planner, the same for every policy). At every instant a task is
RUNNING (earning ``rate``; the shortfall ``ref_waf - rate`` is *sub-healthy* loss), DOWN in
a recovery phase (``detection`` or ``transition``: all of ``ref_waf`` is lost) or IDLE
(waiting for nodes: ``idle``). A rollback to a checkpoint takes the work done since it
back out of the useful total and books it as ``lost_work``. Losses are kept in WAF-seconds,
so for every task ``ref_waf * T = useful + sum(losses)`` holds exactly.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from unicron import planner
from unicron.detect import classify
from unicron.planner import GPUSpec, ModelSpec
from unicron.sim.metrics import PolicyResult, collect
from unicron.sim.task import Mode, TaskPerf, TaskRun, TaskSpec
from unicron.sim.trace import DETECTORS, TraceEvent

FALLBACK_ITER_S = 10.0
"""Iteration time assumed where the planner finds no configuration (no fit)."""


def _extra_models() -> dict[str, ModelSpec]:
    # BERT-large (Devlin et al. 2019: 24 layers, hidden 1024, 16 heads, 512 tokens, WordPiece
    # vocabulary 30,522): a model of the Oobleck artifact's scenarios (docs/simulator.md).
    # Its layers cost what a decoder layer of the same shape costs, so the planner's GPT
    # formulas apply.
    # GPT-3 medium (Brown et al. 2020, table 2.1: 24 layers, hidden 1024, 16 heads, 2048
    # tokens) and GPT-2 medium (Radford et al. 2019: the same layers at 1024 tokens, vocabulary
    # 50,257): the artifact's "GPT-3-medium" and "GPT-2-ours" (assumption for the latter: its
    # Varuna checkpoint, 11.5 s, is GPT-3 medium's 11.2 s, so a model of the same size).
    return {
        "bert-large": ModelSpec(
            name="bert-large", layers=24, hidden=1024, heads=16, seq_len=512, vocab=30522
        ),
        "gpt-350m": ModelSpec(
            name="gpt-350m", layers=24, hidden=1024, heads=16, seq_len=2048, vocab=51200
        ),
        "gpt2-medium": ModelSpec(
            name="gpt2-medium", layers=24, hidden=1024, heads=16, seq_len=1024, vocab=50257
        ),
    }


def model_spec(name: str) -> ModelSpec:
    """A model by name: the planner's presets, then the simulator's extra models."""
    if name in planner.MODEL_PRESETS:
        return planner.MODEL_PRESETS[name]
    return _extra_models()[name]


def model_names() -> list[str]:
    """Every model name :func:`model_spec` knows."""
    return [*planner.MODEL_PRESETS, *_extra_models()]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A cluster (nodes x GPUs of one type) and the tasks that share it."""

    nodes: int
    gpus_per_node: int = 8
    gpu: str = "A800-80GB"
    """A :data:`unicron.planner.GPU_PRESETS` name (or the label of ``gpu_spec``)."""
    tasks: tuple[TaskSpec, ...]
    gpu_spec: GPUSpec | None = None
    """A GPU that is not a preset (the cross-check's calibrated one); overrides ``gpu``."""

    def gpu_type(self) -> GPUSpec:
        """The GPU the planner prices: ``gpu_spec``, else the preset named ``gpu``."""
        return self.gpu_spec if self.gpu_spec is not None else planner.GPU_PRESETS[self.gpu]

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes: must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node: must be >= 1, got {self.gpus_per_node}")
        if not self.tasks:
            raise ValueError("tasks: need at least one task")
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError("tasks: names must be unique")


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A workload with its performance data and the reference (healthy-cluster) plan."""

    workload: Workload
    perf: tuple[TaskPerf, ...]
    reference: dict[str, int]
    """Nodes per task in the planner's plan for the whole healthy cluster."""
    model_names: dict[str, str] = field(default_factory=dict)

    def ref_waf(self, name: str) -> float:
        """Reference WAF of a task: weight x F(reference nodes)."""
        p = self.by_name(name)
        return float(p.spec.weight * p.flops[self.reference[name]])

    def by_name(self, name: str) -> TaskPerf:
        for p in self.perf:
            if p.spec.name == name:
                return p
        raise KeyError(name)


def _monotone(flops: np.ndarray, cap: int) -> np.ndarray:
    """A task given k nodes runs on the best k' <= k of them (the planner's table is 0 where
    no configuration fits exactly k, e.g. a batch that does not split k ways); beyond its
    ``max_nodes`` it stays at 0, so the planner never gives it more."""
    out = np.maximum.accumulate(flops)
    out[cap + 1 :] = 0.0
    return out


def heals_from_peers(lay: planner.Layout, gpus_per_node: int, *, two_copies: bool = False) -> bool:
    """Whether the runtime rebuilds a lost rank of ``lay`` from a live replica: replicated
    optimizer state (``ddp``), or sharded (``dist-opt``) where the layout also fits with two
    keepers of each share (``two_copies``: the runtime's ``zero: 1``, docs/runtime.md, Sharded
    optimizer state); another replica to take it from (``dp`` 2 or more); no context or expert
    parallelism, no interleaved stages; a stage's ``tp`` ranks on one node, its stages on one
    node or several (docs/runtime.md, Model-parallel replicas: the grouping)."""
    return (
        (lay.sharding == "ddp" or (lay.sharding == "dist-opt" and two_copies))
        and lay.dp >= 2
        and lay.cp == 1
        and lay.ep == 1
        and lay.vp == 1
        and gpus_per_node % lay.tp == 0
    )


def _peer_healable(
    p: TaskPerf, n: int, g: int, gpu: planner.GPUSpec, options: planner.PerfOptions
) -> np.ndarray:
    """Per node count, whether the layout the task really runs on there (the best count at
    or below it, as :func:`_monotone` books) is one the runtime heals from peers
    (:func:`heals_from_peers`; a sharded optimizer state when the layout still fits in memory
    with two keepers of each share, its step time taken as the one-keeper layout's).
    Counts where nothing runs count as healable."""
    cap = n if p.spec.max_nodes is None else min(n, p.spec.max_nodes)
    configs = planner.layout_table(
        p.model, p.spec.global_batch, cap * g, gpu, g, unit=g, options=options
    )
    raw = np.array([0.0] + [c.achieved_flops if c else 0.0 for c in configs[1:]])
    out = np.ones(n + 1, dtype=bool)
    for k in range(1, min(cap, len(configs) - 1) + 1):
        runs_on = int(np.argmax(raw[: k + 1]))  # the first best count <= k
        c = configs[runs_on]
        if c is not None and c.layout is not None:
            lay = c.layout
            out[k] = heals_from_peers(lay, g, two_copies=_fits_two_copies(p, lay, gpu, g, options))
    out.setflags(write=False)
    return out


def _fits_two_copies(
    p: TaskPerf, lay: planner.Layout, gpu: planner.GPUSpec, g: int, options: planner.PerfOptions
) -> bool:
    """Whether ``lay`` (sharded optimizer state) fits in memory with two keepers of each
    share, as the runtime's ``zero: 1`` keeps them."""
    if lay.sharding != "dist-opt":
        return False
    two = dataclasses.replace(options, optimizer_copies=2)
    c = planner.evaluate(p.model, p.spec.global_batch, lay, gpu, g, two)
    return c.usable_bytes is not None and c.memory_bytes_per_gpu <= c.usable_bytes


def prepare(workload: Workload) -> Prepared:
    """Performance tables, iteration times and the reference plan (the planner, D_run = inf)."""
    # the systems compared (Varuna, Oobleck, Bamboo) reshape the batch to any GPU count; a
    # Megatron-Core launch needs it to divide (PerfOptions.exact_batch, docs/planner.md)
    options = planner.PerfOptions(exact_batch=False)
    gpu = workload.gpu_type()
    n, g = workload.nodes, workload.gpus_per_node
    perfs: list[TaskPerf] = []
    for spec in workload.tasks:
        model = model_spec(spec.model)
        cap = n if spec.max_nodes is None else min(n, spec.max_nodes)
        table = planner.throughput_table(
            model, spec.global_batch, cap * g, gpu, g, unit=g, options=options
        )
        flops = np.zeros(n + 1)
        flops[: len(table)] = table[: n + 1]
        flops[cap + 1 :] = 0.0
        flops[: spec.min_nodes] = 0.0
        flops = _monotone(flops, cap)
        perfs.append(
            TaskPerf(
                spec=spec,
                flops=flops,
                iter_time_s=0.0,
                state_bytes=planner.state_bytes(model),
                model=model,
            )
        )
    states = [
        planner.TaskState(
            name=p.spec.name,
            weight=p.spec.weight,
            min_units=p.spec.min_nodes,
            current_units=0,
            flops=p.flops,
            transition_s=0.0,
        )
        for p in perfs
    ]
    reference = planner.solve(states, n, math.inf).allocation
    final: list[TaskPerf] = []
    for p in perfs:
        units = reference[p.spec.name]
        iter_s = FALLBACK_ITER_S
        for k in range(units, 0, -1):  # the size it really runs on (see _monotone)
            cfg = planner.best_config(p.model, p.spec.global_batch, k * g, gpu, g, options)
            if cfg is not None:
                iter_s = cfg.iter_time_s
                break
        final.append(
            TaskPerf(
                spec=p.spec,
                flops=p.flops,
                iter_time_s=iter_s,
                state_bytes=p.state_bytes,
                model=p.model,
                peer_healable=_peer_healable(p, n, g, gpu, options),
            )
        )
    return Prepared(workload=workload, perf=tuple(final), reference=reference)


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders embedded numbers numerically."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name) if p)


class Policy(Protocol):
    """What a :class:`Simulation` calls on its recovery policy (the classes of
    :mod:`unicron.sim.policies` implement it): ``start`` once at time 0, a hook per trace
    event, ``ckpt_interval`` each time it books a running task's time."""

    @property
    def name(self) -> str: ...

    def ckpt_interval(self, task: TaskRun) -> float: ...

    def start(self, sim: Simulation) -> None: ...

    def on_fault(
        self, sim: Simulation, task: TaskRun, node: str, signal: str, sev: int
    ) -> None: ...

    def on_node_lost(
        self, sim: Simulation, task: TaskRun | None, node: str, signal: str, sev: int
    ) -> None: ...

    def on_node_back(self, sim: Simulation, node: str) -> None: ...


class Simulation:
    """One policy over one trace. Policies change tasks only through the methods below.

    Built by :func:`simulate`; the policy's hooks (``start``, ``on_fault``, ``on_node_lost``,
    ``on_node_back``) are called from :meth:`run`'s event loop.
    """

    def __init__(
        self,
        prepared: Prepared,
        trace: Sequence[TraceEvent],
        policy: Policy,
        *,
        duration_s: float,
        samples: int = 200,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        self.prepared = prepared
        self.workload = prepared.workload
        self.policy = policy
        self.duration_s = duration_s
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = 0
        self._progress = progress
        self.series: list[tuple[float, float]] = []
        self.ignored_events = 0
        self.node_order: dict[str, int] = {}
        self.present: dict[str, bool] = {}
        self.owner: dict[str, TaskRun | None] = {}
        self._healthy = 0
        self.standby: list[str] = []
        """Nodes alive in the trace beyond the cluster's size, first come first in."""
        self._bind_nodes(trace)
        self.tasks: dict[str, TaskRun] = {
            p.spec.name: TaskRun(perf=p, ref_waf=prepared.ref_waf(p.spec.name), target=0)
            for p in prepared.perf
        }
        for ev in trace:
            if ev.time_s <= duration_s:
                self.schedule(ev.time_s, self._dispatcher(ev))
        for i in range(samples + 1):
            self.schedule(duration_s * i / samples, self._sample)

    # ---- cluster --------------------------------------------------------------------
    def _bind_nodes(self, trace: Sequence[TraceEvent]) -> None:
        """The cluster is a pool of ``workload.nodes`` places. At time 0 it holds the first N
        nodes the trace has alive then (a node whose first event is an ``add`` after time 0
        is not), in natural order (node2 before node10); nodes alive beyond N wait in
        :attr:`standby`. A trace that adds its nodes (a CSV trace) says which nodes exist:
        places it leaves empty stay empty until an ``add``. A trace that only fails nodes (a
        generated one) is topped up with ``node{i}`` fill-ins that never fail. Later, an
        ``add`` fills an empty place (or waits in standby) and a lost node's place goes to
        the first standby node: spot traces name every replacement instance anew, and
        replacements take the place of lost ones."""
        alive: list[str] = []
        first: dict[str, TraceEvent] = {}
        for ev in trace:
            if ev.node not in first:
                first[ev.node] = ev
                if not (ev.action == "add" and ev.time_s > 0):
                    alive.append(ev.node)
        names = alive[: self.workload.nodes]
        self.standby = alive[self.workload.nodes :]
        lists_members = any(ev.action == "add" for ev in first.values())
        i = 1
        while len(names) < self.workload.nodes and not lists_members:
            if f"node{i}" not in first:
                names.append(f"node{i}")
            i += 1
        names.sort(key=_natural)
        for name in names:
            self._join(name)

    def _join(self, node: str) -> None:
        """``node`` takes an empty place in the cluster."""
        if node not in self.node_order:
            self.node_order[node] = len(self.node_order)
        self.present[node] = True
        self.owner[node] = None
        self._healthy += 1

    def free_nodes(self) -> list[str]:
        """Present nodes no task holds, in cluster order."""
        free = [n for n, up in self.present.items() if up and self.owner[n] is None]
        return sorted(free, key=self.node_order.__getitem__)

    def healthy_count(self) -> int:
        """Nodes in the cluster now."""
        return self._healthy

    def resize(self, task: TaskRun, n: int) -> None:
        """Give ``task`` exactly ``n`` nodes if the free pool allows (fewer otherwise): keeps
        its current nodes first, releases from the end, takes free nodes in cluster order."""
        self.advance(task, self.now)
        while len(task.nodes) > n:
            self.owner[task.nodes.pop()] = None
        if len(task.nodes) < n:
            for node in self.free_nodes()[: n - len(task.nodes)]:
                self.owner[node] = task
                task.nodes.append(node)

    # ---- task timeline --------------------------------------------------------------
    def advance(self, task: TaskRun, now: float) -> None:
        """Book the time since the task's last change under its current mode."""
        dt = now - task.since
        if dt <= 0:
            task.since = max(task.since, now)
            return
        if task.mode is Mode.RUNNING:
            r = task.rate()
            task.useful += r * dt
            task.loss["sub_healthy"] += (task.ref_waf - r) * dt
            share = task.factor if task.booked_useful is None else task.booked_useful
            task.overhead_s += max(0.0, 1.0 - share) * dt
            if task.sample_loss > 0:
                it = task.perf.iter_time_s
                task.lost_samples += task.sample_loss * task.spec.global_batch * dt / it
            interval = self.policy.ckpt_interval(task)
            if math.isinf(interval):
                task.work_since_ckpt += r * dt
            else:
                clock = task.ckpt_clock + dt
                if clock >= interval:  # a periodic checkpoint passed
                    task.work_since_ckpt = r * (clock % interval)
                    task.ckpt_phase = 0.0
                else:
                    task.work_since_ckpt += r * dt
                task.ckpt_clock = clock % interval
        else:
            task.loss[task.reason] += task.ref_waf * dt
            task.down_s[task.reason] += dt
        task.since = now

    def rollback(self, task: TaskRun, *, keep_clock: bool = False) -> None:
        """Lose the work since the last checkpoint (called by checkpoint-restart policies);
        the checkpoint schedule resumes from where it was at that checkpoint, or, with
        ``keep_clock``, goes on counting the discarded work (see Varuna)."""
        self.advance(task, self.now)
        task.useful -= task.work_since_ckpt
        task.loss["lost_work"] += task.work_since_ckpt
        if task.ref_waf > 0:
            task.down_s["lost_work"] += task.work_since_ckpt / task.ref_waf
        task.work_since_ckpt = 0.0
        if not keep_clock:
            task.ckpt_clock = task.ckpt_phase

    def checkpointed(self, task: TaskRun, *, keep_phase: bool = False) -> None:
        """A checkpoint completed now: a later rollback keeps the work done before it.

        ``keep_phase``: an extra checkpoint that leaves the periodic schedule where it is
        (Varuna's, by iteration number); otherwise the schedule restarts from now."""
        self.advance(task, self.now)
        task.work_since_ckpt = 0.0
        if not keep_phase:
            task.ckpt_clock = 0.0
        task.ckpt_phase = task.ckpt_clock

    def lose_running(self, task: TaskRun, seconds: float) -> None:
        """Lose the work of the last ``seconds`` of running (an interrupted step not reused)."""
        self.advance(task, self.now)
        work = min(task.work_since_ckpt, task.rate() * seconds)
        task.work_since_ckpt -= work
        task.useful -= work
        task.loss["lost_work"] += work
        if task.ref_waf > 0:
            task.down_s["lost_work"] += work / task.ref_waf

    def set_mode(self, task: TaskRun, mode: Mode, reason: str = "") -> None:
        """Switch the task's mode now (booking the time before under the old one)."""
        self.advance(task, self.now)
        if mode is Mode.RUNNING and task.rate() <= 0:
            mode, reason = Mode.IDLE, "idle"
        task.mode = mode
        task.reason = reason or ("idle" if mode is Mode.IDLE else "")

    def set_factor(self, task: TaskRun, factor: float, sample_loss: float = 0.0) -> None:
        self.advance(task, self.now)
        task.factor = factor
        task.sample_loss = sample_loss

    def recover(
        self,
        task: TaskRun,
        phases: Sequence[tuple[str, float]],
        then: Callable[[float], None],
    ) -> None:
        """Take the task DOWN through ``phases`` (reason, seconds), then call ``then(now)``.

        A later ``recover`` or :meth:`cancel` on the same task supersedes this one.
        """
        task.token += 1
        task.transitions += sum(1 for reason, d in phases if reason == "transition" and d > 0)
        self._next_phase(task, list(phases), then, task.token)

    def cancel(self, task: TaskRun) -> None:
        """Forget any recovery in flight for ``task``."""
        task.token += 1

    def _next_phase(
        self,
        task: TaskRun,
        phases: list[tuple[str, float]],
        then: Callable[[float], None],
        tok: int,
    ) -> None:
        if tok != task.token:
            return
        while phases and phases[0][1] <= 0:
            phases.pop(0)
        if not phases:
            then(self.now)
            return
        reason, dur = phases.pop(0)
        self.set_mode(task, Mode.DOWN, reason)
        self.schedule(self.now + dur, lambda _t: self._next_phase(task, phases, then, tok))

    def start(self, task: TaskRun) -> None:
        """Run on the nodes it holds (IDLE if below its minimum); its steps start now."""
        self.set_mode(task, Mode.RUNNING)
        task.run_start = self.now

    def partial_step_s(self, task: TaskRun, step_s: float) -> float:
        """Seconds of the step in flight (steps of ``step_s`` back to back since the task last
        started): what a failure now throws away."""
        if task.mode is not Mode.RUNNING or not step_s > 0:
            return 0.0
        return (self.now - task.run_start) % step_s

    def starter(self, task: TaskRun) -> Callable[[float], None]:
        """A ``then`` for :meth:`recover` that starts ``task``."""
        return lambda _now: self.start(task)

    # ---- event loop -----------------------------------------------------------------
    def schedule(self, t: float, fn: Callable[[float], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn))

    def _dispatcher(self, ev: TraceEvent) -> Callable[[float], None]:
        return lambda _t: self._on_trace(ev)

    def _on_trace(self, ev: TraceEvent) -> None:
        node = ev.node
        if ev.action == "add":
            if self.present.get(node) or node in self.standby:
                return  # already in (an ``add`` at time 0 of a node the pool starts with)
            if self.healthy_count() < self.workload.nodes:
                self._join(node)
                self.policy.on_node_back(self, node)
            else:
                self.standby.append(node)
            return
        if not self.present.get(node):
            if ev.action == "remove" and node in self.standby:
                self.standby.remove(node)
            else:
                self.ignored_events += 1
            return
        signal = ev.signal or "heartbeat_lost"
        verdict = (
            classify.classify_detector(signal)
            if signal in DETECTORS
            else classify.verdict_for_kind(signal)
        )
        task = self.owner[node]
        if ev.action == "remove":
            self.present[node] = False
            self._healthy -= 1
            if task is not None:
                self.advance(task, self.now)
                task.nodes.remove(node)
                self.owner[node] = None
                task.faults += 1
            self.policy.on_node_lost(self, task, node, signal, int(verdict.severity))
            if self.standby:  # a replacement takes the lost node's place
                spare = self.standby.pop(0)
                self._join(spare)
                self.policy.on_node_back(self, spare)
        elif task is not None:
            task.faults += 1
            self.policy.on_fault(self, task, node, signal, int(verdict.severity))

    def _sample(self, now: float) -> None:
        for task in self.tasks.values():
            self.advance(task, now)
        self.series.append((now, sum(t.useful for t in self.tasks.values())))
        if self._progress is not None:
            self._progress(now)

    def run(self) -> PolicyResult:
        """Replay the trace to ``duration_s`` and return the result."""
        self.policy.start(self)
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            if t > self.duration_s:
                break
            self.now = t
            fn(t)
        self.now = self.duration_s
        for task in self.tasks.values():
            self.advance(task, self.duration_s)
        return collect(
            self.policy.name,
            list(self.tasks.values()),
            duration_s=self.duration_s,
            series=self.series,
            ignored_events=self.ignored_events,
        )


def simulate(
    prepared: Prepared,
    trace: Sequence[TraceEvent],
    policy: Policy,
    *,
    duration_s: float,
    samples: int = 200,
    progress: Callable[[float], None] | None = None,
) -> PolicyResult:
    """Replay ``trace`` over ``prepared`` under ``policy`` for ``duration_s`` seconds."""
    if not duration_s > 0:
        raise ValueError(f"duration_s: must be > 0, got {duration_s}")
    sim = Simulation(
        prepared, trace, policy, duration_s=duration_s, samples=samples, progress=progress
    )
    return sim.run()


def paper_workload(nodes: int = 16, gpus_per_node: int = 8, gpu: str = "A800-80GB") -> Workload:
    """The paper-style multi-task workload: six GPT tasks of 1.3B-13B sharing 16 x 8 A800s.

    Sizes and weights are ours (the paper's exact task list is not reproduced); each task's
    ``max_nodes`` caps it so that the planner has to share the cluster.
    """
    tasks = (
        TaskSpec(name="gpt1.3b", model="gpt-1.3b", global_batch=256, weight=1.0, max_nodes=2),
        TaskSpec(name="gpt2.7b", model="gpt-2.7b", global_batch=512, weight=1.0, max_nodes=4),
        TaskSpec(name="gpt6.7b-a", model="gpt-6.7b", global_batch=1024, weight=1.5, max_nodes=4),
        TaskSpec(name="gpt6.7b-b", model="gpt-6.7b", global_batch=1024, weight=1.0, max_nodes=4),
        TaskSpec(
            name="gpt13b-a",
            model="gpt-13b",
            global_batch=1024,
            weight=2.0,
            min_nodes=2,
            max_nodes=6,
        ),
        TaskSpec(
            name="gpt13b-b",
            model="gpt-13b",
            global_batch=1024,
            weight=1.0,
            min_nodes=2,
            max_nodes=4,
        ),
    )
    return Workload(nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu, tasks=tasks)


def synthetic_workload(
    *, nodes: int, tasks: int, gpus_per_node: int = 8, gpu: str = "H100-80GB"
) -> Workload:
    """``tasks`` tasks cycling over four model sizes, each capped at 4x its fair share."""
    models = ("gpt-1.3b", "gpt-2.7b", "gpt-6.7b", "gpt-13b")
    cap = max(2, 4 * nodes // tasks)
    specs = tuple(
        TaskSpec(
            name=f"task{i:03d}",
            model=models[i % len(models)],
            global_batch=1024,
            weight=1.0 + (i % 3) * 0.5,
            min_nodes=2 if models[i % len(models)] == "gpt-13b" else 1,
            max_nodes=cap,
        )
        for i in range(tasks)
    )
    return Workload(nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu, tasks=specs)


def workload_from_mapping(data: object, where: str) -> Workload:
    """Build a :class:`Workload` from a parsed YAML mapping; ValueError names the field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping with 'cluster' and 'tasks'")
    cluster = data.get("cluster", {}) or {}
    raw_tasks = data.get("tasks")
    if not isinstance(cluster, dict) or not isinstance(raw_tasks, list):
        raise ValueError(f"{where}: 'cluster' must be a mapping and 'tasks' a list")
    gpu = str(cluster.get("gpu", "A800-80GB"))
    if gpu not in planner.GPU_PRESETS:
        raise ValueError(f"{where}: unknown gpu {gpu!r} (known: {', '.join(planner.GPU_PRESETS)})")
    specs = []
    for i, t in enumerate(raw_tasks):
        if not isinstance(t, dict):
            raise ValueError(f"{where}: tasks[{i}] must be a mapping")
        model = str(t.get("model", ""))
        if model not in model_names():
            known = ", ".join(model_names())
            raise ValueError(f"{where}: tasks[{i}].model {model!r} unknown (known: {known})")
        try:
            specs.append(
                TaskSpec(
                    name=str(t.get("name", f"task{i}")),
                    model=model,
                    global_batch=int(t.get("global_batch", 1024)),
                    weight=float(t.get("weight", 1.0)),
                    min_nodes=int(t.get("min_nodes", 1)),
                    max_nodes=None if t.get("max_nodes") is None else int(t["max_nodes"]),
                )
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: tasks[{i}]: {exc}") from None
    return Workload(
        nodes=int(cluster.get("nodes", 16)),
        gpus_per_node=int(cluster.get("gpus_per_node", 8)),
        gpu=gpu,
        tasks=tuple(specs),
    )
