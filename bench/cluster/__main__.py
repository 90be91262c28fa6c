"""``python -m bench.cluster``: the cluster benchmarks; prints the table, merges the rows
into ``bench/results/<scenario>.json`` and regenerates ``bench/results/SUMMARY.md``.

    python -m bench.cluster                          # every part, full settings (~25 min)
    python -m bench.cluster --quick                  # every part, small (~6 min)
    python -m bench.cluster --part kill --reps 5
    python -m bench.cluster --part load --soak-s 600 --agents 200 --tasks 20
    python -m bench.cluster --part node --reps 3
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import (
    RESULTS_DIR,
    BenchParser,
    Row,
    bench_parser,
    machine,
    print_table,
    save_scenario,
    write_summary,
)

PARTS = {"kill": "cluster-kill", "load": "cluster-load", "node": "cluster-node"}


def build_parser() -> BenchParser:
    p = bench_parser("bench.cluster", __doc__)
    p.add_argument("--quick", action="store_true", help="fewer steps, repetitions, a 60 s soak")
    p.add_argument("--part", action="append", choices=sorted(PARTS), default=[],
                   help="run only this part (repeatable; default: all)")  # fmt: skip
    p.add_argument("--reps", type=int, metavar="N", help="repetitions (kill, node)")
    p.add_argument("--steps", type=int, metavar="N", help="training steps (kill)")
    p.add_argument("--down-s", type=float, default=1.0, metavar="S",
                   help="seconds the coordinator stays dead (kill; default 1)")  # fmt: skip
    p.add_argument("--soak-s", type=float, metavar="S",
                   help="the load test's measured window (default 600, --quick 60)")  # fmt: skip
    p.add_argument("--agents", type=int, default=200, metavar="N", help="synthetic agents (load)")
    p.add_argument("--tasks", type=int, default=20, metavar="N", help="synthetic tasks (load)")
    p.add_argument("--heartbeat-s", type=float, default=1.0, metavar="S",
                   help="synthetic agents' heartbeat period (load; default 1)")  # fmt: skip
    p.add_argument("--step-s", type=float, default=0.25, metavar="S",
                   help="synthetic tasks' step time (load; default 0.25)")  # fmt: skip
    p.add_argument("--exchange-s", type=float, metavar="S",
                   help="synthetic supervisors' idle exchange period, fixed (load; default: "
                   "the rhythm the coordinator asks for, as real supervisors)")  # fmt: skip
    p.add_argument("--procs", type=int, default=2, metavar="N",
                   help="load generator processes (load; default 2)")  # fmt: skip
    p.add_argument("--results", type=Path, default=RESULTS_DIR, metavar="DIR")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.reps is not None and args.reps < 1:
        print("python -m bench.cluster: --reps must be >= 1", file=sys.stderr)
        return 2
    from bench.cluster import kill, load, node

    try:
        settings = load.LoadSettings(
            agents=args.agents,
            tasks=args.tasks,
            heartbeat_s=args.heartbeat_s,
            step_s=args.step_s,
            procs=args.procs,
            **({} if args.exchange_s is None else {"exchange_s": args.exchange_s}),
            duration_s=args.soak_s or (60.0 if args.quick else 600.0),
        )
    except ValueError as exc:
        print(f"python -m bench.cluster: {exc}", file=sys.stderr)
        return 2
    host = machine()
    every: list[Row] = []
    for part in [p for p in PARTS if p in (args.part or PARTS)]:
        began = time.monotonic()
        print(f"{PARTS[part]}:", flush=True)
        if part == "kill":
            rows = kill.run(args.quick, reps=args.reps, steps=args.steps, down_s=args.down_s,
                            host=host)  # fmt: skip
        elif part == "load":
            rows = load.run(args.quick, settings=settings, host=host)
        else:
            rows = node.run(args.quick, reps=args.reps, host=host)
        print(f"{PARTS[part]}: {(time.monotonic() - began) / 60:.1f} min", flush=True)
        save_scenario(rows, PARTS[part], args.results)
        every += rows
    print_table(every, title="Unicron cluster benchmarks")
    print(f"wrote {write_summary(args.results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
