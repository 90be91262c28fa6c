"""A pipeline's steady step time: Unicron's GPipe order against its one-at-a-time order and
against PyTorch's own ``torch.distributed.pipelining`` (GPipe and 1F1B), at the same layouts.

In one run, interleaved (every arm in turn, repetition after repetition):
``examples/train_llama_parallel.py`` under ``unicron run --pp P`` with ``--schedule gpipe``
(every micro-batch's forward pass, then every backward pass: a stage computes the next
micro-batch while the next stage computes this one) and ``--schedule sequential`` (each
micro-batch through the stages and back before the next: the stages take turns), and the
same model, micro-batches and optimizer in plain PyTorch under torchrun
(``bench/baselines/pp_torch.py``: ``PipelineStage`` and ``ScheduleGPipe`` /
``Schedule1F1B``, the replicas' gradients averaged in one all-reduce). Layouts: PP=2 on 2
workers, PP=2 x DP=2 on 4, PP=4 on 4 (a block a stage). Figures: the median ``duration_s``
of rank 0's ``step_end`` after the warm-up steps (``step_time_s[layout]``;
``gpipe_vs_sequential[layout]`` and ``gpipe_vs_torch[layout]`` divide Unicron's GPipe median
by its sequential one's and by PyTorch's GPipe one's). The two Unicron orders train to the
same bits (``tests/test_model_parallel_e2e.py``); the figures say what the overlap buys on
this machine: on few cores the stages' processes share them, and the overlap only uses what
the turn-taking leaves idle.

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
ARMS = ("unicron-gpipe", "unicron-sequential", "torch-gpipe", "torch-1f1b")
PLAN = {True: (20, 5, 1), False: (40, 10, 3)}  # quick: (steps, warm-up steps, repetitions)
DIM = 256  # the model's width (hidden units: twice it)
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip


def command(arm: str, layout: str, steps: int, workdir: Path) -> list[str]:
    """The command line of one run of ``arm`` at ``layout``."""
    pp, workers, layers = LAYOUTS[layout]
    events = str(workdir / "events.jsonl")
    system, schedule = arm.split("-")
    model = ["--layers", str(layers), "--dim", str(DIM), "--hidden", str(2 * DIM)]
    if system == "torch":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(workers), "-m", "bench.baselines.pp_torch",
                "--pp", str(pp), *model, "--schedule", schedule, "--steps", str(steps),
                "--events", events]  # fmt: skip
    return [sys.executable, "-m", "unicron", "run", "--nproc-per-node", str(workers),
            "--pp", str(pp), "--quiet", "--events", events, "--log-dir", str(workdir / "logs"),
            str(ROOT / "examples" / "train_llama_parallel.py"), "--steps", str(steps),
            *model, "--schedule", schedule]  # fmt: skip


def step_time(arm: str, layout: str, steps: int, warmup: int, workdir: Path) -> float:
    """One fault-free run: rank 0's median step time after ``warmup`` steps."""
    workdir.mkdir(parents=True)
    cmd = command(arm, layout, steps, workdir)
    subprocess.run(cmd, check=True, cwd=ROOT, env=ENV, timeout=900, capture_output=True)
    ends = [e for e in read_events(workdir / "events.jsonl") if e["event"] == "step_end"]
    return median_after(ends, warmup)


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
    with tempfile.TemporaryDirectory(prefix="unicron-bench-pipeline-") as tmp:
        for rep in range(reps):
            for layout in LAYOUTS:
                for arm in ARMS:
                    where = Path(tmp) / f"{rep}-{layout}-{arm}"
                    times.setdefault((arm, layout), []).append(
                        step_time(arm, layout, steps, warmup, where)
                    )
    machine = f"load average {load:.1f} / {os.cpu_count()} CPUs at the start"
    rows: list[Row] = []
    for layout, (pp, workers, layers) in LAYOUTS.items():
        note = (
            f"examples/llama_parallel.py ({layers} layers, dim {DIM}), PP={pp} x "
            f"DP={workers // pp} on {workers} CPU workers, 8 micro-batches of 4 a step, "
            f"{steps} steps, rank 0's median after step {warmup}; {machine}"
        )
        for arm in ARMS:
            system, schedule = arm.split("-")
            rows.append(make_row(system=system, scenario=SCENARIO,
                                 metric=f"step_time_s[{layout}/{schedule}]",
                                 values=times[(arm, layout)], note=note))  # fmt: skip
        mid = {arm: statistics.median(times[(arm, layout)]) for arm in ARMS}
        for metric, other, said in (
            ("gpipe_vs_sequential", "unicron-sequential", "Unicron's one-at-a-time order's"),
            ("gpipe_vs_torch", "torch-gpipe", "PyTorch's ScheduleGPipe's"),
        ):
            rows.append(make_row(
                system="unicron", scenario=SCENARIO, metric=f"{metric}[{layout}]",
                values=[mid["unicron-gpipe"] / mid[other]], status="derived",
                note=f"Unicron's GPipe median step time / {said} at the layout, same run",
            ))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.pipeline", __doc__, quick="20 steps, one repetition")
    quick = p.parse_args(argv).quick
    rows = run(quick)
    print_table(rows, title="A pipeline's step time: GPipe vs one at a time vs PyTorch's own")
    # a full run measured every row of the scenario: it replaces them all
    save_scenario(rows, SCENARIO, ROOT / "bench" / "results", replace=not quick)
    write_summary(ROOT / "bench" / "results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
