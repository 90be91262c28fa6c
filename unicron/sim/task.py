"""A task of the simulated workload: its spec, its performance data, its timeline.

The types the engine (:mod:`unicron.sim.engine`), the policies (:mod:`unicron.sim.policies`)
and the results (:mod:`unicron.sim.metrics`) share, kept here so that each of those imports
them without importing another: a :class:`TaskSpec` is one task of a workload, a
:class:`TaskPerf` what the planner says about it (built by :func:`unicron.sim.engine.prepare`),
a :class:`TaskRun` its mutable timeline under one policy (owned by the engine's
``Simulation``, changed only through its methods), booked under the :data:`LOSSES`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import numpy as np

from unicron.planner import ModelSpec

LOSSES = ("detection", "transition", "lost_work", "sub_healthy", "idle")
"""Categories of lost time, in report order."""


class Mode(enum.StrEnum):
    """A task's state. RUNNING -> DOWN (a fault: recovery phases) -> RUNNING or IDLE;
    IDLE -> DOWN (nodes came: restart phases) -> RUNNING."""

    RUNNING = "running"
    DOWN = "down"
    IDLE = "idle"


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """One training task of the workload."""

    name: str
    model: str
    """A :data:`unicron.planner.MODEL_PRESETS` name or one of
    :func:`unicron.sim.engine.model_names`."""
    global_batch: int
    weight: float = 1.0
    min_nodes: int = 1
    """Fewest nodes the task runs on (also the size of one torchft replica group)."""
    max_nodes: int | None = None
    """Most nodes it can use (caps the planner's table; None: the whole cluster)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must be a non-empty string")
        if self.global_batch < 1:
            raise ValueError(f"global_batch: must be >= 1, got {self.global_batch}")
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError(f"weight: must be a finite number >= 0, got {self.weight}")
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes: must be >= 1, got {self.min_nodes}")
        if self.max_nodes is not None and self.max_nodes < self.min_nodes:
            raise ValueError(f"max_nodes: must be >= min_nodes ({self.min_nodes})")


@dataclass(frozen=True, kw_only=True)
class TaskPerf:
    """What the planner says about one task on this cluster (computed once by
    :func:`unicron.sim.engine.prepare`)."""

    spec: TaskSpec
    flops: np.ndarray
    """Achieved FLOP/s with 0..nodes nodes (0 where nothing fits or beyond max_nodes)."""
    iter_time_s: float
    """Iteration time at the reference allocation."""
    state_bytes: float
    """Training state to move or load (planner's :func:`~unicron.planner.state_bytes`)."""
    model: ModelSpec
    """The model's shape (:func:`unicron.sim.engine.model_spec`)."""
    plan_flops: np.ndarray | None = None
    """What the planner believes F(nodes) is, where that differs from what the task really
    gets (``flops``): the sim-to-real scenario (:mod:`unicron.sim.scenario`) plans with the
    runtime's model and books the rates measured on the real cluster. None: ``flops``."""
    peer_healable: np.ndarray | None = None
    """Per node count (0..nodes): whether the layout the task runs on there is one the
    runtime heals from its peers today, a data-parallel replica of the whole model with
    replicated state (tp = cp = pp = 1, ``ddp``: docs/simulator.md). None: every count (a
    task whose layouts are not known, e.g. a measured profile)."""


@dataclass(eq=False)
class TaskRun:
    """One task's mutable timeline under one policy (owned by
    :class:`unicron.sim.engine.Simulation`)."""

    perf: TaskPerf
    ref_waf: float
    target: int
    """Nodes the policy wants the task to hold (fixed world size for Megatron)."""
    nodes: list[str] = field(default_factory=list)
    mode: Mode = Mode.IDLE
    reason: str = "idle"
    since: float = 0.0
    token: int = 0
    flops: np.ndarray | None = None
    """F(nodes) this policy gets (None: the planner's, ``perf.flops``; Bamboo masks the node
    counts where its doubled memory does not fit)."""
    factor: float = 1.0
    """Multiplier on F(nodes) while running (steady overhead x live replica fraction)."""
    booked_useful: float | None = None
    """Share of a running second the effective-time measure books as useful (None:
    ``factor``; Bamboo's artifact bookkeeping sets its own)."""
    sample_loss: float = 0.0
    """Fraction of the global batch dropped per step (torchft while replicas are missing)."""
    useful: float = 0.0
    loss: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOSSES, 0.0))
    down_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOSSES, 0.0))
    ckpt_clock: float = 0.0
    """Running seconds since the last periodic checkpoint (its phase in the schedule)."""
    ckpt_phase: float = 0.0
    """``ckpt_clock`` at the last checkpoint: a rollback returns the schedule there."""
    work_since_ckpt: float = 0.0
    run_start: float = 0.0
    """When the task last started running (its step boundaries count from here)."""
    overhead_s: float = 0.0
    """Running seconds lost to the steady factor (checkpoint stalls, redundant computation):
    the running time times ``1 - factor``, for the effective-time fraction."""
    lost_samples: float = 0.0
    faults: int = 0
    transitions: int = 0
    """Transition phases the policy started for the task (superseded ones included)."""
    extra: dict[str, int] = field(default_factory=dict)
    """Policy bookkeeping (torchft: replica groups out)."""

    @property
    def name(self) -> str:
        return self.perf.spec.name

    @property
    def spec(self) -> TaskSpec:
        return self.perf.spec

    def rate(self) -> float:
        """WAF while running with the current nodes (0 below the minimum)."""
        n = len(self.nodes)
        if n < self.spec.min_nodes:
            return 0.0
        flops = self.perf.flops if self.flops is None else self.flops
        return float(self.spec.weight * flops[min(n, len(flops) - 1)]) * self.factor
