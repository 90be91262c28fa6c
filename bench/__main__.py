"""``python -m bench``: run the benchmark suite, print the table, write ``bench/results/``.

    python -m bench --quick                        # the few-minute version
    python -m bench                                # the full suite (under an hour here)
    python -m bench --scenario crash --system unicron --system torchrun --reps 3

An unknown scenario or system lists the known ones and exits 2. Each scenario's rows are
saved as soon as it ends: into ``bench/results/<scenario>.json``, in place of the old rows
after a run of the whole full suite, else merged with them. A run of the whole suite (no
``--scenario``, ``--system`` or ``--reps``) also records its duration in
``bench/results/runs.json``.
``bench/results/SUMMARY.md`` is regenerated at the end. The simulator's measured constants
(``unicron/sim/data/measured.json``, :mod:`bench.measured`) are derived again when the results
go to ``bench/results``: as soon as a scenario they come from is saved (so the ``simulator``
scenario of the same run simulates with them), and at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench import measured
from bench.common import (
    RESULTS_DIR,
    Row,
    now_iso,
    print_table,
    record_run,
    save_scenario,
    write_summary,
)
from bench.suite import ALONE, SYSTEMS, known_scenarios, run_suite
from bench.systems.base import Settings


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    p.add_argument(
        "--scenario",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this scenario (repeatable; default: all)",
    )
    p.add_argument(
        "--system",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this system (repeatable; default: all)",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        metavar="N",
        help="repetitions per arm (default: 2 quick, 3 full)",
    )
    p.add_argument(
        "--results",
        type=Path,
        default=RESULTS_DIR,
        metavar="DIR",
        help="where the JSON files and SUMMARY.md go",
    )
    p.add_argument("--list", action="store_true", help="list scenarios and systems, then exit")
    return p


def _unknown(kind: str, names: Sequence[str], known: Sequence[str]) -> str | None:
    bad = [n for n in names if n not in known]
    if bad:
        return f"unknown {kind} {', '.join(map(repr, bad))} (known: {', '.join(known)})"
    return None


def _progress(label: str, rep: int, result: dict[str, float] | str) -> None:
    if isinstance(result, str):
        print(f"  rep {rep + 1} {label}: FAILED {result}", flush=True)
        return
    shown = ", ".join(f"{k}={v:.3g}" for k, v in result.items() if k != "steps_finished")
    print(f"  rep {rep + 1} {label}: {shown}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite; 0 when it ran (even with failed systems), 2 on bad usage."""
    args = build_parser().parse_args(argv)
    scenarios = known_scenarios()
    if args.list:
        print("scenarios:", " ".join(scenarios))
        print("systems:", " ".join(SYSTEMS))
        return 0
    for kind, names, known in (
        ("scenario", args.scenario, scenarios),
        ("system", args.system, SYSTEMS),
    ):
        reason = _unknown(kind, names, known)
        if reason:
            print(f"python -m bench: {reason}", file=sys.stderr)
            return 2
    if args.reps is not None and args.reps < 1:
        print("python -m bench: --reps must be >= 1", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = Settings.make(args.quick, args.reps)
    mode = "quick" if args.quick else "full"
    whole = not (args.scenario or args.system or args.reps)
    # only a whole full run stands for every row; anything less merges, keeping the rows it
    # does not make (the full suite's extra arms and kinds, with their dates)
    replace = whole and not args.quick
    durations: dict[str, float] = {}

    def save(name: str, rows: list[Row], seconds: float) -> None:
        durations[name] = seconds
        print(f"scenario {name}: {seconds / 60:.1f} min", flush=True)
        try:
            save_scenario(rows, name, args.results, replace=replace)
        except ValueError as exc:  # a module's bad rows must not lose the others' results
            print(f"python -m bench: {name}: not saved: {exc}", file=sys.stderr)
        if name in measured.SOURCES:
            _constants(args.results)

    started, began = now_iso(), time.monotonic()
    try:
        results = run_suite(
            args.scenario or [s for s in scenarios if s not in ALONE],
            args.system or list(SYSTEMS),
            settings,
            args.results,
            on_trial=_progress,
            on_scenario=save,
        )
        total = time.monotonic() - began
        everything = [row for rows in results.values() for row in rows]
        print_table(everything, title=f"Unicron benchmarks ({mode}, {total / 60:.1f} min)")
        if whole:
            record_run(
                args.results,
                mode,
                started=started,
                total_s=total,
                scenarios_s=durations,
                settings=dataclasses.asdict(settings),
            )
    finally:  # the summary follows the saved files, also after an interruption
        print(f"wrote {write_summary(args.results)}")
        _constants(args.results)
    return 0


def _constants(results: Path) -> None:
    """Derive the simulator's constants again from ``results`` if they are the repository's
    (:func:`bench.measured.refresh`: only where the source rows changed)."""
    if results != RESULTS_DIR:
        return
    try:
        if measured.refresh():
            print(f"wrote {measured.DATA}", flush=True)
    except Exception as exc:  # a derived file: never a reason to stop the suite's scenarios
        print(f"python -m bench: simulator constants not written: {exc!r}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
