"""The sharded optimizer: DP=4 with the optimizer's state on every replica (``--zero 0``)
against each parameter's state on two of them (``--zero 1``), fault-free and losing a rank.

In one run, per model width: ``examples/train_llama_parallel.py`` under ``unicron run
--nproc-per-node 4`` (one rank a replica), four ways: each arm fault-free and with rank 1
killed mid-step at step ``F`` (restarted in place, back a step or two later). Metrics, each
``[arm/dimD]``: ``step_time_s[steady/...]`` (median step of the fault-free run after warm-up:
the sharded arm steps half the parameters and adds one broadcast per member of the new
values), ``transition_s[crash/...]`` and ``transition_s[rejoin/...]`` (the ``transition_end``
of the epoch without the rank, where the sharded arm gives the lost rank's shares a new
keeper, and of its return, where the restarted rank takes the parameters and its shares; an
epoch the return superseded before its transition ended has none, and its run gives no
``crash`` figure), ``recovery_s[...]`` (the kill to the next committed step),
``optimizer_mb[...]`` (the optimizer state a rank keeps: the whole AdamW state, or the largest
share of :func:`unicron.runtime.zero.assign` over the model's parameters: ``derived``), and
``same_bits`` (1 when the faulted run ends with the replicated fault-free run's parameters).
On this machine's 2 cores the broadcast and the moves are memory copies and loopback TCP: what
the sharding saves is memory, measured here as bytes kept; its time is what it costs.

Run only when named: ``python -m bench.zero [--quick]`` or ``python -m bench --scenario zero``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import Row, bench_parser, make_row, print_table, save_scenario, write_summary
from bench.events import read_events

SCENARIO = "zero"
ROOT = Path(__file__).resolve().parents[1]
DIMS = {True: (128,), False: (128, 256, 384)}  # model width (hidden units: twice it)
PLAN = {True: (30, 1), False: (40, 2)}  # quick: (steps, repetitions)
FAULT_STEP, WARMUP = 15, 5
WORKERS = 4
ARMS = {"replicated": "0", "sharded": "1"}
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _events(arm: str, dim: int, steps: int, fault: bool, workdir: Path) -> list[dict[str, Any]]:
    workdir.mkdir(parents=True)
    inject = ["--inject", f"crash:rank=1,step={FAULT_STEP},mb=1"] if fault else []
    cmd = [sys.executable, "-m", "unicron", "run", "--nproc-per-node", str(WORKERS),
           "--zero", ARMS[arm], *inject, "--checkpoint-every", "0", "--quiet",
           "--events", str(workdir / "events.jsonl"), "--log-dir", str(workdir / "logs"),
           str(ROOT / "examples" / "train_llama_parallel.py"), "--steps", str(steps),
           "--dim", str(dim), "--hidden", str(2 * dim)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, env=ENV, timeout=900, capture_output=True)
    return [dict(e) for e in read_events(workdir / "events.jsonl")]


def steady(evs: list[dict[str, Any]]) -> float:
    """The median step of a fault-free run after its warm-up. Pure."""
    return statistics.median(
        float(e["duration_s"]) for e in evs if e["event"] == "step_end" and int(e["step"]) >= WARMUP
    )


def faulted(evs: list[dict[str, Any]], clean: list[dict[str, Any]]) -> dict[str, float]:
    """One faulted run's figures: the transitions of the epoch without the killed rank and of
    its return, the kill to the next committed step, and whether it ended with ``clean``'s
    parameters. Pure."""
    ends = {int(e["epoch"]): float(e["duration_s"]) for e in evs if e["event"] == "transition_end"}
    # epochs whose transition ended (one the restarted rank's return superseded did not)
    done = [e for e in evs if e["event"] == "epoch_begin" and int(e["epoch"]) in ends]
    out: dict[str, float] = {}
    short = next((e for e in done if len(e["members"]) < WORKERS), None)
    if short is not None:
        out["crash"] = ends[int(short["epoch"])]
    after = int(short["epoch"]) if short is not None else 1
    back = next(e for e in done if int(e["epoch"]) > after and len(e["members"]) == WORKERS)
    out["rejoin"] = ends[int(back["epoch"])]
    killed = min(float(e["ts"]) for e in evs if e["event"] == "fault_injected")
    out["recovery"] = (
        min(float(e["ts"]) for e in evs if e["event"] == "step_end" and float(e["ts"]) > killed)
        - killed
    )
    end, clean_end = (next(e for e in x if e["event"] == "task_end") for x in (evs, clean))
    out["same_bits"] = float(end.get("params_sha256") == clean_end.get("params_sha256"))
    return out


def optimizer_mb(dim: int, arm: str) -> float:
    """The AdamW state a rank keeps at width ``dim`` (MB, float32 moments): all of it, or
    the largest share the ownership plan gives one of four members on one node."""
    sys.path.insert(0, str(ROOT / "examples"))
    import llama_parallel

    from unicron.parallel import TensorParallel
    from unicron.runtime.zero import assign

    model = llama_parallel.Llama(
        llama_parallel.LlamaConfig(dim=dim, hidden=2 * dim), TensorParallel(0, 1)
    )
    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    if arm == "replicated":
        return 2 * sum(sizes) / 1e6
    owners = assign(sizes, [0] * WORKERS)
    return max(2 * sum(sizes[i] for i in owners.held(r)) for r in range(WORKERS)) / 1e6


def run(quick: bool) -> list[Row]:
    """The rows of this scenario (``python -m bench --scenario zero``)."""
    steps, reps = PLAN[quick]
    load = os.getloadavg()[0]
    got: dict[tuple[str, int, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="unicron-bench-zero-") as tmp:
        for rep in range(reps):
            for dim in DIMS[quick]:
                where = Path(tmp) / f"{rep}-{dim}"
                base = _events("replicated", dim, steps, False, where / "replicated-clean")
                for arm in ARMS:
                    clean = (
                        base
                        if arm == "replicated"
                        else _events(arm, dim, steps, False, where / f"{arm}-clean")
                    )
                    got.setdefault((arm, dim, "steady"), []).append(steady(clean))
                    evs = _events(arm, dim, steps, True, where / f"{arm}-fault")
                    for key, value in faulted(evs, base).items():
                        got.setdefault((arm, dim, key), []).append(value)
    rows: list[Row] = []
    for (arm, dim, key), values in sorted(got.items()):
        metric = {
            "steady": "step_time_s[steady/", "crash": "transition_s[crash/",
            "rejoin": "transition_s[rejoin/", "recovery": "recovery_s[",
            "same_bits": "same_bits[",
        }[key]  # fmt: skip
        note = (
            f"DP={WORKERS} on {WORKERS} CPU workers, dim {dim}, {steps} steps, --zero "
            f"{ARMS[arm]}; faulted: rank 1 killed mid-step {FAULT_STEP}, no checkpoint; load "
            f"average {load:.1f} / {os.cpu_count()} CPUs at the start"
        )
        rows.append(make_row(system="unicron", scenario=SCENARIO,
                             metric=f"{metric}{arm}/dim{dim}]", values=values, note=note,
                             unit=None if key == "same_bits" else "s"))  # fmt: skip
    for dim in DIMS[quick]:
        for arm in ARMS:
            rows.append(make_row(
                system="unicron", scenario=SCENARIO, metric=f"optimizer_mb[{arm}/dim{dim}]",
                values=[optimizer_mb(dim, arm)], unit="MB", status="derived",
                note="AdamW's two float32 moments a rank keeps: all of them, or the largest "
                     "share of unicron.runtime.zero.assign for 4 members (each state on two)",
            ))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("bench.zero", __doc__, quick="the smallest model, one repetition")
    quick = p.parse_args(argv).quick
    rows = run(quick)
    print_table(rows, title="The sharded optimizer: DP=4, replicated or sharded, losing a rank")
    save_scenario(rows, SCENARIO, ROOT / "bench" / "results", replace=not quick)
    write_summary(ROOT / "bench" / "results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
