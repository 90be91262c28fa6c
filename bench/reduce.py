"""``--reduce exact`` against ``--reduce fast``: the speed each costs and the drift each allows.

In one run, interleaved: the same Unicron training (4 workers, the example GPT) with each
reduction, once fault-free and once with a worker SIGKILLed mid-step (its micro-batches go to
the survivors, so the gradient sums are regrouped). Reports the median step time of each, and
the relative L2 distance between the final parameters of the faulty and the fault-free run of
the same reduction: 0 for exact (bitwise identical), float32 rounding for fast. The control
``--on-lost drop`` (the global batch shrinks instead) shows what strict semantics avoid.

Run alone (``python -m bench.reduce [--quick]``) or as the suite's ``reduce`` scenario.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.common import Row, make_row, print_table, save_scenario
from bench.events import read_events

SCENARIO = "reduce"
ROOT = Path(__file__).resolve().parents[1]


def _train(workdir: Path, steps: int, *extra: str) -> tuple[torch.Tensor, float]:
    """One ``unicron run``: (its final parameters, flattened; its median step time)."""
    workdir.mkdir(parents=True)
    events = workdir / "events.jsonl"
    cmd = [sys.executable, "-m", "unicron", "run", "--nproc-per-node", "4", "--quiet",
           "--events", str(events), "--log-dir", str(workdir / "logs"), *extra,
           str(ROOT / "examples" / "train_gpt.py"), "--steps", str(steps),
           "--out", str(workdir / "out")]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=600, capture_output=True)
    state = torch.load(workdir / "out" / "final.pt", weights_only=True)
    params = torch.cat([t.reshape(-1).double() for t in state.values()])
    ends = [e for e in read_events(events) if e["event"] == "step_end"][3:]
    gaps = sorted(b["ts"] - a["ts"] for a, b in itertools.pairwise(ends))
    return params, gaps[len(gaps) // 2]


def _drift(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def run(quick: bool) -> list[Row]:
    """The rows of this scenario (called by ``python -m bench``)."""
    steps, reps = (32, 1) if quick else (120, 3)
    fault = ["--inject", f"crash:rank=3,step={steps * 5 // 8}"]
    arms = {
        "unicron exact": ["--reduce", "exact"],
        "unicron fast": ["--reduce", "fast"],
        "unicron exact on-lost=drop": ["--reduce", "exact", "--on-lost", "drop"],
    }
    step_s: dict[str, list[float]] = {a: [] for a in arms}
    drift: dict[str, list[float]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory(prefix="unicron-bench-reduce-") as tmp:
        for rep in range(reps):
            clean: dict[str, torch.Tensor] = {}
            for arm, flags in arms.items():  # interleaved: every arm once per repetition
                key = flags[1]
                if key not in clean:
                    clean[key], t = _train(Path(tmp) / f"{rep}-{key}-clean", steps, *flags[:2])
                    step_s[f"unicron {key}"].append(t)
                faulty, _ = _train(Path(tmp) / f"{rep}-{arm}".replace(" ", "_"), steps,
                                   *flags, *fault)  # fmt: skip
                drift[arm].append(_drift(faulty, clean[key]))
    rows = []
    for arm in arms:
        note = f"{steps} steps; drift: faulty run vs fault-free run of the same reduction"
        if step_s[arm]:
            rows.append(make_row(system=arm, scenario=SCENARIO, metric="step_time_s",
                                 values=step_s[arm], unit="s", note="fault-free"))  # fmt: skip
        rows.append(make_row(system=arm, scenario=SCENARIO, metric="drift_rel_l2",
                             values=drift[arm], unit="1", note=note))  # fmt: skip
    return rows


def main() -> int:
    quick = "--quick" in sys.argv[1:]
    rows = run(quick)
    print_table(rows, title="--reduce exact vs fast")
    save_scenario(rows, SCENARIO, ROOT / "bench" / "results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
