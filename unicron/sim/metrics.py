"""Results of a simulation run: accumulated WAF, effective fraction, lost-time breakdown.

:func:`collect` is called by :meth:`unicron.sim.engine.Simulation.run` at the end of a run;
:mod:`unicron.sim.report` and the bench read the :class:`PolicyResult` it returns.

Units. ``accumulated_waf`` is weighted FLOP (WAF integrated over time). A loss is reported
in *seconds of the reference*: for a task, WAF-seconds lost / its reference WAF; for the
cluster, summed WAF-seconds lost / the summed reference WAF. So
``effective_fraction + sum(breakdown_s) / duration_s == 1`` for the cluster and each task.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from unicron.sim.task import LOSSES, TaskRun


@dataclass(frozen=True, kw_only=True)
class TaskResult:
    """One task under one policy."""

    name: str
    ref_waf: float
    """Reference WAF (FLOP/s): weight x F(its share of the healthy cluster)."""
    accumulated_waf: float
    effective_fraction: float
    breakdown_s: dict[str, float]
    down_s: dict[str, float]
    """Wall seconds the task spent in each non-running state (lost_work: the redone span)."""
    lost_samples: float
    faults: int
    final_nodes: int
    effective_time_fraction: float
    transitions: int = 0
    """Share of wall time spent on useful steps: not down, not redone, not stalled by the
    steady factor (the Oobleck artifact's "Effective Time"; docs/simulator.md)."""


@dataclass(frozen=True, kw_only=True)
class PolicyResult:
    """One policy over one trace."""

    policy: str
    duration_s: float
    ref_waf: float
    accumulated_waf: float
    effective_fraction: float
    breakdown_s: dict[str, float]
    lost_samples: float
    series: list[tuple[float, float]]
    """(seconds, accumulated WAF so far), for the plot."""
    tasks: list[TaskResult]
    ignored_events: int
    effective_time_fraction: float
    """The tasks' effective-time fractions, weighted by their reference WAF."""

    def to_json(self) -> dict[str, Any]:
        """The summary.json object for this policy (without the time series)."""
        return {
            "policy": self.policy,
            "duration_s": self.duration_s,
            "reference_waf_flops": self.ref_waf,
            "accumulated_waf": self.accumulated_waf,
            "effective_fraction": self.effective_fraction,
            "effective_time_fraction": self.effective_time_fraction,
            "breakdown_s": self.breakdown_s,
            "lost_samples": self.lost_samples,
            "ignored_trace_events": self.ignored_events,
            "tasks": [
                {
                    "name": t.name,
                    "reference_waf_flops": t.ref_waf,
                    "accumulated_waf": t.accumulated_waf,
                    "effective_fraction": t.effective_fraction,
                    "effective_time_fraction": t.effective_time_fraction,
                    "breakdown_s": t.breakdown_s,
                    "down_s": t.down_s,
                    "lost_samples": t.lost_samples,
                    "faults": t.faults,
                    "transitions": t.transitions,
                    "final_nodes": t.final_nodes,
                }
                for t in self.tasks
            ],
        }


def _seconds(loss: dict[str, float], ref: float) -> dict[str, float]:
    return {k: (loss[k] / ref if ref > 0 else 0.0) for k in LOSSES}


def collect(
    policy: str,
    runs: Sequence[TaskRun],
    *,
    duration_s: float,
    series: list[tuple[float, float]],
    ignored_events: int,
) -> PolicyResult:
    """Summarise a finished simulation: ``runs`` are its tasks, all advanced to
    ``duration_s``; ``series`` its (seconds, accumulated WAF) samples."""
    T = duration_s
    tasks: list[TaskResult] = []
    total_loss = dict.fromkeys(LOSSES, 0.0)
    for t in runs:
        for k in LOSSES:
            total_loss[k] += t.loss[k]
        tasks.append(
            TaskResult(
                name=t.name,
                ref_waf=t.ref_waf,
                accumulated_waf=t.useful,
                effective_fraction=t.useful / (t.ref_waf * T) if t.ref_waf > 0 else 0.0,
                breakdown_s=_seconds(t.loss, t.ref_waf),
                down_s=dict(t.down_s),
                lost_samples=t.lost_samples,
                faults=t.faults,
                final_nodes=len(t.nodes),
                effective_time_fraction=max(0.0, 1.0 - (sum(t.down_s.values()) + t.overhead_s) / T),
                transitions=t.transitions,
            )
        )
    ref = sum(t.ref_waf for t in runs)
    useful = sum(t.useful for t in runs)
    return PolicyResult(
        policy=policy,
        duration_s=T,
        ref_waf=ref,
        accumulated_waf=useful,
        effective_fraction=useful / (ref * T) if ref > 0 else 0.0,
        breakdown_s=_seconds(total_loss, ref),
        lost_samples=sum(t.lost_samples for t in tasks),
        series=list(series),
        tasks=tasks,
        ignored_events=ignored_events,
        effective_time_fraction=(
            sum(t.effective_time_fraction * t.ref_waf for t in tasks) / ref if ref > 0 else 0.0
        ),
    )


def ratios(results: list[PolicyResult], against: str = "unicron") -> dict[str, float]:
    """Accumulated WAF of ``against`` divided by each other policy's (inf if theirs is 0)."""
    base = next((r for r in results if r.policy == against), None)
    if base is None:
        return {}
    out: dict[str, float] = {}
    for r in results:
        if r.policy != against:
            out[r.policy] = (
                base.accumulated_waf / r.accumulated_waf if r.accumulated_waf > 0 else float("inf")
            )
    return out
