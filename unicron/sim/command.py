"""``unicron simulate``: replay a failure trace under several recovery policies.

Wired in :mod:`unicron.cli`, which calls :func:`add_arguments` then :func:`main`. Bad input
raises :class:`~unicron.errors.UsageError` (one line, exit 2). Imports stay light at module
level: the engine, the planner and matplotlib load only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from unicron.errors import UsageError

if TYPE_CHECKING:  # imported when the command runs (see above)
    from rich.progress import TaskID

    from unicron.sim.engine import Prepared, Workload
    from unicron.sim.metrics import PolicyResult
    from unicron.sim.trace import TraceEvent

POLICY_NAMES = (
    "unicron",
    "unicron-all",
    "megatron",
    "megatron-30m",
    "megatron-wait",
    "oobleck",
    "varuna",
    "bamboo",
    "torchft",
)
DEFAULT_POLICIES = "unicron,unicron-all,megatron,oobleck,varuna,bamboo,torchft"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="CSV", help="trace file: milliseconds,add|remove,node")
    src.add_argument(
        "--rate",
        type=float,
        metavar="R",
        help="generate a trace: failures per node per day (Llama 3 cause mix)",
    )
    parser.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=f"comma-separated, from: {', '.join(POLICY_NAMES)} (default: {DEFAULT_POLICIES})",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument(
        "--workload", metavar="YAML", help="cluster and tasks (default: the paper-style workload)"
    )
    parser.add_argument("--nodes", type=int, help="override the number of nodes")
    parser.add_argument(
        "--days",
        type=float,
        help="simulated days (default: up to the trace's last event with --trace, 7 with --rate)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of a generated trace")
    parser.add_argument(
        "--initial",
        choices=("planner", "proportional"),
        default="planner",
        help="baselines' initial allocation: the planner's plan or weight-proportional shares",
    )
    parser.add_argument("--progress", action="store_true", help="progress bar even without a TTY")


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise UsageError(f"--policies: empty (known: {', '.join(POLICY_NAMES)})")
    for n in names:
        if n not in POLICY_NAMES:
            raise UsageError(f"unknown policy {n!r} (known: {', '.join(POLICY_NAMES)})")
    return list(dict.fromkeys(names))


def _workload(args: argparse.Namespace) -> Workload:
    from dataclasses import replace

    from unicron.sim import engine

    if args.workload:
        import yaml

        path = Path(args.workload)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise UsageError(f"{path}: cannot read workload: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise UsageError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from exc
        try:
            wl = engine.workload_from_mapping(data, str(path))
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    else:
        wl = engine.paper_workload()
    if args.nodes is not None:
        if args.nodes < 1:
            raise UsageError(f"--nodes: must be >= 1, got {args.nodes}")
        wl = replace(wl, nodes=args.nodes)
    return wl


def main(args: argparse.Namespace) -> int:
    """Run each policy over the same trace and write the report into ``--out``."""
    from unicron.sim import engine, measured, report, trace

    m = measured.load()  # a broken install fails before the work, not after it
    names = _policies(args.policies)
    wl = _workload(args)
    if args.days is not None and not args.days > 0:
        raise UsageError(f"--days: must be > 0, got {args.days}")
    if args.trace:
        events = trace.load_csv(args.trace)
        end = max(e.time_s for e in events)
        duration = args.days * 86400 if args.days else end
        if not duration > 0:
            raise UsageError(f"{args.trace}: all events at time 0; give --days")
        label = str(args.trace)
    else:
        if not (args.rate >= 0 and args.rate < float("inf")):
            raise UsageError(f"--rate: must be a finite number >= 0, got {args.rate}")
        duration = (args.days or 7.0) * 86400
        events = trace.generate(
            nodes=wl.nodes, duration_s=duration, rate_per_node_day=args.rate, seed=args.seed
        )
        label = f"generated: {args.rate}/node/day, Llama 3 cause mix, seed {args.seed}"
    prepared = engine.prepare(wl)
    results = _run_all(prepared, events, names, duration, args)
    meta = {
        "trace": label,
        "unicron_constants": {
            "source": m.source,
            "exception_detect_s": m.exception_detect_s,
            "exit_detect_s": m.exit_detect_s,
            "node_detect_s": m.node_detect_s,
            "hang_floor_s": m.hang_floor_s,
            "assumptions": {
                k: {"value": v, "source": src} for k, (v, src) in measured.ASSUMPTIONS.items()
            },
        },
        "trace_events": len(events),
        "nodes": wl.nodes,
        "gpus_per_node": wl.gpus_per_node,
        "gpu": wl.gpu,
        "duration_s": duration,
        "initial": args.initial,
        "reference_nodes": prepared.reference,
        "tasks": [
            {
                "name": t.name,
                "model": t.model,
                "global_batch": t.global_batch,
                "weight": t.weight,
                "min_nodes": t.min_nodes,
                "max_nodes": t.max_nodes,
            }
            for t in wl.tasks
        ],
    }
    out = Path(args.out)
    try:
        paths = report.write(results, meta, out)
    except OSError as exc:
        raise UsageError(f"{out}: cannot write results: {exc.strerror}") from exc
    print(report.markdown(results, meta))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _run_all(
    prepared: Prepared,
    events: Sequence[TraceEvent],
    names: list[str],
    duration: float,
    args: argparse.Namespace,
) -> list[PolicyResult]:
    from unicron.sim import engine
    from unicron.sim.policies import make_policy

    show = args.progress or sys.stderr.isatty()
    if not show:
        return [
            engine.simulate(
                prepared, events, make_policy(n, initial=args.initial), duration_s=duration
            )
            for n in names
        ]
    from rich.progress import Progress

    results = []
    with Progress(transient=False) as bar:
        for n in names:
            job = bar.add_task(f"{n:>12}", total=duration)

            def tick(now: float, job: TaskID = job) -> None:
                bar.update(job, completed=now)

            results.append(
                engine.simulate(
                    prepared,
                    events,
                    make_policy(n, initial=args.initial),
                    duration_s=duration,
                    progress=tick,
                )
            )
    return results
