"""Tensor-parallel replicas: Unicron against plain PyTorch under torchrun, TP=2 x DP=2.

In one run, interleaved: ``examples/train_llama_parallel.py`` under ``unicron run --tp 2`` and the
same model, micro-batches and seeds in plain PyTorch (``bench/baselines/tp_ckpt.py``: the
replica's sums over a torch process group, DDP across replicas, a shard checkpoint every
``K`` steps), 4 CPU workers each. Fault-free: the median ``duration_s`` of ``step_end``
after the warm-up steps (``step_time_vs_plain`` divides Unicron's by the baseline's). Then
rank 0 (place 0 of replica 0) SIGKILLed mid-step half-way (half a checkpoint interval after the
baseline's checkpoint): ``detection_s`` (Unicron: the
fault to its ``error_detected``), ``recovery_s`` (the fault to the first step at or after the
interrupted one that finishes: Unicron re-forms the replica and recomputes its micro-batches;
torchrun restarts every rank and redoes the steps since the checkpoint) and
``steps_redone``.

Run only when named: ``python -m bench.tp [--quick]`` or ``python -m bench --scenario tp``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import Row, bench_parser, make_row, print_table, save_scenario
from bench.events import read_events

SCENARIO = "tp"
ROOT = Path(__file__).resolve().parents[1]
NPROC, CKPT_EVERY = 4, 10
PLAN = {True: (30, 5, 1), False: (60, 10, 3)}  # quick: (steps, warm-up steps, repetitions)
ARMS = ("unicron --tp 2", "torchrun TP=2 x DP=2")
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip


def _command(arm: str, steps: int, workdir: Path, fault: str | None) -> list[str]:
    events = str(workdir / "events.jsonl")
    inject = ["--inject", fault] if fault else []
    if arm == ARMS[1]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(NPROC), "--max-restarts", "3",
                "-m", "bench.baselines.tp_ckpt", "--steps", str(steps),
                "--ckpt-every", str(CKPT_EVERY), "--ckpt-dir", str(workdir),
                "--events", events, *inject]  # fmt: skip
    return [sys.executable, "-m", "unicron", "run", "--nproc-per-node", str(NPROC), "--tp", "2",
            "--quiet", "--events", events, "--log-dir", str(workdir / "logs"), *inject,
            str(ROOT / "examples" / "train_llama_parallel.py"), "--steps", str(steps)]  # fmt: skip


def _events(arm: str, steps: int, workdir: Path, fault: str | None = None) -> list[dict[str, Any]]:
    workdir.mkdir(parents=True)
    cmd = _command(arm, steps, workdir, fault)
    subprocess.run(cmd, check=True, cwd=ROOT, env=ENV, timeout=900, capture_output=True)
    return [dict(e) for e in read_events(workdir / "events.jsonl")]


def step_time(arm: str, steps: int, warmup: int, workdir: Path) -> float:
    """One fault-free run of ``arm``: its median step time after ``warmup`` steps."""
    ends = [e for e in _events(arm, steps, workdir) if e["event"] == "step_end"]
    return statistics.median(float(e["duration_s"]) for e in ends if int(e["step"]) >= warmup)


def _fault_step(steps: int) -> int:
    """Half-way, and half a checkpoint interval past the baseline's last checkpoint (its
    expected loss: a failure falls anywhere between two checkpoints)."""
    return steps // 2 // CKPT_EVERY * CKPT_EVERY + CKPT_EVERY // 2


def crash(arm: str, steps: int, workdir: Path) -> tuple[float | None, float, int]:
    """``arm`` with rank 0 SIGKILLed mid-step half-way: (detection_s or None, recovery_s,
    steps redone)."""
    at = _fault_step(steps)
    evs = _events(arm, steps, workdir, f"crash:rank=0,step={at},mb=1")
    ts = float(next(e for e in evs if e["event"] == "fault_injected")["ts"])
    detected = next((float(e["ts"]) for e in evs if e["event"] == "error_detected"), None)
    ends = [e for e in evs if e["event"] == "step_end"]
    back = min(float(e["ts"]) for e in ends if int(e["step"]) >= at and float(e["ts"]) > ts)
    redone = sum(1 for e in ends if float(e["ts"]) > ts and int(e["step"]) < at)
    return (None if detected is None else detected - ts), back - ts, redone


def run(quick: bool) -> list[Row]:
    """The rows of this scenario (``python -m bench --scenario tp``)."""
    steps, warmup, reps = PLAN[quick]
    load = os.getloadavg()[0]  # the figures' context: a shared machine's other work
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    detect: list[float] = []
    recover: dict[str, list[float]] = {a: [] for a in ARMS}
    redone: dict[str, list[float]] = {a: [] for a in ARMS}
    with tempfile.TemporaryDirectory(prefix="unicron-bench-tp-") as tmp:
        for rep in range(reps):
            for i, arm in enumerate(ARMS):
                times[arm].append(step_time(arm, steps, warmup, Path(tmp) / f"{rep}-{i}"))
                d, r, n = crash(arm, steps, Path(tmp) / f"{rep}-{i}-crash")
                if d is not None:
                    detect.append(d)
                recover[arm].append(r)
                redone[arm].append(n)
    note = (
        f"examples/llama_parallel.py (2 layers, dim 128), TP=2 x DP=2 on {NPROC} CPU workers, "
        f"{steps} steps, median after step {warmup}; load average {load:.1f} / "
        f"{os.cpu_count()} CPUs at the start"
    )
    rows = [make_row(system=arm, scenario=SCENARIO, metric="step_time_s", values=times[arm],
                     note=note) for arm in ARMS]  # fmt: skip
    ratio = statistics.median(times[ARMS[0]]) / statistics.median(times[ARMS[1]])
    said = "median step time / plain PyTorch's at the layout, same run"
    rows.append(make_row(system=ARMS[0], scenario=SCENARIO, metric="step_time_vs_plain",
                         values=[ratio], status="derived", note=said))  # fmt: skip
    crash_note = f"rank 0 (place 0 of replica 0) SIGKILLed mid-step at step {_fault_step(steps)}"
    rows.append(make_row(system=ARMS[0], scenario=SCENARIO, metric="detection_s",
                         values=detect, note=crash_note))  # fmt: skip
    for arm in ARMS:
        how = (
            "; the replica re-formed, its micro-batches recomputed by the live one"
            if arm == ARMS[0]
            else f"; every rank restarted, shards reloaded (a checkpoint every {CKPT_EVERY})"
        )
        rows.append(make_row(system=arm, scenario=SCENARIO, metric="recovery_s",
                             values=recover[arm], note=crash_note + how))  # fmt: skip
        rows.append(make_row(system=arm, scenario=SCENARIO, metric="steps_redone",
                             values=redone[arm], note=crash_note))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.tp", __doc__, quick="fewer steps, one repetition")
    rows = run(p.parse_args(argv).quick)
    print_table(rows, title="Tensor-parallel replicas: Unicron vs torchrun, TP=2 x DP=2")
    save_scenario(rows, SCENARIO, ROOT / "bench" / "results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
