"""Simulator benchmark: scale, the paper experiment, the cross-check, constant sensitivity.

``run(quick)`` is called by the bench harness (``python -m bench``); ``python
bench/simulator.py [--quick]`` prints a table and writes ``bench/results/simulator.json``
atomically. Two more modes write their own files and print a table:

* ``--crosscheck``: our Oobleck, Varuna and Bamboo on the Oobleck artifact's scenarios
  (:mod:`unicron.sim.crosscheck`), beside its figures: ``bench/results/crosscheck.md``
  (the same rows are part of ``run``'s, in ``simulator.json``);
* ``--constants``: every policy constant with its source and what doubling or halving it
  does to Unicron's ratio over that policy in the paper experiment; rewrites the table in
  its output block of ``docs/simulator.md`` (never typed by hand).

With ``--print`` either mode prints its block of ``docs/simulator.md`` and writes nothing:
the blocks are output blocks (``<!-- output long python -m bench.simulator --crosscheck
--print -->``), so ``python -m bench.docs --check`` runs them again and a stale table fails
the long test of the docs.

Rows: ``{"system", "scenario", "metric", "median", "min", "max", "repetitions", "unit"}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from unicron.sim.engine import paper_workload, prepare, simulate, synthetic_workload
from unicron.sim.metrics import ratios
from unicron.sim.policies import CONSTANTS, POLICIES, Policy, make_policy
from unicron.sim.trace import LLAMA3_RATE_PER_NODE_DAY, generate

DAY = 86400.0
PAPER_TRACES = {
    # name: failures per node per day (Llama 3 cause mix)
    "real-like": LLAMA3_RATE_PER_NODE_DAY * 10,
    "harsh": LLAMA3_RATE_PER_NODE_DAY * 100,
}
SCALE_RATES = {"1x": LLAMA3_RATE_PER_NODE_DAY, "10x": LLAMA3_RATE_PER_NODE_DAY * 10}
RESULTS = Path(__file__).resolve().parent / "results"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "simulator.md"
BEGIN = "<!-- output long python -m bench.simulator --constants --print -->"
CC_BEGIN = "<!-- output long python -m bench.simulator --crosscheck --print -->"
END = CC_END = "<!-- /output -->"


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


def large_cluster(reps: int, rates: dict[str, float]) -> list[dict[str, Any]]:
    """Wall and CPU time of every policy on 1,250 nodes x 8 H100, 100 tasks, 30 days."""
    rows: list[dict[str, Any]] = []
    for label, rate in rates.items():
        scenario = f"10000gpu-100task-30day-{label}"
        wall: dict[str, list[float]] = {n: [] for n in (*POLICIES, "setup")}
        cpu: dict[str, list[float]] = {n: [] for n in (*POLICIES, "setup")}
        for rep in range(reps):
            t0, c0 = time.perf_counter(), time.process_time()
            prepared = prepare(synthetic_workload(nodes=1250, tasks=100))
            trace = generate(nodes=1250, duration_s=30 * DAY, rate_per_node_day=rate, seed=rep)
            wall["setup"].append(time.perf_counter() - t0)
            cpu["setup"].append(time.process_time() - c0)
            for name in POLICIES:
                t0, c0 = time.perf_counter(), time.process_time()
                simulate(prepared, trace, make_policy(name), duration_s=30 * DAY)
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        rows += [_row(n, scenario, "wall_time", v, "s") for n, v in wall.items()]
        rows += [_row(n, scenario, "cpu_time", v, "s") for n, v in cpu.items()]
    return rows


def paper_ratios(
    seeds: list[int], days: float, trace_name: str, initial: str, policies: dict[str, Policy]
) -> dict[str, list[float]]:
    """Unicron's accumulated WAF over each policy's, one value per seed."""
    prepared = prepare(paper_workload())
    out: dict[str, list[float]] = {n: [] for n in policies if n != "unicron"}
    for seed in seeds:
        trace = generate(
            nodes=16, duration_s=days * DAY, rate_per_node_day=PAPER_TRACES[trace_name], seed=seed
        )
        results = [
            simulate(prepared, trace, dataclasses.replace(p), duration_s=days * DAY)
            for p in policies.values()
        ]
        for k, v in ratios(results).items():
            out[k].append(v)
    return out


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


def crosscheck() -> tuple[list[dict[str, Any]], str, str]:
    """Rows, the markdown report and its summary (for docs) of the cross-check against the
    Oobleck artifact."""
    from unicron.sim import crosscheck as cc

    cells = cc.run(cc.load())
    rows: list[dict[str, Any]] = []
    for c in cells:
        scenario = f"crosscheck-{c.model}-{c.trace}"
        note = "within 15 %: " + cc.verdict(c) if c.within else "NOT within 15 %"
        for metric, value in (
            ("effective_time_ours", c.ours_effective),
            ("effective_time_artifact", c.art_effective),
            ("norm_tput_ours", c.ours_norm_tput),
            ("norm_tput_artifact", c.art_norm_tput),
        ):
            rows.append({**_row(c.system, scenario, metric, [value], "1"), "note": note})
    return rows, cc.report(cells), cc.summary(cells)


def _vary(policy: Policy, field: str, factor: float) -> Policy:
    value = getattr(policy, field)
    new: Any = max(1, round(value * factor)) if isinstance(value, int) else value * factor
    if field == "redundancy_factor":
        new = min(new, 1.0)
    return dataclasses.replace(policy, **{field: new})


def constants(seeds: list[int], days: float, trace_name: str = "harsh") -> tuple[list[Any], str]:
    """Every constant of :data:`CONSTANTS`: value, source, Unicron's ratio over its policy
    at x0.5, x1 and x2 (the paper experiment, ``trace_name``, median over ``seeds``)."""
    base = {n: make_policy(n) for n in POLICIES}
    ref = paper_ratios(seeds, days, trace_name, "planner", base)
    table: list[Any] = []
    for policy, field, source in CONSTANTS:
        value = getattr(base[policy], field)
        cells = []
        for factor in (0.5, 2.0):
            pols = {"unicron": base["unicron"]}
            if policy == "unicron":
                pols = {
                    "unicron": _vary(base["unicron"], field, factor),
                    "megatron": base["megatron"],
                }
                target = "megatron"
            else:
                pols[policy] = _vary(base[policy], field, factor)
                target = policy
            got = paper_ratios(seeds, days, trace_name, "planner", pols)[target]
            cells.append(statistics.median(got))
        target = "megatron" if policy == "unicron" else policy
        table.append((policy, field, value, source, statistics.median(ref[target]), *cells))
    lines = [
        f"Generated by `python -m bench.simulator --constants` (paper experiment, {trace_name} "
        f"trace, {days:g} days, seeds {', '.join(map(str, seeds))}; a Unicron constant is "
        "read against `megatron`). Sensitivity: Unicron's accumulated WAF over the policy's "
        "with the constant halved / as is / doubled.",
        "",
        "| policy | constant | value | source | Unicron / policy at x0.5 / x1 / x2 |",
        "|---|---|---|---|---|",
    ]
    for policy, field, value, source, r1, r05, r2 in table:
        lines.append(
            f"| {policy} | `{field}` | {value:.4g} | {source} | {r05:.3f} / {r1:.3f} / {r2:.3f} |"
        )
    return table, "\n".join(lines) + "\n"


def run(quick: bool) -> list[dict[str, Any]]:
    """All rows; ``quick`` uses one repetition, fewer seeds, and only the 10x scale run."""
    seeds = [0, 1] if quick else [0, 1, 2, 3, 4]
    rates = {"10x": SCALE_RATES["10x"]} if quick else SCALE_RATES
    return large_cluster(1 if quick else 3, rates) + paper(seeds, days=30.0) + crosscheck()[0]


def complete(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as ``python -m bench`` saves them (machine, status, note, date, commit added) so
    that ``bench/results/SUMMARY.md`` can be regenerated from the files."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.common import check_row, code_version, machine, now_iso

    host, date, commit = machine(), now_iso(), code_version()
    out = []
    for r in rows:
        note = f"{r['scenario']}: {r['note']}" if r.get("note") else r["scenario"]
        row = {"machine": host, "status": "ok", "date": date, "commit": commit, **r, "note": note}
        check_row(row)
        out.append(row)
    return out


def _summary() -> None:
    from bench.common import write_summary

    print(f"wrote {write_summary(RESULTS)}")


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _splice(path: Path, begin: str, end: str, text: str) -> int:
    """Replace what lies between the markers ``begin`` and ``end`` in ``path`` by ``text``."""
    doc = path.read_text()
    if begin not in doc or end not in doc:
        print(f"{path}: no {begin} ... {end} markers", file=sys.stderr)
        return 2
    head, rest = doc.split(begin, 1)
    _write(path, head + begin + "\n" + text + end + rest.split(end, 1)[1])
    print(f"rewrote {begin} .. {end} in {path}")
    return 0


def _print(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(
            f"{r['system']:>13} {r['scenario']:<34} {r['metric']:<24} "
            f"{r['median']:>12.4g} [{r['min']:.4g}, {r['max']:.4g}] {r['unit']}"
        )


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.common import bench_parser

    p = bench_parser(
        "bench.simulator", __doc__, quick="one repetition, fewer seeds, only the 10x scale run"
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--crosscheck",
        action="store_true",
        help="only the cross-check against the Oobleck artifact (crosscheck.md, docs block)",
    )
    what.add_argument(
        "--constants",
        action="store_true",
        help="only the constants table, rewritten into docs/simulator.md",
    )
    p.add_argument(
        "--print",
        action="store_true",
        help="with --crosscheck or --constants: print the docs' block only, write nothing",
    )
    args = p.parse_args(argv)
    if args.print and not (args.crosscheck or args.constants):
        p.error("--print goes with --crosscheck or --constants")
    if args.crosscheck:
        rows, md, summary = crosscheck()
        if args.print:
            sys.stdout.write(summary)
            return 0
        print(md)
        RESULTS.mkdir(parents=True, exist_ok=True)
        _write(RESULTS / "crosscheck.md", md)
        print(f"wrote {RESULTS / 'crosscheck.md'} (its rows go to simulator.json with the rest)")
        return _splice(DOCS, CC_BEGIN, CC_END, summary)
    if args.constants:
        _table, md = constants(seeds=[0, 1], days=30.0)
        if args.print:
            sys.stdout.write(md)
            return 0
        print(md)
        return _splice(DOCS, BEGIN, END, md)
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = run(quick=args.quick)
    _print(rows)
    out = RESULTS / "simulator.json"
    _write(out, json.dumps(complete(rows), indent=2) + "\n")
    print(f"wrote {out}")
    _summary()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
