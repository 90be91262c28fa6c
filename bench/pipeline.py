"""A pipeline's steady step time and memory: Unicron's GPipe and 1F1B orders against its
one-at-a-time order and against PyTorch's own ``torch.distributed.pipelining``.

In one run, interleaved (every arm in turn, repetition after repetition):
``examples/train_llama_parallel.py`` under ``unicron run --pp P`` with ``--schedule gpipe``
(the default: every micro-batch's forward pass, then every backward pass), ``1f1b`` (a stage
fills the pipeline with a forward pass per later stage, then alternates one forward and one
backward pass) and ``sequential`` (each micro-batch through the stages and back before the
next: the stages take turns), ``1f1b`` again with each stage as PyTorch's own
``PipelineStage`` driven in Unicron's order (``--pp-api torch``:
``step_time_s[layout/1f1b+stage]``, and ``step_time_vs_hand``, its median over the
hand-written stages'), and the same model, micro-batches and optimizer in plain PyTorch
under torchrun (``bench/baselines/pp_torch.py``: ``PipelineStage`` with
``ScheduleGPipe`` / ``Schedule1F1B``, the replicas' gradients averaged in one all-reduce).
Layouts: PP=2 on 2 workers, PP=2 x DP=2 on 4, PP=4 on 4 (a block a stage); 16 micro-batches
of 4 a step. Figures per layout and schedule: rank 0's median ``duration_s`` of ``step_end``
after the warm-up steps (``step_time_s[layout/schedule]``), the run's largest process's peak
resident memory (``peak_rss_mb``: a stage's worker, holding its pending micro-batches'
activations), and Unicron's median over its one-at-a-time order's and over PyTorch's same
schedule's (``step_time_vs_sequential``, ``step_time_vs_torch``). Every Unicron order trains
to the same bits (``tests/test_model_parallel_e2e.py``); on few cores the stages' processes
share them, and the overlap gains what the turn-taking leaves idle.

Run only when named: ``python -m bench.pipeline [--quick]`` or
``python -m bench --scenario pipeline``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import Row, bench_parser, make_row, print_table, save_scenario, write_summary
from bench.events import read_events

SCENARIO = "pipeline"
ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"pp2": (2, 2, 2), "pp2dp2": (2, 4, 2), "pp4": (4, 4, 4)}  # (pp, workers, layers)
ARMS = ("unicron-gpipe", "unicron-1f1b", "unicron-sequential", "unicron-1f1b+stage",
        "torch-gpipe", "torch-1f1b")  # fmt: skip
STAGE = "+stage"
"""an arm's schedule ending so: the example's stages as torch's ``PipelineStage``, driven in
Unicron's order (``--pp-api torch``, :mod:`unicron.pipelining`)"""
PLAN = {True: (16, 4, 1), False: (30, 8, 3)}  # quick: (steps, warm-up steps, repetitions)
DIM, MICROBATCHES = 256, 16  # the model's width (hidden units: twice it); a step's
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
PEAK = (
    "import resource, subprocess, sys; rc = subprocess.run(sys.argv[2:]).returncode; "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
    "sys.exit(rc)"
)
"""runs a command and writes the peak resident memory (KiB) of the largest process of its
tree (each process reaps its own children, so the kernel carries the maxima up)"""


def command(arm: str, layout: str, steps: int, workdir: Path) -> list[str]:
    """The command line of one run of ``arm`` at ``layout``."""
    pp, workers, layers = LAYOUTS[layout]
    events = str(workdir / "events.jsonl")
    system, schedule = arm.split("-")
    model = ["--layers", str(layers), "--dim", str(DIM), "--hidden", str(2 * DIM)]
    if schedule.endswith(STAGE):
        schedule = schedule.removesuffix(STAGE)
        model += ["--pp-api", "torch"]
    if system == "torch":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(workers), "-m", "bench.baselines.pp_torch",
                "--pp", str(pp), *model, "--microbatches", str(MICROBATCHES),
                "--schedule", schedule, "--steps", str(steps), "--events", events]  # fmt: skip
    return [sys.executable, "-m", "unicron", "run", "--nproc-per-node", str(workers),
            "--pp", str(pp), "--quiet", "--events", events, "--log-dir", str(workdir / "logs"),
            str(ROOT / "examples" / "train_llama_parallel.py"), "--steps", str(steps),
            *model, "--microbatches", str(MICROBATCHES), "--schedule", schedule]  # fmt: skip


def measure(arm: str, layout: str, steps: int, warmup: int, workdir: Path) -> tuple[float, float]:
    """One fault-free run: rank 0's median step time after ``warmup`` steps, and the peak
    resident memory (MB) of the run's largest process."""
    workdir.mkdir(parents=True)
    peak = workdir / "peak-rss-kib"
    cmd = [sys.executable, "-c", PEAK, str(peak), *command(arm, layout, steps, workdir)]
    subprocess.run(cmd, check=True, cwd=ROOT, env=ENV, timeout=900, capture_output=True)
    ends = [e for e in read_events(workdir / "events.jsonl") if e["event"] == "step_end"]
    return median_after(ends, warmup), int(peak.read_text()) / 1024


def median_after(ends: list[dict[str, object]], warmup: int) -> float:
    """The median ``duration_s`` of rank 0's steps from ``warmup`` on (pure)."""
    kept = [float(str(e["duration_s"])) for e in ends
            if int(str(e["step"])) >= warmup and int(str(e.get("rank", 0))) == 0]  # fmt: skip
    if not kept:
        raise ValueError(f"no step_end of rank 0 at or after step {warmup}")
    return statistics.median(kept)


def run(quick: bool) -> list[Row]:
    """The rows of this scenario (``python -m bench --scenario pipeline``)."""
    steps, warmup, reps = PLAN[quick]
    load = os.getloadavg()[0]  # the figures' context: a shared machine's other work
    times: dict[tuple[str, str], list[float]] = {}
    peaks: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="unicron-bench-pipeline-") as tmp:
        for rep in range(reps):
            for layout in LAYOUTS:
                for arm in ARMS:
                    where = Path(tmp) / f"{rep}-{layout}-{arm}"
                    t, peak = measure(arm, layout, steps, warmup, where)
                    times.setdefault((arm, layout), []).append(t)
                    peaks.setdefault((arm, layout), []).append(peak)
    machine = f"load average {load:.1f} / {os.cpu_count()} CPUs at the start"
    rows: list[Row] = []
    for layout, (pp, workers, layers) in LAYOUTS.items():
        note = (
            f"examples/llama_parallel.py ({layers} layers, dim {DIM}), PP={pp} x "
            f"DP={workers // pp} on {workers} CPU workers, {MICROBATCHES} micro-batches of 4 "
            f"a step, {steps} steps, rank 0's median after step {warmup}; {machine}"
        )
        for arm in ARMS:
            system, schedule = arm.split("-")
            for metric, values in (("step_time_s", times), ("peak_rss_mb", peaks)):
                rows.append(make_row(system=system, scenario=SCENARIO,
                                     metric=f"{metric}[{layout}/{schedule}]",
                                     values=values[(arm, layout)], note=note))  # fmt: skip
        mid = {arm: statistics.median(times[(arm, layout)]) for arm in ARMS}
        rows.append(make_row(
            system="unicron", scenario=SCENARIO, metric=f"step_time_vs_hand[{layout}/1f1b]",
            values=[mid[f"unicron-1f1b{STAGE}"] / mid["unicron-1f1b"]], status="derived",
            note="Unicron's median step time in 1F1B order with torch's PipelineStage / with "
            "unicron.parallel's stages, same run",
        ))  # fmt: skip
        for schedule in ("gpipe", "1f1b"):
            ours = mid[f"unicron-{schedule}"]
            for metric, other, said in (
                ("step_time_vs_sequential", "unicron-sequential", "its one-at-a-time order's"),
                ("step_time_vs_torch", f"torch-{schedule}", "PyTorch's same schedule's"),
            ):
                rows.append(make_row(
                    system="unicron", scenario=SCENARIO,
                    metric=f"{metric}[{layout}/{schedule}]", values=[ours / mid[other]],
                    status="derived",
                    note=f"Unicron's median step time in {schedule} order / {said}, same run",
                ))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.pipeline", __doc__, quick="16 steps, one repetition")
    quick = p.parse_args(argv).quick
    rows = run(quick)
    print_table(rows, title="A pipeline: GPipe and 1F1B vs one at a time vs PyTorch's own")
    # a full run measured every row of the scenario: it replaces them all
    save_scenario(rows, SCENARIO, ROOT / "bench" / "results", replace=not quick)
    write_summary(ROOT / "bench" / "results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
