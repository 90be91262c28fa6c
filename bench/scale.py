"""Steady-state step time at two model sizes: Unicron (exact, fast) against a plain DDP loop.

In one run, interleaved (exact, fast, DDP, exact, fast, DDP, ...): the example GPT (1.4M
parameters) and a 99.7M-parameter configuration of the same GPT (``--model-size 100m``), 4
workers each, no fault. The figure of one trial is the median ``duration_s`` of its
``step_end`` events after the first steps (warm-up); rows report the median over the
repetitions, and ``step_time_vs_ddp`` divides each Unicron arm's by the DDP loop's. Metric
names carry the size: ``step_time_s[100m]``.

The 100M runs are a few steps only (a step takes tens of seconds on a shared 2-core machine),
so their figures are rough.

Run alone (``python -m bench.scale [--quick] [--size=NAME]...``) or as the suite's ``scale``
scenario (``--quick``: the example model only).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import Row, kind_metric, make_row, print_table, save_scenario
from bench.events import read_events

SCENARIO = "scale"
ROOT = Path(__file__).resolve().parents[1]
NPROC = 4
PLAN = {  # size: (steps, warm-up steps left out, repetitions), quick / full
    "example": ((24, 3, 2), (60, 5, 3)),
    "100m": ((4, 1, 1), (5, 1, 2)),
}
ARMS = ("unicron exact", "unicron fast", "plain DDP")


def _command(arm: str, size: str, steps: int, workdir: Path) -> list[str]:
    events = str(workdir / "events.jsonl")
    if arm == "plain DDP":
        return [sys.executable, "-m", "bench.baselines.ddp_loop", "--nproc", str(NPROC),
                "--steps", str(steps), "--workdir", str(workdir), "--events", events,
                "--model-size", size]  # fmt: skip
    return [sys.executable, "-m", "unicron", "run", "--nproc-per-node", str(NPROC), "--quiet",
            "--reduce", arm.split()[1], "--events", events, "--log-dir", str(workdir / "logs"),
            str(ROOT / "examples" / "train_gpt.py"), "--steps", str(steps),
            "--model-size", size]  # fmt: skip


def trial(arm: str, size: str, steps: int, warmup: int, workdir: Path) -> float:
    """One run of ``arm``: its median step time after ``warmup`` steps."""
    workdir.mkdir(parents=True)
    cmd = _command(arm, size, steps, workdir)
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=1800, capture_output=True)
    ends = [e for e in read_events(workdir / "events.jsonl") if e["event"] == "step_end"]
    durations = [float(e["duration_s"]) for e in ends if int(e["step"]) >= warmup]
    return statistics.median(durations)


def run(quick: bool, sizes: tuple[str, ...] | None = None) -> list[Row]:
    """The rows of this scenario (called by ``python -m bench``): ``sizes`` (default: the
    example model when ``quick``, every size otherwise)."""
    sizes = sizes or (("example",) if quick else tuple(PLAN))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="unicron-bench-scale-") as tmp:
        for size in sizes:
            steps, warmup, reps = PLAN[size][0 if quick else 1]
            times: dict[str, list[float]] = {a: [] for a in ARMS}
            for rep in range(reps):
                for arm in ARMS:
                    workdir = Path(tmp) / f"{size}-{rep}-{arm.replace(' ', '_')}"
                    times[arm].append(trial(arm, size, steps, warmup, workdir))
            note = f"{NPROC} workers, {steps} steps, median after step {warmup}"
            for arm in ARMS:
                rows.append(make_row(system=arm, scenario=SCENARIO, note=note,
                                     metric=kind_metric("step_time_s", size),
                                     values=times[arm]))  # fmt: skip
            ddp = statistics.median(times["plain DDP"])
            for arm in ARMS[:2]:
                rows.append(make_row(system=arm, scenario=SCENARIO, status="derived",
                                     metric=kind_metric("step_time_vs_ddp", size),
                                     values=[statistics.median(times[arm]) / ddp],
                                     note="median step time / plain DDP's, same run"))  # fmt: skip
    return rows


def main() -> int:
    args = sys.argv[1:]
    sizes = tuple(a.split("=", 1)[1] for a in args if a.startswith("--size=")) or None
    unknown = [s for s in sizes or () if s not in PLAN]
    if unknown:
        print(f"unknown size {unknown[0]!r}: choose from {', '.join(PLAN)}", file=sys.stderr)
        return 2
    rows = run("--quick" in args, sizes)
    print_table(rows, title="steady-state step time by model size")
    save_scenario(rows, SCENARIO, ROOT / "bench" / "results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
