"""Durable checkpoints: what they cost a step, and write / restore time against state size.

Two measurements, in one run:

- **step-time cost**: the same Unicron training (2 workers, the example GPT, fault-free) with
  no checkpoints, a checkpoint every 1, 5 and 20 steps and at the automatic (Young/Daly)
  interval. The arms run round-robin, one of each per repetition, each repetition starting
  one arm further on (so no arm always runs first or last on a machine whose load drifts).
  The primary figure is measured *within* one run, so a load that changes between runs
  cancels out: ``step_extra_s``, the median wall time of a step that carries a checkpoint
  (its copy at the step boundary, the background write competing for the cores) minus the
  median of the steps that carry none. ``overhead_est_pct`` spreads it over the run
  (``step_extra_s x checkpoints / the run's training time``). ``overhead_pct`` compares the
  run's mean step time with the ``none`` run of the same repetition (paired): the direct
  figure, but it carries the noise between two runs. A checkpoint after every step has no
  step without one, so ``every=1`` reports ``step_extra_s`` against ``none`` (paired).
- **write / restore time against state size**: in this process, the example GPT at growing
  widths with its AdamW state, up to the 99.7M-parameter configuration of the scale
  benchmark (``examples/gpt.py``, ``--model-size 100m``: 1.2 GB of state; full mode only):
  the copy at the step boundary, the write (serialise, checksum, fsync, rename) and the
  restore (read, verify, load into a fresh model and optimizer).

Run alone (``python -m bench.checkpoint [--quick]``; it writes
``bench/results/checkpoint.json`` and ``SUMMARY.md``) or as the suite's ``checkpoint``
scenario. Method and figures: docs/checkpoint.md.
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import Row, bench_parser, make_row, print_table, save_scenario, write_summary
from bench.events import read_events
from unicron.runtime import checkpoint as C

SCENARIO = "checkpoint"
ROOT = Path(__file__).resolve().parents[1]
ARMS = {"none": "0", "every=1": "1", "every=5": "5", "every=20": "20", "auto": "auto"}
WARMUP = 3
"""steps left out at the start of each run (the first steps of a fresh process are slow)"""
LEDGER = {"dataset_len": 1, "micro_batch_size": 1, "num_microbatches": 1, "seed": 0}
SIZES: dict[str, dict[str, int]] = {
    "dim128": {"dim": 128, "layers": 2},  # the example GPT: what the step-time runs train
    "dim256": {"dim": 256, "layers": 4},
    "dim512": {"dim": 512, "layers": 6},
    "100m": {"dim": 768, "layers": 14, "heads": 12},  # examples/gpt.py SIZES["100m"]
}
"""state sizes measured: name -> examples/gpt.py GPTConfig fields"""


def figures(events: Sequence[dict[str, Any]], warmup: int = WARMUP) -> dict[str, float]:
    """One run's figures from its event log (pure: the events in, numbers out).

    The checkpoint of step ``s`` (``s`` steps committed) is copied right after step ``s - 1``
    commits, and its write runs while step ``s`` computes: its cost falls in step ``s``'s
    wall time, the gap between the ``step_end`` of ``s - 1`` and that of ``s``."""
    ends = sorted((e for e in events if e["event"] == "step_end"), key=lambda e: e["step"])
    ends = [e for e in ends if e["step"] >= warmup]
    saved = [e for e in events if e["event"] == "checkpoint_saved" and e.get("ok")]
    gaps = {b["step"]: b["ts"] - a["ts"] for a, b in itertools.pairwise(ends)}
    marked = {e["step"] for e in saved}
    with_ckpt = [g for s, g in gaps.items() if s in marked]
    without = [g for s, g in gaps.items() if s not in marked]
    out = {
        "step_mean_s": statistics.fmean(gaps.values()),
        "step_median_s": statistics.median(gaps.values()),
        "train_s": sum(gaps.values()),
        "checkpoints": float(len(saved)),
    }
    if saved:
        out["copy_s"] = statistics.median(e["copy_s"] for e in saved)
        out["write_s"] = statistics.median(e["write_s"] for e in saved)
    if with_ckpt and without:
        out["step_extra_s"] = statistics.median(with_ckpt) - statistics.median(without)
        out["overhead_est_pct"] = 100.0 * out["step_extra_s"] * len(with_ckpt) / out["train_s"]
    return out


def _train(workdir: Path, steps: int, every: str) -> dict[str, float]:
    """One fault-free ``unicron run`` with ``--checkpoint-every every``: its figures."""
    workdir.mkdir(parents=True)
    events = workdir / "events.jsonl"
    cmd = [sys.executable, "-m", "unicron", "run", "--nproc-per-node", "2", "--quiet",
           "--events", str(events), "--log-dir", str(workdir / "logs"),
           "--checkpoint-every", every, str(ROOT / "examples" / "train_gpt.py"),
           "--steps", str(steps)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=1800, capture_output=True)
    return figures(read_events(events))


def _model(size: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    fields = {"heads": max(SIZES[size]["dim"] // 64, 1), **SIZES[size]}
    model = GPT(GPTConfig(**fields))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # one step, so the optimizer holds its moments
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def _size_trial(size: str, root: Path) -> dict[str, float]:
    torch.set_num_threads(1)  # as a worker runs (ENV_THREADS): no oversubscribed cores
    model, opt = _model(size)
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    snap = C.snapshot(model, opt, step=1, ledger=LEDGER)
    t1 = time.perf_counter()
    path = C.write(root, snap.parts, step=1, world=1, reduce="exact", model=snap.model,
                   ledger=LEDGER, now=time.time())  # fmt: skip
    t2 = time.perf_counter()
    del snap
    fresh, fresh_opt = _model(size)
    t3 = time.perf_counter()
    found = C.load_newest(root)
    assert found is not None
    C.restore(found[1], fresh, fresh_opt)
    t4 = time.perf_counter()
    nbytes = C.read_manifest(path).nbytes()
    shutil.rmtree(root)
    return {
        "params": float(params),
        "mb": nbytes / 1e6,
        "copy_s": t1 - t0,
        "write_s": t2 - t1,
        "restore_s": t4 - t3,
    }


def run(quick: bool) -> list[Row]:
    """The rows of this scenario (called by ``python -m bench``)."""
    steps, reps = (30, 2) if quick else (150, 3)
    sizes = {"dim128": reps, "dim256": reps} if quick else {**dict.fromkeys(SIZES, 2), "100m": 1}
    arms = list(ARMS)
    runs: dict[str, list[dict[str, float]]] = {a: [] for a in arms}
    sized: dict[str, list[dict[str, float]]] = {s: [] for s in sizes}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="unicron-bench-checkpoint-") as tmp:
        for rep in range(reps):
            for arm in arms[rep % len(arms) :] + arms[: rep % len(arms)]:  # round-robin
                runs[arm].append(_train(Path(tmp) / f"{rep}-{arm}", steps, ARMS[arm]))
                load.append(os.getloadavg()[0])
        for size, count in sizes.items():
            for rep in range(count):
                sized[size].append(_size_trial(size, Path(tmp) / f"size-{size}-{rep}"))
    return _rows(runs, sized, steps, load)


def _rows(
    runs: dict[str, list[dict[str, float]]],
    sized: dict[str, list[dict[str, float]]],
    steps: int,
    load: Sequence[float],
) -> list[Row]:
    rows: list[Row] = []
    where = (
        f"{steps} steps ({WARMUP} left out), 2 workers, example GPT (5.7 MB of state); "
        f"load average {min(load):.1f}..{max(load):.1f} during the runs"
    )

    def add(system: str, metric: str, values: Sequence[float], unit: str, note: str) -> None:
        if values:
            row = make_row(system=system, scenario=SCENARIO, metric=metric, values=values,
                           unit=unit, note=note)  # fmt: skip
            rows.append(row)

    def each(trials: Sequence[dict[str, float]], metric: str) -> list[float]:
        return [r[metric] for r in trials if metric in r]

    none = runs["none"]
    for arm, trials in runs.items():
        system = f"unicron checkpoint {arm}"
        paired = list(zip(trials, none, strict=True))  # the same repetition, one after another
        add(system, "step_mean_s", each(trials, "step_mean_s"), "s", where)
        if arm == "none":
            continue
        add(system, "checkpoints", each(trials, "checkpoints"), "count", "written")
        if arm == "every=1":
            extra = [r["step_mean_s"] - n["step_mean_s"] for r, n in paired]
            why = "every step carries one: mean step minus the same repetition's none"
            add(system, "step_extra_s", extra, "s", why)
        else:
            why = "primary: median step with a checkpoint minus median without, same run"
            add(system, "step_extra_s", each(trials, "step_extra_s"), "s", why)
            why = "step_extra_s x checkpoints / the run's training time"
            add(system, "overhead_est_pct", each(trials, "overhead_est_pct"), "%", why)
        pct = [100.0 * (r["step_mean_s"] - n["step_mean_s"]) / n["step_mean_s"] for r, n in paired]
        why = "mean step time vs none of the same repetition (between runs: noisy)"
        add(system, "overhead_pct", pct, "%", why)
        for metric, what in (
            ("copy_s", "on the training thread, per checkpoint (checkpoint_saved)"),
            ("write_s", "in the background, per checkpoint (checkpoint_saved)"),
        ):
            add(system, metric, each(trials, metric), "s", what)
    for size, trials in sized.items():
        mb, params = trials[0]["mb"], trials[0]["params"]
        system = f"unicron state {mb:.0f} MB"
        cfg = ", ".join(f"{k}={v}" for k, v in SIZES[size].items())
        note = f"example GPT {cfg} ({params / 1e6:.1f}M parameters) + AdamW; {mb:.1f} MB on disk"
        for metric in ("copy_s", "write_s", "restore_s"):
            add(system, metric, [t[metric] for t in trials], "s", note)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(
        "bench.checkpoint", __doc__, quick="fewer steps and repetitions, two small sizes"
    )
    rows = run(p.parse_args(argv).quick)
    print_table(rows, title="checkpoints: step-time cost, write and restore time")
    results = ROOT / "bench" / "results"
    save_scenario(rows, SCENARIO, results, replace=True)
    print(f"wrote {write_summary(results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
