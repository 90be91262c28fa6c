"""Allocation baselines the solver is compared against (bench/planner.py, tests).

All three ignore transition costs, as the policies they stand for do:

- :func:`equal_share`: every task the same number of units;
- :func:`proportional_share`: units in proportion to the weights;
- :func:`greedy_marginal`: one unit at a time to the task whose WAF grows most per unit.

In the two share policies, a task whose share falls below its minimum gets nothing and its
share is spread over the others (the task with the largest shortfall is dropped first).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from unicron.planner.solver import TaskState, waf


def _largest_remainder(shares: np.ndarray, units: int) -> np.ndarray:
    """Integer split of ``units`` following real ``shares`` (Hamilton's method, stable)."""
    base = np.floor(shares).astype(np.int64)
    left = units - int(base.sum())
    order = np.argsort(-(shares - base), kind="stable")
    base[order[:left]] += 1
    return base


def _share(tasks: Sequence[TaskState], units: int, weights: np.ndarray) -> dict[str, int]:
    active = weights > 0
    while True:
        alloc = np.zeros(len(tasks), dtype=np.int64)
        if active.any():
            w = np.where(active, weights, 0.0)
            alloc = _largest_remainder(w / w.sum() * units, units)
        mins = np.array([t.min_units for t in tasks])
        short = active & (alloc < mins)
        if not short.any():
            return {t.name: int(a) for t, a in zip(tasks, alloc, strict=True)}
        deficit = np.where(short, mins - alloc, -1)
        active[int(np.argmax(deficit))] = False


def equal_share(tasks: Sequence[TaskState], units: int) -> dict[str, int]:
    """Every task gets ``units / len(tasks)`` (remainders to the first tasks)."""
    return _share(tasks, units, np.ones(len(tasks)))


def proportional_share(tasks: Sequence[TaskState], units: int) -> dict[str, int]:
    """Every task gets units in proportion to its weight (weight 0: nothing)."""
    return _share(tasks, units, np.array([t.weight for t in tasks], dtype=np.float64))


def greedy_marginal(tasks: Sequence[TaskState], units: int) -> dict[str, int]:
    """Repeatedly give the next step (1 unit, or a task's whole minimum) to the task with the
    largest WAF gain per unit; stop when no step gains or fits. Ties go to the first task."""
    alloc = [0] * len(tasks)
    free = units
    while free > 0:
        best, best_gain, best_step = -1, 0.0, 0
        for i, t in enumerate(tasks):
            step = max(t.min_units, 1) if alloc[i] == 0 else 1
            if step > free or alloc[i] + step >= len(t.flops):
                continue
            gain = (waf(t, alloc[i] + step) - waf(t, alloc[i])) / step
            if gain > best_gain:
                best, best_gain, best_step = i, gain, step
        if best < 0:
            break
        alloc[best] += best_step
        free -= best_step
    return {t.name: a for t, a in zip(tasks, alloc, strict=True)}


def total_waf(tasks: Sequence[TaskState], allocation: dict[str, int]) -> float:
    """Summed WAF of an allocation (FLOP/s)."""
    return sum(waf(t, allocation[t.name]) for t in tasks)


__all__ = ["equal_share", "greedy_marginal", "proportional_share", "total_waf"]
