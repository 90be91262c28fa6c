"""A layout change: a TP=2 x PP=2 x DP=2 task losing a slot for a while, with and without
``--pp-choices 1`` (and ``--tp-choices 1``).

In one run, per model width: ``examples/train_llama_parallel.py`` under ``unicron run
--nproc-per-node 8 --tp 2 --pp 2``, three ways: fault-free (``clean``); slot 5 excluded by an
ECC error at step ``E`` and readmitted by its health probe a few seconds later, the layout
kept (``fixed``: its replica waits, 4 workers train at TP=2 x PP=2 x DP=1); the same with
``--pp-choices 1`` (``relayout``: 6 workers train at TP=2 x PP=1 x DP=3, the state moved by
name in memory, and back to PP=2 on 8 when the slot returns); the same with ``--tp-choices 1``
too (``retp``: 7 workers train at TP=1 x PP=1 x DP=7, each split entry's two slices joined in
memory, and cut again back at TP=2 x PP=2: another degree sums in another order, so the
bits may differ and the loss difference says by how much). Metrics, each ``[arm/dimD]``:
``transition_s[...->...]`` (the ``transition_end`` of the shrinking and of the growing
epoch: rendezvous, groups, ledger exchange, state moved or streamed), ``step_time_s[short]``
(median step while the slot is out), ``loss_diff_max`` (the largest difference of a step's
loss from the clean run's; 0: the same bits), ``loss_diff_last`` (the last step's), and
``same_bits`` (1 when the final parameters are the clean run's, entry by entry: a run that
ended at another pipeline depth holds them in other files). On this machine's 2 cores
the six (seven) workers of the new layout share the cores the four of the old one had: the
step time says what the change costs here, not what a GPU per worker would gain.

Run only when named: ``python -m bench.relayout [--quick]`` or ``python -m bench --scenario
relayout``.
"""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.chaos import same_state
from bench.common import (
    Row,
    bench_parser,
    make_row,
    print_table,
    save_scenario,
    write_summary,
)
from bench.events import read_events
from bench.tp import state_mb

SCENARIO = "relayout"
ROOT = Path(__file__).resolve().parents[1]
DIMS = {True: (128,), False: (128, 256, 384)}  # model width (hidden units: twice it)
PLAN = {True: (60, 1), False: (80, 2)}  # quick: (steps, repetitions)
FAULT_STEP, READMIT_S = 10, 2.0
ARMS = {
    "clean": [],
    "fixed": [],
    "relayout": ["--pp-choices", "1"],
    "retp": ["--pp-choices", "1", "--tp-choices", "1"],
}
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _events(arm: str, dim: int, steps: int, workdir: Path) -> list[dict[str, Any]]:
    workdir.mkdir(parents=True)
    fault = [] if arm == "clean" else [
        "--inject", f"error:rank=5,step={FAULT_STEP},kind=ecc", "--readmit-after", str(READMIT_S),
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "unicron", "run", "--nproc-per-node", "8", "--tp", "2",
           "--pp", "2", *ARMS[arm], *fault, "--checkpoint-every", "0", "--quiet",
           "--events", str(workdir / "events.jsonl"), "--log-dir", str(workdir / "logs"),
           str(ROOT / "examples" / "train_llama_parallel.py"), "--steps", str(steps),
           "--dim", str(dim), "--hidden", str(2 * dim),
           "--out", str(workdir / "out")]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, env=ENV, timeout=900, capture_output=True)
    return [dict(e) for e in read_events(workdir / "events.jsonl")]


def measure(evs: list[dict[str, Any]], clean: list[dict[str, Any]]) -> dict[str, float]:
    """One faulted run's figures against the clean run's events. Pure."""
    out: dict[str, float] = {}
    began = [e for e in evs if e["event"] == "epoch_begin"]
    sizes = {int(e["epoch"]): len(e["members"]) for e in began}
    ends = {(int(e["epoch"])): float(e["duration_s"]) for e in evs
            if e["event"] == "transition_end"}  # fmt: skip
    for a, b in itertools.pairwise(began):
        x, y = sizes[int(a["epoch"])], sizes[int(b["epoch"])]
        if x != y and int(b["epoch"]) in ends:
            out.setdefault(f"{x}->{y}", ends[int(b["epoch"])])
    short = [int(e["epoch"]) for e in began if len(e["members"]) < 8 and int(e["epoch"]) > 1]
    steps = [float(e["duration_s"]) for e in evs
             if e["event"] == "step_end" and int(e["epoch"]) in short]  # fmt: skip
    if steps:
        out["short"] = statistics.median(steps)
    loss = {int(e["step"]): float(e["loss"]) for e in clean if e["event"] == "step_end"}
    mine = {int(e["step"]): float(e["loss"]) for e in evs if e["event"] == "step_end"}
    out["loss_diff_max"] = max(abs(mine[s] - loss[s]) for s in loss)
    out["loss_diff_last"] = abs(mine[max(loss)] - loss[max(loss)])
    return out


def same_bits(a: Path, b: Path) -> float:
    """1.0 when two runs' final parameters (``--out``) are equal bit for bit entry by entry,
    whatever depth each ended at (a run ending at another tensor-parallel degree: 0.0)."""
    try:
        return float(same_state(a / "out", b / "out", tp=2))
    except ValueError:  # a file per place at TP=2 against one whole model at TP=1
        return 0.0


def run(quick: bool) -> list[Row]:
    """The rows of this scenario (``python -m bench --scenario relayout``)."""
    steps, reps = PLAN[quick]
    load = os.getloadavg()[0]
    got: dict[tuple[str, int, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="unicron-bench-relayout-") as tmp:
        for rep in range(reps):
            for dim in DIMS[quick]:
                where = Path(tmp) / f"{rep}-{dim}"
                clean = _events("clean", dim, steps, where / "clean")
                for arm in ("fixed", "relayout", "retp"):
                    found = measure(_events(arm, dim, steps, where / arm), clean)
                    found["same_bits"] = same_bits(where / "clean", where / arm)
                    for key, value in found.items():
                        got.setdefault((arm, dim, key), []).append(value)
    rows: list[Row] = []
    for (arm, dim, key), values in sorted(got.items()):
        kind = {"short": "step_time_s[short/", "loss_diff_max": "loss_diff_max[",
                "loss_diff_last": "loss_diff_last[",
                "same_bits": "same_bits["}.get(key, f"transition_s[{key}/")  # fmt: skip
        note = (
            f"TP=2 x PP=2 x DP=2 on 8 CPU workers, dim {dim} (state {state_mb(dim):.1f} MB a "
            f"replica), {steps} steps; slot 5 excluded at step {FAULT_STEP}, probed after "
            f"{READMIT_S:g} s; {' '.join(ARMS[arm]) or 'layout kept'}; "
            f"load average {load:.1f} / {os.cpu_count()} CPUs at the start"
        )
        rows.append(make_row(system="unicron", scenario=SCENARIO,
                             metric=f"{kind}{arm}/dim{dim}]", values=values, note=note,
                             unit="s" if kind.endswith("/") else None))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.relayout", __doc__, quick="the smallest model, one repetition")
    quick = p.parse_args(argv).quick
    rows = run(quick)
    print_table(rows, title="A layout change: TP=2 x PP=2 losing a slot, with --pp-choices 1 "
                "(and --tp-choices 1)")  # fmt: skip
    save_scenario(rows, SCENARIO, ROOT / "bench" / "results", replace=not quick)
    write_summary(ROOT / "bench" / "results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
