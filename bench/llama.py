"""The Hugging Face Llama example with its own loop: Unicron's step API against plain DDP.

In one run, interleaved (Unicron, DDP, Unicron, DDP, ...): ``examples/train_llama.py`` under
``unicron run`` (the step API, exact reduce) and the same loop under plain DDP started by
torchrun (``bench/baselines/llama_ddp.py``: the same model, micro-batches and seeds), 4
workers each, no fault. The figure of one trial is the median ``duration_s`` of its
``step_end`` events after the warm-up steps; ``step_time_vs_ddp`` divides Unicron's by DDP's.
Then Unicron with worker 1 SIGKILLed mid-step half-way: ``detection_s`` (the fault to its
``error_detected``) and ``recovery_s`` (the fault to the first commit of the interrupted step
or a later one). Plain DDP has no recovery of its own (torchrun restarts every worker from a
checkpoint: the suite's ``crash`` scenario measures that on the example GPT).

Run only when named: ``python -m bench.llama [--quick]`` or ``python -m bench --scenario
llama``.
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

SCENARIO = "llama"
ROOT = Path(__file__).resolve().parents[1]
NPROC = 4
PLAN = {True: (30, 5, 2), False: (80, 10, 3)}  # quick: (steps, warm-up steps, repetitions)
ARMS = ("unicron step API", "DDP (torchrun)")
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
       "UNICRON_PRELOAD": "transformers"}  # fmt: skip


def _command(arm: str, steps: int, workdir: Path, *extra: str) -> list[str]:
    events = str(workdir / "events.jsonl")
    if arm == "DDP (torchrun)":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(NPROC), "-m", "bench.baselines.llama_ddp",
                "--steps", str(steps), "--events", events]  # fmt: skip
    return [sys.executable, "-m", "unicron", "run", "--nproc-per-node", str(NPROC), "--quiet",
            "--events", events, "--log-dir", str(workdir / "logs"), *extra,
            str(ROOT / "examples" / "train_llama.py"), "--steps", str(steps)]  # fmt: skip


def _events(arm: str, steps: int, workdir: Path, *extra: str) -> list[dict[str, Any]]:
    workdir.mkdir(parents=True)
    cmd = _command(arm, steps, workdir, *extra)
    subprocess.run(cmd, check=True, cwd=ROOT, env=ENV, timeout=900, capture_output=True)
    return [dict(e) for e in read_events(workdir / "events.jsonl")]


def step_time(arm: str, steps: int, warmup: int, workdir: Path) -> float:
    """One fault-free run of ``arm``: its median step time after ``warmup`` steps."""
    ends = [e for e in _events(arm, steps, workdir) if e["event"] == "step_end"]
    return statistics.median(float(e["duration_s"]) for e in ends if int(e["step"]) >= warmup)


def crash(steps: int, workdir: Path) -> tuple[float, float]:
    """Unicron with worker 1 SIGKILLed half-way: (detection_s, recovery_s)."""
    at = steps // 2
    evs = _events(ARMS[0], steps, workdir, "--inject", f"crash:rank=1,step={at}")
    fault = next(e for e in evs if e["event"] == "fault_injected")
    ts = float(fault["ts"])
    detected = next(float(e["ts"]) for e in evs if e["event"] == "error_detected")
    ends = [e for e in evs if e["event"] == "step_end" and int(e["step"]) >= at]
    back = min(float(e["ts"]) for e in ends if float(e["ts"]) > ts)
    return detected - ts, back - ts


def run(quick: bool) -> list[Row]:
    """The rows of this scenario (``python -m bench --scenario llama``)."""
    steps, warmup, reps = PLAN[quick]
    load = os.getloadavg()[0]  # the figures' context: a shared machine's other work
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    detect: list[float] = []
    recover: list[float] = []
    with tempfile.TemporaryDirectory(prefix="unicron-bench-llama-") as tmp:
        for rep in range(reps):
            for i, arm in enumerate(ARMS):
                times[arm].append(step_time(arm, steps, warmup, Path(tmp) / f"{rep}-{i}"))
            d, r = crash(steps, Path(tmp) / f"{rep}-crash")
            detect.append(d)
            recover.append(r)
    note = (
        f"HF Llama 2x64, {NPROC} workers, {steps} steps, median after step {warmup}; "
        f"load average {load:.1f} / {os.cpu_count()} CPUs at the start"
    )
    rows = [make_row(system=arm, scenario=SCENARIO, metric="step_time_s", values=times[arm],
                     note=note) for arm in ARMS]  # fmt: skip
    ratio = statistics.median(times[ARMS[0]]) / statistics.median(times[ARMS[1]])
    rows.append(make_row(system=ARMS[0], scenario=SCENARIO, metric="step_time_vs_ddp",
                         values=[ratio], status="derived",
                         note="median step time / plain DDP's, same run"))  # fmt: skip
    crash_note = f"worker 1 SIGKILLed mid-step at step {steps // 2}"
    rows.append(make_row(system=ARMS[0], scenario=SCENARIO, metric="detection_s",
                         values=detect, note=crash_note))  # fmt: skip
    rows.append(make_row(system=ARMS[0], scenario=SCENARIO, metric="recovery_s",
                         values=recover, note=crash_note + "; to the next commit"))  # fmt: skip
    rows.append(make_row(system=ARMS[1], scenario=SCENARIO, metric="recovery_s",
                         status="skipped", note="plain DDP does not recover; torchrun restarts "
                         "all workers from a checkpoint (scenario crash)"))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.llama", __doc__, quick="fewer steps and repetitions")
    rows = run(p.parse_args(argv).quick)
    print_table(rows, title="Hugging Face Llama, own loop: Unicron step API vs plain DDP")
    save_scenario(rows, SCENARIO, ROOT / "bench" / "results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
