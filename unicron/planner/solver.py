"""WAF, reward and the cluster-wide reconfiguration solver (DESIGN.md, planning).

:func:`solve` is the decision the coordinator makes on every trigger (a node lost or back,
a task submitted or done) and the cluster simulator replays: given every task's throughput
table (from :func:`unicron.planner.perf.throughput_table` or a measured profile), weight,
minimum and current allocation, it returns the allocation of the free units that maximises
the summed reward, and one sentence per task saying why. It is a pure function: no I/O, no
clock, deterministic ties.

Reward of giving task ``t`` ``u`` units (``c`` = its current units, ``D_run`` = expected time
to the next failure, ``D_tr`` = its transition time)::

    reward(t, u) = WAF(t, u) * D_run - WAF(t, c) * D_tr * [u != c or t lost workers]

The dynamic program runs over tasks and allocation units: ``V_i(j)`` is the best summed
reward of the first ``i`` tasks using at most ``j`` units, and ``V_i = V_{i-1} (max,+) r_i``
is a max-plus convolution. A unit count whose reward does not beat every smaller count is
dominated (units may stay idle), so only the others ("candidates": the running-maximum
records of ``r_i``, plus the current count) are tried, one vectorised pass each: a solve
costs ``O(n * sum of candidates)`` element operations, at most ``O(m n^2)``. The optimum
is then read back task by task, exactly (ties within 1e-12 relative).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from unicron.planner.perf import ModelSpec, state_bytes

SECONDS_PER_DAY = 86400.0
_REL_TOL = 1e-12  # two rewards closer than this (relative) are a tie


def _slack(x: np.ndarray) -> np.ndarray:
    """Tie tolerance around ``x`` (0 where ``x`` is -inf: unreachable)."""
    return np.where(np.isfinite(x), _REL_TOL * np.abs(x), 0.0)


@dataclass(frozen=True, kw_only=True, eq=False)
class TaskState:
    """One task as the solver sees it; built by the command, the coordinator, the simulator."""

    name: str
    """Unique task name."""
    weight: float
    """Priority weight (>= 0); WAF = weight x achieved FLOP/s."""
    min_units: int
    """Fewest units the task can run on; below it the task is worth nothing (0 allowed)."""
    current_units: int
    """Units the task holds before the decision (survivors, after a loss; 0 if new)."""
    flops: np.ndarray
    """Achieved FLOP/s with 0..N units; length at least the units available + 1."""
    transition_s: float
    """Seconds of work the task loses if its allocation changes."""
    must_transition: bool = False
    """The task lost workers: it pays its transition whatever it gets."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must be a non-empty string")
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError(f"weight: must be a finite number >= 0, got {self.weight!r}")
        for name in ("min_units", "current_units"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
        flops = np.asarray(self.flops, dtype=np.float64)
        if flops.ndim != 1 or len(flops) <= self.current_units:
            raise ValueError(
                f"flops: must be a 1-D array longer than current_units ({self.current_units})"
            )
        if not (np.all(np.isfinite(flops)) and np.all(flops >= 0)):
            raise ValueError("flops: must be finite and >= 0")
        flops = flops.copy()
        flops[0] = 0.0  # no units, no work
        flops.setflags(write=False)
        object.__setattr__(self, "flops", flops)
        if not (math.isfinite(self.transition_s) and self.transition_s >= 0):
            raise ValueError(
                f"transition_s: must be a finite number >= 0, got {self.transition_s!r}"
            )


@dataclass(frozen=True)
class Plan:
    """The solver's answer."""

    allocation: dict[str, int]
    """Units per task."""
    reasons: dict[str, str]
    """One human sentence per task."""
    total_waf: float
    """Sum of weight x flops[units] (0 below a task's minimum), FLOP/s."""
    total_reward: float
    """Sum of the rewards, FLOP (WAF x seconds); inf when no failure is expected."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Reward per task, same unit as :attr:`total_reward`."""


def waf(task: TaskState, units: int) -> float:
    """Weighted achieved FLOP/s of ``task`` on ``units`` units; 0 below its minimum."""
    if units < 0 or units >= len(task.flops):
        raise ValueError(f"units: must be in [0, {len(task.flops) - 1}], got {units}")
    if units < task.min_units:
        return 0.0
    return float(task.weight * task.flops[units])


def _waf_vector(task: TaskState, n: int) -> np.ndarray:
    out = task.weight * task.flops[: n + 1]
    out[: task.min_units] = 0.0
    return out


def _reward_rate(task: TaskState, n: int, d_run_s: float) -> np.ndarray:
    """reward(t, u) / D_run for u = 0..n; -inf where 0 < u < min_units."""
    r = _waf_vector(task, n)
    penalty = waf(task, task.current_units) * task.transition_s / d_run_s
    if task.must_transition:
        r -= penalty
    else:
        change = np.ones(n + 1, dtype=bool)
        if task.current_units <= n:
            change[task.current_units] = False
        r[change] -= penalty
    r[1 : task.min_units] = -np.inf
    return r


def transition_time_s(model: ModelSpec, bandwidth_bytes_per_s: float, restart_s: float) -> float:
    """Seconds a transition costs: the state over the nearest source's bandwidth + restart."""
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"bandwidth_bytes_per_s: must be > 0, got {bandwidth_bytes_per_s!r}")
    if not restart_s >= 0:
        raise ValueError(f"restart_s: must be >= 0, got {restart_s!r}")
    return state_bytes(model) / bandwidth_bytes_per_s + restart_s


def expected_time_to_failure_s(failure_rate_per_node_per_day: float, nodes: int) -> float:
    """D_run: mean time to the next failure of ``nodes`` independent nodes (inf if none fail)."""
    if not (failure_rate_per_node_per_day >= 0 and math.isfinite(failure_rate_per_node_per_day)):
        raise ValueError(
            "failure_rate_per_node_per_day: must be a finite number >= 0, "
            f"got {failure_rate_per_node_per_day!r}"
        )
    if nodes < 0:
        raise ValueError(f"nodes: must be >= 0, got {nodes}")
    rate = failure_rate_per_node_per_day * nodes
    return math.inf if rate == 0 else SECONDS_PER_DAY / rate


def _candidates(task: TaskState, r: np.ndarray, n: int) -> np.ndarray:
    """Unit counts worth trying for ``task``: 0 and every count whose reward beats all
    smaller counts (any other count is dominated: fewer units earn at least as much, and
    units may stay idle), plus its current count (no transition). Increasing order."""
    lo = max(task.min_units, 1)
    if lo > n:
        return np.zeros(1, dtype=np.int64)
    tail = r[lo:]
    prior = np.maximum.accumulate(np.concatenate([[r[0]], tail]))[:-1]
    front = np.flatnonzero(tail > prior) + lo
    c = task.current_units
    if lo <= c <= n and not task.must_transition and np.isfinite(r[c]):
        front = np.union1d(front, [c])
    return np.concatenate([[0], front]).astype(np.int64)


def _dp(
    tasks: Sequence[TaskState], n: int, d_run_s: float
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Max-plus DP over tasks: ``values[i][j]`` is the best summed reward rate of the first
    ``i`` tasks using at most ``j`` units. Only each task's candidate counts are tried, one
    vectorised pass per candidate, so a solve costs ``O(n * sum of candidates)``."""
    value = np.zeros(n + 1)
    values = [value]
    rates, cands = [], []
    for task in tasks:
        r = _reward_rate(task, n, d_run_s)
        cand = _candidates(task, r, n)
        best = value + r[0]
        tmp = np.empty(n + 1)
        for u in cand[1:].tolist():
            part = tmp[: n + 1 - u]
            np.add(value[: n + 1 - u], r[u], out=part)
            np.maximum(best[u:], part, out=best[u:])
        value = np.maximum.accumulate(best)
        values.append(value)
        rates.append(r)
        cands.append(cand)
    return values, rates, cands


def _backtrack(
    tasks: Sequence[TaskState],
    n: int,
    values: list[np.ndarray],
    rates: list[np.ndarray],
    cands: list[np.ndarray],
) -> dict[str, int]:
    """Units per task achieving the optimum; ties keep a task's current count, then take
    fewer units (tasks decided last to first)."""
    allocation: dict[str, int] = {}
    j = n
    for i in range(len(tasks) - 1, -1, -1):
        task, target, prev = tasks[i], values[i + 1][j], values[i]
        cand = cands[i][cands[i] <= j]
        total = prev[j - cand] + rates[i][cand]
        ok = total >= target - _REL_TOL * abs(target)
        assert ok.any(), "the optimum must be reachable from some candidate"
        c = task.current_units
        picks = cand[ok]
        u = c if (c in picks and not task.must_transition) else int(picks[0])
        allocation[task.name] = int(u)
        j -= int(u)
    return {t.name: allocation[t.name] for t in tasks}


def solve(
    tasks: Sequence[TaskState],
    units: int,
    d_run_s: float,
    *,
    rate_unit: tuple[str, float] = ("PFLOP/s", 1e15),
) -> Plan:
    """Allocate ``units`` units to ``tasks`` maximising the summed reward.

    Called by the ``unicron plan`` command, the coordinator on every trigger and the cluster
    simulator. Each task gets 0 or between its minimum and ``units``; the total never exceeds
    ``units``. Ties prefer each task's current allocation, then fewer units. Pure function.
    ``rate_unit``: how the reasons print a task's ``flops`` (name, and the value of one);
    the cluster's allocation, whose rates are worker-equivalents, passes its own.
    """
    if isinstance(units, bool) or not isinstance(units, int) or units < 0:
        raise ValueError(f"units: must be an integer >= 0, got {units!r}")
    if not d_run_s > 0:
        raise ValueError(f"d_run_s: must be > 0, got {d_run_s!r}")
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ValueError("tasks: names must be unique")
    for t in tasks:
        if len(t.flops) < units + 1:
            raise ValueError(f"flops: task {t.name} has {len(t.flops)} entries, need {units + 1}")
    values, rates, cands = _dp(tasks, units, d_run_s)
    allocation = _backtrack(tasks, units, values, rates, cands)
    scale = 1.0 if math.isinf(d_run_s) else d_run_s
    rewards = {
        t.name: float(rate[allocation[t.name]]) * scale
        for t, rate in zip(tasks, rates, strict=True)
    }
    if math.isinf(d_run_s):
        rewards = {k: math.inf if v > 0 else v for k, v in rewards.items()}
    total_waf = sum(waf(t, allocation[t.name]) for t in tasks)
    reasons = {t.name: _reason(t, allocation[t.name], units, d_run_s, rate_unit) for t in tasks}
    return Plan(
        allocation=allocation,
        reasons=reasons,
        total_waf=total_waf,
        total_reward=sum(rewards.values()),
        rewards=rewards,
    )


def _reason(t: TaskState, u: int, units: int, d_run_s: float, rate_unit: tuple[str, float]) -> str:
    """One sentence on why ``t`` gets ``u`` units (shown by ``unicron plan``)."""

    def _pflops(x: float) -> str:
        return f"{x / rate_unit[1]:.3g} {rate_unit[0]}"

    c = t.current_units
    d_run = "no failure expected" if math.isinf(d_run_s) else f"D_run {d_run_s / 3600:.3g} h"
    if t.weight == 0 and u == 0:
        return "gets nothing: weight 0"
    if u == 0 and t.min_units > units:
        return f"gets nothing: needs at least {t.min_units} units, {units} available"
    if t.must_transition:
        what = f"lost workers ({c} units left); restarts on {u} units" if u else "lost workers"
        if u == 0:
            return f"{what}; stopped: its units earn more WAF in other tasks"
        return f"{what} ({_pflops(waf(t, u))} WAF)"
    if u == c:
        if u == 0:
            return "waits: the free units earn more WAF in other tasks"
        return (
            f"kept {u} units: no move gains enough WAF over {d_run} "
            f"to repay a {t.transition_s:.3g} s transition"
        )
    if u == 0:
        return f"stopped (had {c} units): they earn more WAF in other tasks"
    gain = waf(t, u) - waf(t, c)
    if c == 0:
        return f"started on {u} units ({_pflops(waf(t, u))} WAF)"
    if u > c:
        return (
            f"grew {c} -> {u} units: +{_pflops(gain)} WAF over {d_run} "
            f"repays the {t.transition_s:.3g} s transition"
        )
    return f"shrank {c} -> {u} units ({_pflops(gain)} WAF): the units earn more elsewhere"


__all__ = [
    "Plan",
    "TaskState",
    "expected_time_to_failure_s",
    "solve",
    "transition_time_s",
    "waf",
]
