"""``--reduce exact`` against ``--reduce fast``: the speed each costs and the drift each allows.

In one run, interleaved: the same Unicron training (4 workers, the example GPT) with each
reduction, once fault-free and once with a worker SIGKILLed mid-step (its micro-batches go to
the survivors, so the gradient sums are regrouped). Reports the median step time of each, and
the relative L2 distance between the final parameters of the faulty and the fault-free run of
the same reduction: 0 for exact (bitwise identical), float32 rounding for fast. The control
``--on-lost drop`` (the global batch shrinks instead) shows what strict semantics avoid.

The adversarial case: the same runs with ``--adversarial`` (each micro-batch's loss scaled by
2^k, k in -40..40, so gradients of one step span 2^80), and, without processes, the
regrouping test of ``tests/test_reduce.py`` as figures: how many elements of a reduced
gradient change when the same adversarial micro-batches are grouped otherwise, for the
float64 sum exact mode used before and for the summation tree. Last, how far the exact
update is from a plain float32 DDP update on the example model (``update_distance``).

Run alone (``python -m bench.reduce [--quick]``) or as the suite's ``reduce`` scenario.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.common import Row, bench_parser, make_row, print_table, save_scenario
from bench.events import read_events
from examples.gpt import build, loss_fn
from unicron.runtime.ledger import Ledger, assign, mb_seed
from unicron.runtime.reduce import Layout, LocalSums, Node, combine

SCENARIO = "reduce"
ROOT = Path(__file__).resolve().parents[1]


def _train(workdir: Path, steps: int, *extra: str) -> tuple[torch.Tensor, float]:
    """One ``unicron run``: (its final parameters, flattened; its median step time)."""
    workdir.mkdir(parents=True)
    events = workdir / "events.jsonl"
    script = [a for a in extra if a == "--adversarial"]
    extra = tuple(a for a in extra if a != "--adversarial")
    cmd = [sys.executable, "-m", "unicron", "run", "--nproc-per-node", "4", "--quiet",
           "--events", str(events), "--log-dir", str(workdir / "logs"), *extra,
           str(ROOT / "examples" / "train_gpt.py"), "--steps", str(steps),
           "--out", str(workdir / "out"), *script]  # fmt: skip
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
    return _runs(quick) + regrouping_rows() + update_distance_rows()


def _runs(quick: bool) -> list[Row]:
    steps, reps = (32, 1) if quick else (120, 3)
    fault = ["--inject", f"crash:rank=3,step={steps * 5 // 8}"]
    arms = {
        "unicron exact": ["--reduce", "exact"],
        "unicron fast": ["--reduce", "fast"],
        "unicron exact on-lost=drop": ["--reduce", "exact", "--on-lost", "drop"],
        "unicron exact adversarial": ["--reduce", "exact", "--adversarial"],
        "unicron fast adversarial": ["--reduce", "fast", "--adversarial"],
    }
    step_s: dict[str, list[float]] = {a: [] for a in arms}
    drift: dict[str, list[float]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory(prefix="unicron-bench-reduce-") as tmp:
        for rep in range(reps):
            clean: dict[str, torch.Tensor] = {}
            for arm, flags in arms.items():  # interleaved: every arm once per repetition
                twin = arm.replace(" on-lost=drop", "")  # its fault-free run
                if twin not in clean:
                    base = Path(tmp) / f"{rep}-{twin}-clean".replace(" ", "_")
                    clean[twin], t = _train(base, steps, *arms[twin])
                    step_s[twin].append(t)
                faulty, _ = _train(Path(tmp) / f"{rep}-{arm}".replace(" ", "_"), steps,
                                   *flags, *fault)  # fmt: skip
                drift[arm].append(_drift(faulty, clean[twin]))
    rows = []
    for arm in arms:
        note = f"{steps} steps; drift: faulty run vs fault-free run of the same reduction"
        if step_s[arm]:
            rows.append(make_row(system=arm, scenario=SCENARIO, metric="step_time_s",
                                 values=step_s[arm], unit="s", note="fault-free"))  # fmt: skip
        rows.append(make_row(system=arm, scenario=SCENARIO, metric="drift_rel_l2",
                             values=drift[arm], unit="1", note=note))  # fmt: skip
    return rows


def _tree(grouping: list[list[int]], leaves: list[torch.Tensor]) -> torch.Tensor:
    """Exact mode's reduced sum: each replica's tree nodes, evaluated in tree order."""
    m = len(leaves)
    layout = Layout.plan([leaves[0].numel()], leaves[0].numel())
    parts: dict[Node, torch.Tensor] = {}
    for ids in grouping:
        sums = LocalSums(layout, m, exact=True, dtype=torch.float32)
        for mb in ids:
            sums.begin(mb)
            sums.add(0, leaves[mb])
            sums.end(0.0)
        parts.update(sums.nodes)
    root = combine(parts, m, lambda x, y: x.add_(y))
    assert root is not None
    return root


def _float64(grouping: list[list[int]], leaves: list[torch.Tensor]) -> torch.Tensor:
    """Exact mode before: float64 sums per replica, summed in float64, cast to float32."""
    total = torch.zeros(leaves[0].numel(), dtype=torch.float64)
    for ids in grouping:
        total += sum((leaves[mb].double() for mb in ids), torch.zeros_like(total))
    return total.float()


def regrouping_rows(m: int = 8, n: int = 200_000) -> list[Row]:
    """Elements of a step's reduced gradient that change when the same adversarial
    micro-batches (random signs, magnitudes 2^-60..2^60) are grouped otherwise."""
    gen = torch.Generator().manual_seed(0)
    sign = torch.where(torch.rand(m, n, generator=gen) < 0.5, -1.0, 1.0).double()
    leaves = list((sign * 2.0 ** torch.randint(-60, 61, (m, n), generator=gen)).float())
    groupings = [assign(range(m), w) for w in (2, 3, 4, 5, 8)] + [[[0, 1, 5], [2, 3, 4, 6, 7]]]
    rows = []
    for system, reduce in (("float64 sum (exact before)", _float64), ("unicron exact", _tree)):
        ref = reduce([list(range(m))], leaves)
        changed = [int((reduce(g, leaves) != ref).sum()) for g in groupings]
        note = f"{m} micro-batches of {n} elements regrouped {len(groupings)} ways (worst)"
        rows.append(make_row(system=system, scenario=SCENARIO, metric="regrouped_elements_changed",
                             values=[max(changed)], unit="count", note=note))  # fmt: skip
    return rows


def update_distance_rows(m: int = 8, world: int = 4) -> list[Row]:
    """The example model's mean gradient of step 0, exact mode's against a plain float32 DDP
    loop's (each rank accumulates loss / its micro-batches, the ranks' sums averaged), both
    against the float64 sum: relative L2 distances."""
    torch.set_num_threads(1)
    model, _, dataset = build(0)
    model.train()
    ledger = Ledger(dataset_len=len(dataset), micro_batch_size=4, num_microbatches=m, seed=0)
    leaves = []
    for mb in range(m):
        torch.manual_seed(mb_seed(0, 0, mb))
        items = [dataset[i] for i in ledger.samples(0, mb)]
        batch = (torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        leaves.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))  # type: ignore[union-attr]
    exact = _tree(assign(range(m), world), leaves) / m
    ddp = torch.zeros_like(exact)
    for ids in assign(range(m), world):
        local = torch.zeros_like(exact)
        for mb in ids:
            local += leaves[mb] / len(ids)
        ddp += local / world
    ref = torch.stack(leaves).double().sum(0) / m
    note = f"example model, step 0, {m} micro-batches on {world} replicas"
    rows = []
    pairs = [("unicron exact", exact, ref), ("plain DDP float32", ddp, ref),
             ("unicron exact vs plain DDP", exact, ddp.double())]  # fmt: skip
    for system, other, against in pairs:
        dist = float((other.double() - against).norm() / against.norm())
        metric = "grad_rel_l2_vs_ddp" if "vs" in system else "grad_rel_l2_vs_float64"
        rows.append(make_row(system=system.replace(" vs plain DDP", ""), scenario=SCENARIO,
                             metric=metric, values=[dist], unit="1", note=note))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.reduce", __doc__, quick="32 steps, one repetition")
    rows = run(p.parse_args(argv).quick)
    print_table(rows, title="--reduce exact vs fast")
    save_scenario(rows, SCENARIO, ROOT / "bench" / "results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
