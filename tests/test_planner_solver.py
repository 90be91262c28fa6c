"""Solver: equals brute force, respects capacity and minimums, ties, WAF, baselines."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unicron.planner import (
    MODEL_PRESETS,
    TaskState,
    equal_share,
    expected_time_to_failure_s,
    greedy_marginal,
    proportional_share,
    solve,
    total_waf,
    transition_time_s,
    waf,
)


def _task(
    name: str,
    flops: list[float],
    *,
    weight: float = 1.0,
    min_units: int = 0,
    current: int = 0,
    transition_s: float = 0.0,
    must: bool = False,
) -> TaskState:
    return TaskState(
        name=name,
        weight=weight,
        min_units=min_units,
        current_units=current,
        flops=np.asarray(flops, dtype=float),
        transition_s=transition_s,
        must_transition=must,
    )


def _reward(t: TaskState, u: int, d_run: float) -> float:
    change = u != t.current_units or t.must_transition
    return waf(t, u) * d_run - (waf(t, t.current_units) * t.transition_s if change else 0.0)


def _brute_force(tasks: list[TaskState], n: int, d_run: float) -> float:
    choices = [[0, *range(max(t.min_units, 1), n + 1)] for t in tasks]
    best = -math.inf
    for alloc in itertools.product(*choices):
        if sum(alloc) <= n:
            best = max(best, sum(_reward(t, u, d_run) for t, u in zip(tasks, alloc, strict=True)))
    return best


@st.composite
def instances(draw: st.DrawFn) -> tuple[list[TaskState], int, float]:
    n = draw(st.integers(0, 7))
    m = draw(st.integers(1, 4))
    tasks = []
    for i in range(m):
        # small integers make exact ties common, which exercises the tie-breaking
        flops = [0.0] + [float(draw(st.integers(0, 6))) * 1e14 for _ in range(n)]
        tasks.append(
            _task(
                f"t{i}",
                flops,
                weight=float(draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]))),
                min_units=draw(st.integers(0, n + 1)),
                current=draw(st.integers(0, n)),
                transition_s=float(draw(st.sampled_from([0.0, 10.0, 3600.0]))),
                must=draw(st.booleans()),
            )
        )
    d_run = float(draw(st.sampled_from([60.0, 3600.0, 86400.0])))
    return tasks, n, d_run


@settings(max_examples=300, deadline=None)
@given(instances())
def test_solver_equals_brute_force(instance: tuple[list[TaskState], int, float]) -> None:
    tasks, n, d_run = instance
    plan = solve(tasks, n, d_run)
    assert sum(plan.allocation.values()) <= n
    for t in tasks:
        u = plan.allocation[t.name]
        assert u == 0 or u >= t.min_units
        assert plan.reasons[t.name]
    achieved = sum(_reward(t, plan.allocation[t.name], d_run) for t in tasks)
    best = _brute_force(tasks, n, d_run)
    assert achieved == pytest.approx(best, rel=1e-9, abs=1e-6)
    assert plan.total_reward == pytest.approx(achieved, rel=1e-9, abs=1e-6)
    assert plan.total_waf == pytest.approx(total_waf(tasks, plan.allocation))
    assert solve(tasks, n, d_run) == plan  # deterministic


@settings(max_examples=100, deadline=None)
@given(instances())
def test_solver_beats_baselines_without_transition_costs(
    instance: tuple[list[TaskState], int, float],
) -> None:
    tasks, n, _ = instance
    free = [_task(t.name, list(t.flops), weight=t.weight, min_units=t.min_units) for t in tasks]
    plan = solve(free, n, 3600.0)
    for baseline in (equal_share, proportional_share, greedy_marginal):
        alloc = baseline(free, n)
        assert sum(alloc.values()) <= n
        assert all(alloc[t.name] == 0 or alloc[t.name] >= t.min_units for t in free)
        assert plan.total_waf >= total_waf(free, alloc) * (1 - 1e-12)


def test_a_task_below_its_minimum_is_worth_nothing() -> None:
    t = _task("a", [0, 1e15, 2e15, 3e15], weight=2.0, min_units=2)
    assert waf(t, 1) == 0.0 and waf(t, 2) == 4e15
    plan = solve([t], 1, 3600.0)
    assert plan.allocation == {"a": 0}
    assert "needs at least 2" in plan.reasons["a"]


def test_ties_keep_the_current_allocation() -> None:
    flops = [0.0, 1e15, 2e15, 3e15, 4e15]
    a = _task("a", flops, current=1)
    b = _task("b", flops, current=3)
    assert solve([a, b], 4, 3600.0).allocation == {"a": 1, "b": 3}
    a2 = _task("a", flops, current=3)
    b2 = _task("b", flops, current=1)
    assert solve([a2, b2], 4, 3600.0).allocation == {"a": 3, "b": 1}


def test_transition_cost_against_expected_run_time() -> None:
    # b would run 10% faster with one more unit taken from a (concave tables), but the move
    # costs each task an hour: only worth it when the next failure is far away.
    a = _task("a", [0, 1.0e15, 1.9e15, 2.7e15, 3.4e15], current=3, transition_s=3600.0)
    b = _task("b", [0, 1.0e15, 1.9e15, 2.7e15, 3.4e15, 4.0e15], current=1, transition_s=3600.0)
    assert solve([a, b], 4, 3 * 3600.0).allocation == {"a": 3, "b": 1}
    moved = solve([a, b], 4, 1000 * 3600.0)
    assert moved.allocation == {"a": 2, "b": 2}
    assert moved.reasons["b"].startswith("grew 1 -> 2")
    assert moved.reasons["a"].startswith("shrank 3 -> 2")


def test_new_task_gets_the_spare_units_and_a_task_that_lost_workers_restarts() -> None:
    flops = [0.0, 1e15, 1.9e15, 2.7e15, 3.4e15]  # diminishing returns: splitting wins
    old = _task("old", flops, current=2, transition_s=60.0, must=True)
    new = _task("new", flops, min_units=2)
    plan = solve([old, new], 4, 86400.0)
    assert plan.allocation == {"old": 2, "new": 2}
    assert plan.reasons["new"].startswith("started on 2 units")
    assert "lost workers" in plan.reasons["old"]


def test_infinite_run_time_ignores_transition_costs() -> None:
    a = _task("a", [0, 1e15, 2e15], current=1, transition_s=1e9)
    plan = solve([a], 2, math.inf)
    assert plan.allocation == {"a": 2} and plan.total_reward == math.inf


def test_bad_inputs_raise_value_errors_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^weight:"):
        _task("a", [0, 1], weight=-1.0)
    with pytest.raises(ValueError, match=r"^flops:"):
        _task("a", [0, 1], current=3)
    with pytest.raises(ValueError, match=r"^flops:"):
        solve([_task("a", [0, 1])], 5, 10.0)
    with pytest.raises(ValueError, match=r"^d_run_s:"):
        solve([], 5, 0.0)
    with pytest.raises(ValueError, match=r"^tasks:"):
        solve([_task("a", [0, 1]), _task("a", [0, 1])], 1, 10.0)


def test_failure_and_transition_times() -> None:
    assert expected_time_to_failure_s(1.0, 1) == 86400.0
    assert expected_time_to_failure_s(0.5, 4) == 43200.0
    assert expected_time_to_failure_s(0.0, 4) == math.inf
    m = MODEL_PRESETS["gpt-1.3b"]
    assert transition_time_s(m, 14.0 * m.params / 10.0, 5.0) == pytest.approx(15.0)


def test_baselines_share_by_count_and_weight_and_drop_tasks_below_minimum() -> None:
    flops = [float(u) * 1e15 for u in range(11)]
    a = _task("a", flops, weight=3.0)
    b = _task("b", flops, weight=1.0)
    c = _task("c", flops, weight=1.0, min_units=5)
    assert equal_share([a, b], 10) == {"a": 5, "b": 5}
    assert proportional_share([a, b], 10) == {"a": 8, "b": 2} or proportional_share([a, b], 10) == {
        "a": 7,
        "b": 3,
    }
    assert equal_share([a, b, c], 10) == {"a": 5, "b": 5, "c": 0}
    assert greedy_marginal([a, b], 10) == {"a": 10, "b": 0}


def test_large_instance_solves_and_respects_capacity() -> None:
    rng = np.random.default_rng(0)
    n = 200
    tasks = [
        _task(
            f"t{i}",
            list(np.concatenate([[0.0], np.cumsum(rng.uniform(0, 1e15, n))])),
            weight=float(rng.uniform(0, 2)),
            min_units=int(rng.integers(0, 10)),
            current=int(rng.integers(0, 10)),
            transition_s=60.0,
        )
        for i in range(30)
    ]
    plan = solve(tasks, n, 36000.0)
    assert sum(plan.allocation.values()) <= n
    assert all(
        u == 0 or u >= t.min_units for t, u in zip(tasks, plan.allocation.values(), strict=True)
    )
    for baseline in (equal_share, proportional_share, greedy_marginal):
        assert sum(baseline(tasks, n).values()) <= n


def _reference_value(tasks: list[TaskState], n: int, d_run: float) -> float:
    """The plain O(m n^2) dynamic program over every unit count (no pruning)."""
    value = np.full(n + 1, -np.inf)
    value[0] = 0.0
    for t in tasks:
        r = np.array(
            [_reward(t, u, d_run) if u == 0 or u >= t.min_units else -np.inf for u in range(n + 1)]
        )
        new = np.full(n + 1, -np.inf)
        for j in range(n + 1):
            new[j] = max(value[j - u] + r[u] for u in range(j + 1))
        value = new
    return float(value.max())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_pruned_solver_equals_the_full_dp_on_jagged_tables(seed: int) -> None:
    # jagged tables like the performance model's (GPU counts that factor badly score low)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 60))
    tasks = []
    for i in range(int(rng.integers(2, 6))):
        flops = np.cumsum(rng.uniform(0, 1e15, n + 1)) * rng.choice([0.0, 0.5, 1.0], n + 1)
        tasks.append(
            _task(
                f"t{i}",
                list(flops),
                weight=float(rng.choice([0.5, 1.0, 2.0])),
                min_units=int(rng.integers(0, 8)),
                current=int(rng.integers(0, n // 2)),
                transition_s=float(rng.choice([0.0, 600.0])),
                must=bool(rng.random() < 0.3),
            )
        )
    plan = solve(tasks, n, 7200.0)
    achieved = sum(_reward(t, plan.allocation[t.name], 7200.0) for t in tasks)
    assert achieved == pytest.approx(_reference_value(tasks, n, 7200.0), rel=1e-9, abs=1e-6)


def test_gpu_units_at_cluster_scale_solve_fast() -> None:
    """1,024 GPUs x 32 tasks with the allocation unit one GPU (bench/planner.py measures the
    10,000 x 100 case; the target here is 100 ms, the bound 10x that on a shared machine)."""
    import time

    from bench.planner import instance

    tasks, units, d_run = instance(1024, 32, seed=0, unit=1)
    assert units == 1016
    t0 = time.perf_counter()
    plan = solve(tasks, units, d_run)
    assert time.perf_counter() - t0 < 1.0
    assert sum(plan.allocation.values()) <= units
