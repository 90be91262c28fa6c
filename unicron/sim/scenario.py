"""A sim-to-real scenario: one small cluster, a few tasks, a short trace, run twice.

``python -m bench.simreal`` runs a scenario file (``examples/sim/simreal.yaml``) on a real
cluster (a coordinator and one agent per node in network namespaces, the example model)
and then here, in the simulator, with the constants that real run measured: each task's
step rate at each worker count, the node-loss detection latency and the transition time.
:func:`load` reads the file (one-line :class:`~unicron.errors.UsageError` on bad input),
:func:`simulate` replays it under the Unicron policy. docs/simulator.md ("Sim-to-real")
gives the figures and why the two differ.

::

    nodes: 5                 # nodes of one slot each, named n0 .. n4
    duration_s: 170          # the window both runs account over
    microbatches: 8          # per global batch (the script's --microbatches)
    script: ../train_gpt.py  # relative to this file
    args: [--steps, "1000000"]
    tasks:
      - {name: light, weight: 1, min: 1, max: 4}
      - {name: heavy, weight: 3, min: 1, max: 3}
    trace:                   # seconds after every task runs: a node lost or back
      - [20, remove, n4]
      - [50, add, n4]

Units: a task's F(k) is its measured steps per second on k workers, so its accumulated
WAF is weight x steps (every task trains the same model on the same global batch, so a
step is the same number of FLOPs in every task).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from unicron import planner
from unicron.control.allocation import TaskView, throughput
from unicron.errors import UsageError
from unicron.planner import ModelSpec
from unicron.sim import engine
from unicron.sim.metrics import PolicyResult
from unicron.sim.policies import Unicron
from unicron.sim.trace import TraceEvent


@dataclass(frozen=True, kw_only=True)
class ScenarioTask:
    """One task of a scenario (as ``unicron submit`` takes it: weight, min and max workers)."""

    name: str
    weight: float
    min_workers: int
    max_workers: int


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """A scenario file, validated (see the module docstring)."""

    nodes: int
    duration_s: float
    microbatches: int
    script: Path
    args: tuple[str, ...]
    tasks: tuple[ScenarioTask, ...]
    trace: tuple[TraceEvent, ...]
    """``remove`` (node lost) and ``add`` (node back) events, seconds after the start."""

    def node_names(self) -> list[str]:
        return [f"n{i}" for i in range(self.nodes)]


def _number(v: Any, where: str, *, lo: float, integer: bool = False) -> Any:
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not math.isfinite(v) or v < lo:
        kind = "an integer" if integer else "a number"
        raise UsageError(f"{where}: must be {kind} >= {lo:g}, got {v!r}")
    return v


def parse(data: Any, where: str, base: Path) -> Scenario:
    """A :class:`Scenario` from parsed YAML; ``where`` names the file in errors."""
    if not isinstance(data, dict):
        raise UsageError(f"{where}: a scenario must be a mapping")
    known = {"nodes", "duration_s", "microbatches", "script", "args", "tasks", "trace"}
    extra = sorted(set(data) - known)
    if extra:
        raise UsageError(f"{where}: unknown field {extra[0]!r} (known: {', '.join(sorted(known))})")
    nodes = _number(data.get("nodes"), f"{where}: nodes", lo=1, integer=True)
    duration = float(_number(data.get("duration_s"), f"{where}: duration_s", lo=1))
    mb = _number(data.get("microbatches", 8), f"{where}: microbatches", lo=1, integer=True)
    script = base / str(data.get("script", ""))
    if not script.is_file():
        raise UsageError(f"{where}: script: no such file: {script}")
    raw_tasks = data.get("tasks")
    if not isinstance(raw_tasks, list) or not raw_tasks:
        raise UsageError(f"{where}: tasks: must be a non-empty list")
    tasks = []
    for i, t in enumerate(raw_tasks):
        at = f"{where}: tasks[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise UsageError(f"{at}: must be a mapping with a name")
        lo = _number(t.get("min", 1), f"{at}.min", lo=1, integer=True)
        hi = _number(t.get("max", nodes), f"{at}.max", lo=1, integer=True)
        if lo > hi:
            raise UsageError(f"{at}: min ({lo}) is above max ({hi})")
        weight = float(_number(t.get("weight", 1.0), f"{at}.weight", lo=0))
        if not weight > 0:
            raise UsageError(f"{at}.weight: must be > 0, got {weight}")
        tasks.append(ScenarioTask(name=t["name"], weight=weight, min_workers=lo, max_workers=hi))
    if len({t.name for t in tasks}) != len(tasks):
        raise UsageError(f"{where}: tasks: names must be unique")
    return Scenario(
        nodes=nodes,
        duration_s=duration,
        microbatches=mb,
        script=script.resolve(),
        args=tuple(str(a) for a in data.get("args", [])),
        tasks=tuple(tasks),
        trace=_trace(data.get("trace", []), where, nodes, duration),
    )


def _trace(raw: Any, where: str, nodes: int, duration: float) -> tuple[TraceEvent, ...]:
    """The trace rows, checked: in time order, within the window, on known nodes, a node
    lost only while up and back only while lost."""
    if not isinstance(raw, list):
        raise UsageError(f"{where}: trace: must be a list of [seconds, remove|add, node]")
    up = {f"n{i}": True for i in range(nodes)}
    out: list[TraceEvent] = []
    last = 0.0
    for i, row in enumerate(raw):
        at = f"{where}: trace[{i}]"
        if not (isinstance(row, list) and len(row) == 3):
            raise UsageError(f"{at}: must be [seconds, remove|add, node]")
        t = float(_number(row[0], f"{at} seconds", lo=last))
        action, node = row[1], str(row[2])
        if action not in ("remove", "add"):
            raise UsageError(f"{at}: action must be remove or add, got {action!r}")
        if node not in up:
            raise UsageError(f"{at}: unknown node {node!r} (n0 .. n{nodes - 1})")
        if up[node] != (action == "remove"):
            raise UsageError(f"{at}: node {node} is already {'up' if up[node] else 'lost'}")
        if t >= duration:
            raise UsageError(f"{at}: at {t:g} s, not before duration_s ({duration:g})")
        up[node] = action == "add"
        last = t
        out.append(TraceEvent(time_s=t, action=action, node=node))
    return tuple(out)


def load(path: Path) -> Scenario:
    """Read and validate a scenario file; one line on any problem."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not YAML: {str(exc).splitlines()[0]}") from None
    return parse(data, str(path), Path(path).resolve().parent)


def sim_trace(sc: Scenario) -> list[TraceEvent]:
    """The scenario's trace for the simulator: every node added at time 0 (so that the
    cluster's places are n0 .. n{N-1} in order, as the real agents register), then the
    scenario's events."""
    return [TraceEvent(time_s=0.0, action="add", node=n) for n in sc.node_names()] + list(sc.trace)


def model_table(task: ScenarioTask, nodes: int, microbatches: int) -> np.ndarray:
    """What the runtime's planner believes: ``M / ceil(M / k)`` on k workers, capped at the
    task's maximum (:func:`unicron.control.allocation.throughput`, the same function)."""
    view = TaskView(
        name=task.name,
        weight=task.weight,
        min_workers=task.min_workers,
        max_workers=task.max_workers,
        ranks={},
        running=True,
        microbatches=microbatches,
    )
    out = throughput(view, nodes)
    out[task.max_workers + 1 :] = 0.0
    return out


def measured_table(
    task: ScenarioTask, rates: dict[int, float], nodes: int, microbatches: int
) -> np.ndarray:
    """Steps per second on 0..nodes workers: the measured rate where the real run had that
    many workers, else the nearest measured count scaled by the model's ratio; 0 beyond the
    task's maximum. ``rates``: workers -> measured steps per second (at least one)."""
    if not rates:
        raise ValueError(f"task {task.name}: no measured step rate")
    model = model_table(task, nodes, microbatches)
    out = np.zeros(nodes + 1)
    for k in range(1, min(task.max_workers, nodes) + 1):
        if k in rates:
            out[k] = rates[k]
            continue
        near = min(rates, key=lambda m: (abs(m - k), m))
        out[k] = rates[near] * model[k] / model[near]
    return out


def prepare(sc: Scenario, rates: dict[str, dict[int, float]]) -> engine.Prepared:
    """The simulator's :class:`~unicron.sim.engine.Prepared` for ``sc``: measured F tables
    (booked), the runtime's model (planned with), and the reference plan: the planner's on
    the whole cluster with the model, which is what the real cluster starts with."""
    model = ModelSpec(name="example", layers=2, hidden=128, heads=4, seq_len=64, vocab=256)
    perfs = []
    for t in sc.tasks:
        f = measured_table(t, rates[t.name], sc.nodes, sc.microbatches)
        spec = engine.TaskSpec(
            name=t.name,
            model="example",
            global_batch=sc.microbatches,
            weight=t.weight,
            min_nodes=t.min_workers,
            max_nodes=t.max_workers,
        )
        perfs.append(
            engine.TaskPerf(
                spec=spec,
                flops=f,
                iter_time_s=0.0,
                state_bytes=0.0,
                model=model,
                plan_flops=model_table(t, sc.nodes, sc.microbatches),
            )
        )
    states = [
        planner.TaskState(
            name=p.spec.name,
            weight=p.spec.weight,
            min_units=p.spec.min_nodes,
            current_units=0,
            flops=p.flops if p.plan_flops is None else p.plan_flops,
            transition_s=0.0,
        )
        for p in perfs
    ]
    reference = planner.solve(states, sc.nodes, math.inf).allocation
    perfs = [
        engine.TaskPerf(
            spec=p.spec,
            flops=p.flops,
            iter_time_s=1.0 / p.flops[reference[p.spec.name]]
            if p.flops[reference[p.spec.name]] > 0
            else engine.FALLBACK_ITER_S,
            state_bytes=0.0,
            model=p.model,
            plan_flops=p.plan_flops,
        )
        for p in perfs
    ]
    wl = engine.Workload(
        nodes=sc.nodes, gpus_per_node=1, gpu="A100-80GB", tasks=tuple(p.spec for p in perfs)
    )
    return engine.Prepared(workload=wl, perf=tuple(perfs), reference=reference)


@dataclass(frozen=True, kw_only=True)
class Constants:
    """What the real run measured, for the simulator's Unicron policy."""

    rates: dict[str, dict[int, float]]
    """task -> workers -> steps per second"""
    node_detect_s: float
    """a node lost to its tasks' first detection (median)"""
    transition_s: float
    """an epoch's start to its first step, less one step (median)"""
    join_s: float = 0.0
    """a growth onto a node where the task already runs a process, to the epoch its new
    worker joins (median)"""
    join_cold_s: float = 0.0
    """the same onto a node new to the task (a fresh process: median)"""
    prior_rate_per_node_day: float = 1.0
    """the runtime's failure-rate prior for D_run (``Cluster._d_run_s``)"""


def simulate(sc: Scenario, constants: Constants) -> PolicyResult:
    """Replay ``sc`` under the Unicron policy with ``constants``: a
    :class:`~unicron.sim.metrics.PolicyResult`."""
    prepared = prepare(sc, constants.rates)
    policy = Unicron(
        node_detect_s=constants.node_detect_s,
        transition_fixed_s=constants.transition_s,
        join_s=constants.join_s,
        join_cold_s=constants.join_cold_s,
        prior_rate_per_node_day=constants.prior_rate_per_node_day,
    )
    return engine.simulate(prepared, sim_trace(sc), policy, duration_s=sc.duration_s)
