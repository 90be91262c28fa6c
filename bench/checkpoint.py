"""Durable checkpoints: what they cost a step, and write / restore time against state size.

Two measurements, in one run:

- **step-time overhead**: the same Unicron training (2 workers, the example GPT, fault-free)
  with no checkpoints and with a checkpoint every 1, 5 and 20 steps and at the automatic
  (Young/Daly) interval, arms interleaved per repetition. Reports each arm's median step
  time, its overhead against no checkpoints, the number of checkpoints written and the
  median copy time on the training thread (the part of a checkpoint a step waits for).
- **write / restore time against state size**: in this process, the example GPT at growing
  widths with its AdamW state: the copy at the step boundary, the write (serialise, checksum,
  fsync, rename) and the restore (read, verify, load into a fresh model and optimizer).

Run alone (``python -m bench.checkpoint [--quick]``) or as the suite's ``checkpoint``
scenario. Method and figures: docs/checkpoint.md.
"""

from __future__ import annotations

import itertools
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Row, make_row, print_table, save_scenario
from bench.events import read_events
from unicron.runtime import checkpoint as C

SCENARIO = "checkpoint"
ROOT = Path(__file__).resolve().parents[1]
ARMS = {"none": "0", "every=1": "1", "every=5": "5", "every=20": "20", "auto": "auto"}
LEDGER = {"dataset_len": 1, "micro_batch_size": 1, "num_microbatches": 1, "seed": 0}


def _train(workdir: Path, steps: int, every: str) -> dict[str, float]:
    """One fault-free ``unicron run`` with ``--checkpoint-every every``: its figures."""
    workdir.mkdir(parents=True)
    events = workdir / "events.jsonl"
    cmd = [sys.executable, "-m", "unicron", "run", "--nproc-per-node", "2", "--quiet",
           "--events", str(events), "--log-dir", str(workdir / "logs"),
           "--checkpoint-every", every, str(ROOT / "examples" / "train_gpt.py"),
           "--steps", str(steps)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=900, capture_output=True)
    evs = read_events(events)
    ends = [e for e in evs if e["event"] == "step_end"][3:]
    saved = [e for e in evs if e["event"] == "checkpoint_saved" and e.get("ok")]
    # the checkpoint of step s is copied right after step s - 1 commits, so its cost falls in
    # the gap that ends with step s
    marked = {e["step"] for e in saved}
    gaps = {b["step"]: b["ts"] - a["ts"] for a, b in itertools.pairwise(ends)}
    out = {"step_time_s": statistics.median(gaps.values()), "checkpoints": float(len(saved))}
    with_ckpt = [g for s, g in gaps.items() if s in marked]
    without = [g for s, g in gaps.items() if s not in marked]
    if saved:
        out["copy_s"] = statistics.median(e["copy_s"] for e in saved)
        out["write_s"] = statistics.median(e["write_s"] for e in saved)
    if with_ckpt and without:
        out["step_extra_s"] = statistics.median(with_ckpt) - statistics.median(without)
    return out


def _model(dim: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(dim=dim, layers=layers, heads=max(dim // 64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # one step, so the optimizer holds its moments
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def _size_trial(dim: int, layers: int, root: Path) -> dict[str, float]:
    torch.set_num_threads(1)  # as a worker runs (ENV_THREADS): no oversubscribed cores
    model, opt = _model(dim, layers)
    t0 = time.perf_counter()
    snap = C.snapshot(model, opt, step=1, ledger=LEDGER)
    t1 = time.perf_counter()
    path = C.write(root, snap.parts, step=1, world=1, reduce="exact", model=snap.model,
                   ledger=LEDGER, now=time.time())  # fmt: skip
    t2 = time.perf_counter()
    fresh, fresh_opt = _model(dim, layers)
    t3 = time.perf_counter()
    found = C.load_newest(root)
    assert found is not None
    C.restore(found[1], fresh, fresh_opt)
    t4 = time.perf_counter()
    nbytes = C.read_manifest(path).nbytes()
    shutil.rmtree(root)
    return {"mb": nbytes / 1e6, "copy_s": t1 - t0, "write_s": t2 - t1, "restore_s": t4 - t3}


def run(quick: bool) -> list[Row]:
    """The rows of this scenario (called by ``python -m bench``)."""
    steps, reps = (40, 2) if quick else (120, 3)
    sizes = [(128, 2), (256, 4), (512, 6)] if quick else [(128, 2), (256, 4), (512, 6), (768, 8)]
    runs: dict[str, list[dict[str, float]]] = {a: [] for a in ARMS}
    sized: dict[tuple[int, int], list[dict[str, float]]] = {s: [] for s in sizes}
    with tempfile.TemporaryDirectory(prefix="unicron-bench-checkpoint-") as tmp:
        for rep in range(reps):
            for arm, every in ARMS.items():  # interleaved: every arm once per repetition
                runs[arm].append(_train(Path(tmp) / f"{rep}-{arm}", steps, every))
            for dim, layers in sizes:
                root = Path(tmp) / f"size-{rep}-{dim}"
                sized[(dim, layers)].append(_size_trial(dim, layers, root))
    return _rows(runs, sized, steps)


def _rows(
    runs: dict[str, list[dict[str, float]]],
    sized: dict[tuple[int, int], list[dict[str, float]]],
    steps: int,
) -> list[Row]:
    rows = []
    base = statistics.median(r["step_time_s"] for r in runs["none"])
    note = f"{steps} steps, 2 workers, example GPT (5.7 MB of state)"
    for arm, trials in runs.items():
        system = f"unicron checkpoint {arm}"
        step_s = [r["step_time_s"] for r in trials]
        rows.append(
            make_row(
                system=system,
                scenario=SCENARIO,
                metric="step_time_s",
                values=step_s,
                unit="s",
                note=note,
            )
        )
        if arm == "none":
            continue
        overhead = [100.0 * (s - base) / base for s in step_s]
        rows.append(
            make_row(
                system=system,
                scenario=SCENARIO,
                metric="overhead_pct",
                values=overhead,
                unit="%",
                note="median step time vs none",
            )
        )
        rows.append(
            make_row(
                system=system,
                scenario=SCENARIO,
                metric="checkpoints",
                values=[r["checkpoints"] for r in trials],
                unit="count",
            )
        )
        for metric, what in (
            ("copy_s", "on the training thread, per checkpoint (checkpoint_saved)"),
            ("write_s", "in the background, per checkpoint (checkpoint_saved)"),
            ("step_extra_s", "median step with a checkpoint minus median step without"),
        ):
            values = [r[metric] for r in trials if metric in r]
            if values:
                rows.append(
                    make_row(
                        system=system,
                        scenario=SCENARIO,
                        metric=metric,
                        values=values,
                        unit="s",
                        note=what,
                    )
                )
    for (dim, layers), trials in sized.items():
        mb = trials[0]["mb"]
        system = f"unicron state {mb:.0f} MB"
        note = f"example GPT dim={dim} layers={layers} + AdamW; {mb:.1f} MB on disk"
        for metric in ("copy_s", "write_s", "restore_s"):
            rows.append(
                make_row(
                    system=system,
                    scenario=SCENARIO,
                    metric=metric,
                    values=[t[metric] for t in trials],
                    unit="s",
                    note=note,
                )
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    rows = run("--quick" in args)
    print_table(rows, title="checkpoints: step-time overhead, write and restore time")
    save_scenario(rows, SCENARIO, ROOT / "bench" / "results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
