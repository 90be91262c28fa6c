"""Simulator benchmark: 10,000 GPUs / 100 tasks / 30 days wall time, and the paper experiment.

``run(quick)`` is called by the bench harness (``python -m bench``); ``python
bench/simulator.py`` prints a table and writes ``bench/results/simulator.json`` atomically.
Rows: ``{"system", "scenario", "metric", "median", "min", "max", "repetitions", "unit"}``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from unicron.sim.engine import paper_workload, prepare, simulate, synthetic_workload
from unicron.sim.metrics import ratios
from unicron.sim.policies import POLICIES, make_policy
from unicron.sim.trace import LLAMA3_RATE_PER_NODE_DAY, generate

DAY = 86400.0
PAPER_TRACES = {
    # name: failures per node per day (Llama 3 cause mix)
    "real-like": LLAMA3_RATE_PER_NODE_DAY * 10,
    "harsh": LLAMA3_RATE_PER_NODE_DAY * 100,
}


def _row(system: str, scenario: str, metric: str, values: list[float], unit: str) -> dict[str, Any]:
    return {
        "system": system,
        "scenario": scenario,
        "metric": metric,
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "repetitions": len(values),
        "unit": unit,
    }


def large_cluster(reps: int) -> list[dict[str, Any]]:
    """Wall time of all policies on 1,250 nodes x 8 H100, 100 tasks, 30 days (Llama 3 rate)."""
    times: dict[str, list[float]] = {n: [] for n in (*POLICIES, "setup")}
    for rep in range(reps):
        t0 = time.perf_counter()
        prepared = prepare(synthetic_workload(nodes=1250, tasks=100))
        trace = generate(
            nodes=1250, duration_s=30 * DAY, rate_per_node_day=LLAMA3_RATE_PER_NODE_DAY, seed=rep
        )
        times["setup"].append(time.perf_counter() - t0)
        for name in POLICIES:
            t0 = time.perf_counter()
            simulate(prepared, trace, make_policy(name), duration_s=30 * DAY)
            times[name].append(time.perf_counter() - t0)
    return [_row(n, "10000gpu-100task-30day", "wall_time", v, "s") for n, v in times.items()]


def paper(seeds: list[int], days: float) -> list[dict[str, Any]]:
    """Accumulated WAF per policy and Unicron's ratio over each, 16 x 8 A800, two traces."""
    rows: list[dict[str, Any]] = []
    prepared = prepare(paper_workload())
    for trace_name, rate in PAPER_TRACES.items():
        for initial in ("planner", "proportional"):
            scenario = f"paper-{trace_name}-{initial}"
            waf: dict[str, list[float]] = {n: [] for n in POLICIES}
            eff: dict[str, list[float]] = {n: [] for n in POLICIES}
            ratio: dict[str, list[float]] = {n: [] for n in POLICIES if n != "unicron"}
            for seed in seeds:
                trace = generate(nodes=16, duration_s=days * DAY, rate_per_node_day=rate, seed=seed)
                results = [
                    simulate(
                        prepared, trace, make_policy(n, initial=initial), duration_s=days * DAY
                    )
                    for n in POLICIES
                ]
                for r in results:
                    waf[r.policy].append(r.accumulated_waf / 1e18)
                    eff[r.policy].append(r.effective_fraction)
                for k, v in ratios(results).items():
                    ratio[k].append(v)
            for n in POLICIES:
                rows.append(_row(n, scenario, "accumulated_waf", waf[n], "EFLOP"))
                rows.append(_row(n, scenario, "effective_fraction", eff[n], "1"))
            for n, values in ratio.items():
                rows.append(_row(n, scenario, "unicron_over", values, "x"))
    return rows


def run(quick: bool) -> list[dict[str, Any]]:
    """All rows; ``quick`` uses one repetition and fewer seeds."""
    seeds = [0, 1] if quick else [0, 1, 2, 3, 4]
    return large_cluster(1 if quick else 3) + paper(seeds, days=30.0)


def main() -> int:
    rows = run(quick="--quick" in sys.argv)
    for r in rows:
        print(
            f"{r['system']:>13} {r['scenario']:<34} {r['metric']:<18} "
            f"{r['median']:>12.4g} [{r['min']:.4g}, {r['max']:.4g}] {r['unit']}"
        )
    out = Path(__file__).resolve().parent / "results" / "simulator.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rows, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
