"""Steady-state step time at two model sizes: Unicron (exact, fast) against a plain DDP loop.

In one run, for each size, the arms take turns (exact, fast, DDP; then fast, DDP, exact; ...:
each repetition starts one arm further on, so no arm always runs first or last): the example
GPT (0.47M parameters, 4 workers) and a 99.7M-parameter configuration of the same GPT
(``--model-size 100m``, 2 workers: one per core of the 2-core machine these figures come
from, since 4 workers of it oversubscribe the cores and mostly measure the scheduler). Every
worker of every arm runs one compute thread; no fault; the same micro-batches; no arm writes
checkpoints (the DDP loop runs with ``--ckpt-every 0``, Unicron with ``--checkpoint-every 0``:
at 100M the automatic interval's first checkpoint, 1.2 GB written in the background, fell on
the measured steps of Unicron's arms only; a checkpoint's cost is the ``checkpoint``
scenario's).

Two figures per trial, both over the steps after the warm-up (the first steps allocate
buffers and optimizer state; Unicron's first commit also times one copy of the state for its
automatic checkpoint interval):

- ``step_time_s``: the median ``duration_s`` of the ``step_end`` events (Unicron: from the
  step's start on the worker to its commit; DDP: rank 0's ``zero_grad`` to ``optimizer.step``);
- ``step_period_s``: the median time between consecutive ``step_end`` events, which also counts
  what happens between two steps (Unicron's epoch check at the boundary, its events).

Rows give the median over the repetitions; ``step_time_vs_ddp`` and ``step_period_vs_ddp``
divide each Unicron arm's by the DDP loop's; ``..._vs_ddp_paired`` divide them repetition by
repetition (:func:`paired`; median, min and max of those ratios). Metric names carry the size:
``step_time_s[100m]``. Each note carries the machine's load averages (1 min) before and after
the size's trials: the figures move with a shared machine's load.

Run alone (``python -m bench.scale [--quick] [--size=NAME]... [--reps=N]``) or as the suite's
``scale`` scenario (``--quick``: the example model only). Method: docs/benchmarks.md.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.common import (
    Row,
    bench_parser,
    kind_metric,
    make_row,
    positive_int,
    print_table,
    save_scenario,
)
from bench.events import Event, read_events

SCENARIO = "scale"
ROOT = Path(__file__).resolve().parents[1]
ARMS = ("unicron exact", "unicron fast", "plain DDP")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How one size is measured."""

    nproc: int
    steps: int
    warmup: int
    """steps left out at the start"""
    reps: int
    arms: tuple[str, ...] = ARMS


PLAN = {  # size: (quick, full)
    "example": (
        Plan(nproc=4, steps=24, warmup=3, reps=2),
        # 5 repetitions: one 80 ms step's period moves by a few percent between trials on
        # the shared 2-core machine, as much as the 5 % the goal allows
        Plan(nproc=4, steps=60, warmup=5, reps=5),
    ),
    # a 100M step takes 5-10 s here: the fast arm (not the goal's) is left out of the full
    # run; 5 repetitions, the protocol of issue 38's goal at 100M (exact / DDP <= 1.05x paired
    # over at least 5), so that the full run (python -m bench.refresh runs it) checks it
    "100m": (
        Plan(nproc=2, steps=4, warmup=2, reps=1),
        Plan(nproc=2, steps=8, warmup=2, reps=5, arms=("unicron exact", "plain DDP")),
    ),
}


def turns(arms: tuple[str, ...], rep: int) -> list[str]:
    """The order of the arms in repetition ``rep``: each one starts one arm further on."""
    return [arms[(rep + k) % len(arms)] for k in range(len(arms))]


def _command(arm: str, size: str, plan: Plan, workdir: Path) -> list[str]:
    events, n, steps = str(workdir / "events.jsonl"), str(plan.nproc), str(plan.steps)
    if arm == "plain DDP":
        return [sys.executable, "-m", "bench.baselines.ddp_loop", "--nproc", n,
                "--steps", steps, "--workdir", str(workdir), "--events", events,
                "--model-size", size]  # fmt: skip
    return [sys.executable, "-m", "unicron", "run", "--nproc-per-node", n, "--quiet",
            "--reduce", arm.split()[1], "--checkpoint-every", "0",
            "--events", events, "--log-dir", str(workdir / "logs"),
            str(ROOT / "examples" / "train_gpt.py"), "--steps", steps,
            "--model-size", size]  # fmt: skip


def figures(events: list[Event], warmup: int) -> tuple[float, float]:
    """(median step duration, median time between consecutive commits) of the steps from
    ``warmup`` on, from a run's ``step_end`` events (the first report of each step)."""
    ends: dict[int, tuple[float, float]] = {}
    for e in events:
        if e["event"] == "step_end":
            ends.setdefault(int(e["step"]), (float(e["ts"]), float(e["duration_s"])))
    steps = [s for s in sorted(ends) if s >= warmup]
    if not steps or any(s - 1 not in ends for s in steps):
        raise ValueError(f"step_end events missing: have steps {sorted(ends)}")
    durations = [ends[s][1] for s in steps]
    periods = [ends[s][0] - ends[s - 1][0] for s in steps]
    return statistics.median(durations), statistics.median(periods)


def trial(arm: str, size: str, plan: Plan, workdir: Path) -> tuple[float, float]:
    """One run of ``arm``: :func:`figures` after the plan's warm-up."""
    workdir.mkdir(parents=True)
    cmd = _command(arm, size, plan, workdir)
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=1800, capture_output=True)
    return figures(read_events(workdir / "events.jsonl"), plan.warmup)


def run(quick: bool, sizes: tuple[str, ...] | None = None, reps: int | None = None) -> list[Row]:
    """The rows of this scenario (called by ``python -m bench``): ``sizes`` (default: the
    example model when ``quick``, every size otherwise); ``reps`` overrides the plan's."""
    sizes = sizes or (("example",) if quick else tuple(PLAN))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="unicron-bench-scale-") as tmp:
        for size in sizes:
            plan = PLAN[size][0 if quick else 1]
            n_reps = reps or plan.reps
            arms = plan.arms
            times: dict[str, list[float]] = {a: [] for a in arms}
            periods: dict[str, list[float]] = {a: [] for a in arms}
            load0 = os.getloadavg()[0]
            for rep in range(n_reps):
                for arm in turns(arms, rep):
                    workdir = Path(tmp) / f"{size}-{rep}-{arm.replace(' ', '_')}"
                    t, p = trial(arm, size, plan, workdir)
                    times[arm].append(t)
                    periods[arm].append(p)
            note = (
                f"{plan.nproc} workers x 1 thread, {plan.steps} steps, median after step "
                f"{plan.warmup - 1}; load average {load0:.1f} before, "
                f"{os.getloadavg()[0]:.1f} after (2-core machine, shared)"
            )
            for arm in arms:
                for metric, values in (("step_time_s", times), ("step_period_s", periods)):
                    rows.append(make_row(system=arm, scenario=SCENARIO, note=note, unit="s",
                                         metric=kind_metric(metric, size),
                                         values=values[arm]))  # fmt: skip
            for metric, values in (("step_time", times), ("step_period", periods)):
                ddp = values["plain DDP"]
                for arm in arms:
                    if arm == "plain DDP":
                        continue
                    ratios = (
                        ("", [statistics.median(values[arm]) / statistics.median(ddp)],
                         "median / plain DDP's median, same run"),
                        ("_paired", paired(values[arm], ddp),
                         "each repetition's / plain DDP's in the same repetition"),
                    )  # fmt: skip
                    for suffix, ratio, how in ratios:
                        rows.append(
                            make_row(
                                system=arm,
                                scenario=SCENARIO,
                                status="derived",
                                metric=kind_metric(f"{metric}_vs_ddp{suffix}", size),
                                values=ratio,
                                unit="x",
                                note=f"{how}; {note}",
                            )
                        )
    return rows


def paired(arm: list[float], ddp: list[float]) -> list[float]:
    """Repetition by repetition, ``arm``'s figure over DDP's: the arms of one repetition run
    back to back, so a drift of the shared machine's pace between repetitions (as large as
    the differences measured) cancels in each ratio, which a ratio of medians keeps."""
    return [a / d for a, d in zip(arm, ddp, strict=True)]


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.scale", __doc__, quick="fewer steps and repetitions")
    p.add_argument(
        "--size",
        action="append",
        choices=list(PLAN),
        help="only this model size (repeatable; default: every size of the mode)",
    )
    p.add_argument(
        "--reps", type=positive_int, default=None, help="repetitions per arm (default: the mode's)"
    )
    args = p.parse_args(argv)
    sizes = tuple(args.size) if args.size else None
    rows = run(args.quick, sizes, args.reps)
    print_table(rows, title="steady-state step time by model size")
    save_scenario(rows, SCENARIO, ROOT / "bench" / "results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
