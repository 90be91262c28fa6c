"""Is a data-parallel task better off without its straggler? Asked of the planner.

The coordinator calls :func:`straggler_plan` when the agent's monitor reports a straggler. A
synchronous data-parallel step lasts as long as its slowest replica, so with ``k`` workers of
which one computes a micro-batch in ``slow_mb_s`` (its peers in ``peer_mb_s``) the task makes
``M / (ceil(M / k) * slow_mb_s)`` micro-batches per second, and without it
``M / (ceil(M / (k - 1)) * peer_mb_s)``. That measured profile becomes the task's throughput
table for the planner's :func:`~unicron.planner.solve`, with the cost of a transition, and the
planner's allocation is the answer. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math

import numpy as np

from unicron.planner import TaskState, solve

TRANSITION_S = 1.0
"""what dropping a worker costs the task (a new epoch; ~0.1 s measured here, 10x headroom)"""
D_RUN_S = 3600.0
"""expected time until the membership changes again, over which a gain is counted"""


def throughput_profile(
    world: int, microbatches: int, peer_mb_s: float, slow_mb_s: float
) -> np.ndarray:
    """Micro-batches per second for 0..world workers, the last entry with the straggler."""
    rates = np.zeros(world + 1)
    for u in range(1, world):
        rates[u] = microbatches / (math.ceil(microbatches / u) * peer_mb_s)
    rates[world] = microbatches / (math.ceil(microbatches / world) * max(peer_mb_s, slow_mb_s))
    return rates


def straggler_plan(
    *, world: int, microbatches: int, peer_mb_s: float, slow_mb_s: float, min_workers: int
) -> tuple[bool, str]:
    """(drop the straggler?, the reason, with both throughputs)."""
    if world <= min_workers or world < 2:
        return False, f"{world} workers, the minimum is {min_workers}: nothing to drop"
    rates = throughput_profile(world, microbatches, peer_mb_s, slow_mb_s)
    task = TaskState(
        name="task",
        weight=1.0,
        min_units=min_workers,
        current_units=world,
        flops=rates,
        transition_s=TRANSITION_S,
    )
    plan = solve([task], world, D_RUN_S)
    drop = plan.allocation["task"] < world
    reason = (
        f"{rates[world]:.1f} micro-batches/s with it, {rates[world - 1]:.1f} without "
        f"({slow_mb_s / peer_mb_s:.1f}x slower than its peers); planner: "
        f"{'drop it' if drop else 'keep it'}"
    )
    return drop, reason
