"""Planner benchmark: solve time of the DP solver, its total WAF against the baselines, and
the performance model's accuracy on published runs.

Instances: 128 GPUs x 8 tasks, 1,024 x 32 and 10,000 x 100 A100s, each drawn at random
(seeded) from the GPT-3 presets with random weights and minimums, a current allocation,
and one node just lost (the task on it must transition), solved with the allocation unit
a whole 8-GPU node and a single GPU. Throughput tables come from
:func:`unicron.planner.throughput_table` (memoised; not timed). Targets for the solve time
here, in both units: 10 ms, 100 ms, 1 s.

Accuracy (``--accuracy``, and in every run): predicted against published throughput per
GPU for the calibration and held-out runs of unicron/planner/data/runs.yaml
(:mod:`unicron.planner.calibration`), printed as the table docs/planner.md shows.

``python -m bench`` calls :func:`run`; ``python bench/planner.py [--quick] [--accuracy]``
prints a table and writes ``bench/results/planner.json``.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` and `unicron` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_parser, make_row, print_table, save_scenario
from unicron.planner import (
    GPU_PRESETS,
    MODEL_PRESETS,
    TaskState,
    calibration,
    equal_share,
    expected_time_to_failure_s,
    greedy_marginal,
    proportional_share,
    solve,
    throughput_table,
    total_waf,
    transition_time_s,
)

SCENARIO = "planner"
GPUS_PER_NODE = 8
SIZES = ((128, 8, 10.0), (1024, 32, 100.0), (10000, 100, 1000.0))  # GPUs, tasks, target ms
BATCH = {"gpt-1.3b": 512, "gpt-2.7b": 512, "gpt-6.7b": 1024, "gpt-13b": 1024}
BATCH |= {"gpt-30b": 1536, "gpt-70b": 1536, "gpt-175b": 1536}
FAILURE_RATE = 0.01  # per node per day
RESTART_S = 30.0
UNITS = (("node", GPUS_PER_NODE), ("gpu", 1))

Allocator = Callable[[Sequence[TaskState], int], dict[str, int]]


def _solver(tasks: Sequence[TaskState], units: int, d_run_s: float) -> dict[str, int]:
    return solve(tasks, units, d_run_s).allocation


def instance(
    gpus: int, n_tasks: int, seed: int, unit: int = GPUS_PER_NODE
) -> tuple[list[TaskState], int, float]:
    """A random cluster state right after one node was lost; ``unit`` GPUs per allocation
    unit (8: whole nodes, 1: single GPUs)."""
    rng = np.random.default_rng(seed)
    gpu = GPU_PRESETS["A100-80GB"]
    nodes = gpus // GPUS_PER_NODE
    per_node = GPUS_PER_NODE // unit
    units = (nodes - 1) * per_node  # one node just died
    names = list(BATCH)
    # model size roughly matched to the cluster: big models only where they can fit
    limit = len(names) if gpus >= 1024 else 5 if gpus >= 128 else 3
    specs = []
    for i in range(n_tasks):
        model = MODEL_PRESETS[names[int(rng.integers(0, limit))]]
        flops = throughput_table(model, BATCH[model.name], units * unit, gpu, GPUS_PER_NODE, unit)
        fits = np.flatnonzero(flops > 0)
        smallest = int(fits[0]) if len(fits) else units + 1
        specs.append((f"task{i}", model, flops, smallest))
    # current allocation: random shares of the healthy cluster, each at least its minimum
    healthy = nodes * per_node
    shares = rng.dirichlet(np.ones(n_tasks)) * healthy
    current = [
        max(int(s), m) if m <= healthy else 0 for s, (_, _, _, m) in zip(shares, specs, strict=True)
    ]
    while sum(current) > healthy:
        current[int(np.argmax(current))] -= 1
    victim = int(rng.choice(np.flatnonzero(np.asarray(current) > 0)))
    d_run = expected_time_to_failure_s(FAILURE_RATE, units)
    tasks = []
    for i, (name, model, flops, smallest) in enumerate(specs):
        cur = max(current[i] - (per_node if i == victim else 0), 0)
        bw = gpu.inter_node_bw * GPUS_PER_NODE
        tasks.append(
            TaskState(
                name=name,
                weight=float(rng.choice([0.5, 1.0, 1.0, 2.0])),
                min_units=min(smallest * int(rng.integers(1, 3)), units + 1),
                current_units=min(cur, units),
                flops=flops,
                transition_s=transition_time_s(model, bw, RESTART_S),
                must_transition=i == victim,
            )
        )
    return tasks, units, d_run


def accuracy_rows() -> list[dict]:
    """One row per published run (relative error of the predicted throughput per GPU) and
    one per set and GPU generation (share of runs within 15%)."""
    preds = calibration.report()
    rows = [
        make_row(
            system="perf-model",
            scenario=SCENARIO,
            metric=f"throughput_error_{p.run.id}",
            values=[p.error],
            unit="ratio",
            status="derived",
            note=f"{p.run.set}, {p.run.gpu.name}, {p.run.source}",
        )
        for p in preds
    ]
    for s in calibration.summary(preds):
        rows.append(
            make_row(
                system="perf-model",
                scenario=SCENARIO,
                metric=f"share_within_15pct_{s['set']}_{s['generation']}",
                values=[s["share_within"]],
                unit="ratio",
                status="derived",
                note=f"{s['within_15pct']} of {s['runs']} runs; RMS {100 * s['rms_error']:.1f}%",
            )
        )
    return rows


def _time_ms(fn: Callable[[], object], repetitions: int) -> list[float]:
    out = []
    for _ in range(repetitions):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def run(quick: bool) -> list[dict]:
    """Rows for bench/results/planner.json: solve time (ms) and total WAF (PFLOP/s) per size."""
    systems: dict[str, Callable[[Sequence[TaskState], int, float], dict[str, int]]] = {
        "unicron-dp": _solver,
        "equal-share": lambda t, u, _d: equal_share(t, u),
        "proportional": lambda t, u, _d: proportional_share(t, u),
        "greedy": lambda t, u, _d: greedy_marginal(t, u),
    }
    seeds = range(2 if quick else 5)
    rows = accuracy_rows()
    for (gpus, n_tasks, target_ms), (unit_name, unit) in itertools.product(SIZES, UNITS):
        size = f"{gpus}gpus_x{n_tasks}tasks" + ("" if unit == GPUS_PER_NODE else "_gpu_units")
        times: dict[str, list[float]] = {s: [] for s in systems}
        wafs: dict[str, list[float]] = {s: [] for s in systems}
        load = os.getloadavg()[0]  # the solve times' context: a shared machine's other work
        for seed in seeds:
            tasks, units, d_run = instance(gpus, n_tasks, seed, unit)
            for system, fn in systems.items():
                reps = 3 if quick else 7
                times[system] += _time_ms(partial(fn, tasks, units, d_run), reps)
                wafs[system].append(total_waf(tasks, fn(tasks, units, d_run)) / 1e15)
        for system in systems:
            note = f"target {target_ms:g} ms, " if system == "unicron-dp" else ""
            note += f"unit {unit_name}; load average {load:.1f} at the start"
            rows.append(
                make_row(
                    system=system,
                    scenario=SCENARIO,
                    metric=f"solve_ms_{size}",
                    values=times[system],
                    unit="ms",
                    note=note,
                )
            )
            rows.append(
                make_row(
                    system=system,
                    scenario=SCENARIO,
                    metric=f"total_waf_{size}",
                    values=wafs[system],
                    unit="PFLOP/s",
                    note=f"{len(wafs[system])} random instances",
                )
            )
            if system != "unicron-dp":
                ratio = [
                    d / b if b > 0 else math.inf
                    for d, b in zip(wafs["unicron-dp"], wafs[system], strict=True)
                ]
                rows.append(
                    make_row(
                        system=system,
                        scenario=SCENARIO,
                        metric=f"dp_waf_over_baseline_{size}",
                        values=ratio,
                        unit="x",
                        status="derived",
                        note="unicron-dp total WAF / this baseline's, same instances",
                    )
                )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.planner`` / ``python bench/planner.py``: the table, or the accuracy."""
    p = bench_parser(
        "bench.planner", __doc__, quick="2 seeds instead of 5, 3 timing repetitions instead of 7"
    )
    p.add_argument(
        "--accuracy",
        action="store_true",
        help="only print the performance model's accuracy table (docs/planner.md)",
    )
    args = p.parse_args(argv)
    if args.accuracy:
        print(calibration.markdown(calibration.report()))
        return 0
    result = run(quick=args.quick)
    print_table(result, title="planner")
    print(f"wrote {save_scenario(result, SCENARIO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
