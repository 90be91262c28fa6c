"""What one exchange costs the cluster itself, without HTTP: a micro-benchmark.

``python -m bench.cluster.exchange [--agents 200] [--tasks 20] [--rounds 20]`` builds a
:class:`~unicron.control.cluster.Cluster` in this process (embedded store, a temporary state
directory), registers ``agents`` nodes of 2 slots, submits ``tasks`` tasks of 4 workers (the
load test's shape, ``bench.cluster.load``), starts each with a ``Ready`` per slot, then plays
``rounds`` steps of every task: per step and supervisor the exchanges a real one makes
(``StepBegan``; ``StepComputed``; the slots' ``step_end``; an idle exchange), a quarter of
the nodes' heartbeats (each node's once a simulated second) and the cluster's ``tick`` (the
ticker's round over every task) after each step, every call timed with ``time.thread_time``
(this thread's CPU: neither the machine's load nor the embedded store's server thread). It
prints the CPU per call (median and p90, in microseconds) by kind, and writes them to
``bench/results/cluster-exchange.json``. The service's own part of a request (uvicorn,
FastAPI, the JSON codec) is not in these figures: ``bench.cluster.load`` has the whole.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    RESULTS_DIR,
    Row,
    bench_parser,
    machine,
    make_row,
    print_table,
    save_scenario,
)
from unicron import messages as M
from unicron.control.cluster import Cluster
from unicron.control.taskspec import TaskSpec

SCENARIO = "cluster-exchange"
ROOT = Path(__file__).resolve().parents[2]
STEP_S = 0.25
"""the simulated step time (the load test's default): reports are stamped on this clock"""


def _cpu_us(call: Callable[..., object], *args: Any) -> float:
    """This thread's CPU microseconds for ``call(*args)``."""
    t0 = time.thread_time()
    call(*args)
    return (time.thread_time() - t0) * 1e6


def measure(agents: int, tasks: int, rounds: int, workdir: Path) -> dict[str, list[float]]:
    """CPU microseconds per call, by kind (see the module docstring)."""
    c = Cluster(workdir / "state", host="127.0.0.1", embedded=True)
    try:
        now = time.time()
        names = [f"n{i:03d}" for i in range(agents)]
        for name in names:
            c.register(name, 2, "127.0.0.1", name, now)
        script = str(ROOT / "examples" / "train_gpt.py")
        for i in range(tasks):
            spec = {"name": f"t{i:02d}", "script": script, "workers": {"min": 4, "max": 4},
                    "checkpoint": {"every": 0}}  # fmt: skip
            c.submit(TaskSpec.model_validate(spec), now)
        sups: list[tuple[str, str, list[int]]] = []  # (node name, task uid, its slots)
        for name in names:
            for a in c.heartbeat(name, name, now):
                sups.append((name, a.uid, list(a.slots)))
        for name, uid, slots in sups:
            ready = [M.Ready(slot=s, ts=now, microbatches=8, state_bytes=1 << 20) for s in slots]
            c.exchange(name, name, uid, [M.Census(ts=now, alive=tuple(slots)), *ready], now, now)
        c.tick(now)
        epochs = {t.row.uid: t.row.epoch for t in c.tasks.values()}
        assert all(e >= 1 for e in epochs.values()), epochs
        for name, uid, slots in sups:
            entered: list[M.Report] = [
                M.EpochEntered(slot=s, ts=now, epoch=epochs[uid]) for s in slots
            ]
            c.exchange(name, name, uid, entered, now, now)
        out: dict[str, list[float]] = {"began": [], "computed": [], "committed": [], "idle": []}
        out["heartbeat"], out["tick"] = [], []
        t = now
        for step in range(rounds):
            begin = t
            for name in names[step % 4 :: 4]:  # every node once a (simulated) second
                out["heartbeat"].append(_cpu_us(c.heartbeat, name, name, t))
            for name, uid, slots in sups:
                began: list[M.Report] = [
                    M.StepBegan(slot=s, ts=begin, step=step, epoch=epochs[uid]) for s in slots
                ]
                out["began"].append(_cpu_us(c.exchange, name, name, uid, began, t, t))
            t += 0.8 * STEP_S
            for name, uid, slots in sups:
                done: list[M.Report] = [
                    M.StepComputed(slot=s, ts=t, step=step, compute_s=0.8 * STEP_S, microbatches=2)
                    for s in slots
                ]
                out["computed"].append(_cpu_us(c.exchange, name, name, uid, done, t, t))
            t += 0.15 * STEP_S
            for name, uid, slots in sups:
                ends: list[M.Report] = [M.Event(ts=t, name="step_end", fields={
                    "ts": t, "epoch": epochs[uid], "rank": s, "step": step, "loss": 1.0,
                    "duration_s": STEP_S, "task": uid}) for s in slots]  # fmt: skip
                out["committed"].append(_cpu_us(c.exchange, name, name, uid, ends, t, t))
            t += 0.05 * STEP_S
            for name, uid, _ in sups:
                out["idle"].append(_cpu_us(c.exchange, name, name, uid, [], t, t))
            out["tick"].append(_cpu_us(c.tick, t))
        bad = [v["state"] for v in c.task_views() if v["state"] != "running"]
        assert not bad, f"tasks not running after the rounds: {bad}"
        return out
    finally:
        c.close()


def run(agents: int, tasks: int, rounds: int, host: str) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="unicron-bench-exchange-") as tmp:
        got = measure(agents, tasks, rounds, Path(tmp))
    load = Path("/proc/loadavg").read_text().split()[:3]
    setup = (
        f"{agents} nodes, {tasks} tasks x 4 workers, {rounds} steps each; CPU of this thread "
        f"(time.thread_time); load average {' '.join(load)}"
    )
    rows = []
    for kind, values in got.items():
        q = statistics.quantiles(values, n=10)
        what = {"tick": "the cluster's tick (every task)", "heartbeat": "a node's heartbeat"}.get(
            kind, f"an exchange ({kind})"
        )
        for metric, value in ((f"cpu_us[{kind}]", statistics.median(values)),
                              (f"cpu_us_p90[{kind}]", q[-1])):  # fmt: skip
            rows.append(make_row(system="unicron cluster", scenario=SCENARIO, metric=metric,
                                 values=[value], unit="us", note=f"{what}; {setup}",
                                 host=host))  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = bench_parser("bench.cluster.exchange", __doc__)
    p.add_argument("--agents", type=int, default=200, metavar="N")
    p.add_argument("--tasks", type=int, default=20, metavar="N")
    p.add_argument("--rounds", type=int, default=20, metavar="N", help="steps played per task")
    p.add_argument("--results", type=Path, default=RESULTS_DIR, metavar="DIR")
    args = p.parse_args(argv)
    if min(args.agents, args.tasks, args.rounds) < 1 or args.tasks * 2 > args.agents:
        print("python -m bench.cluster.exchange: need >= 1 of each and 2 nodes per task")
        return 2
    rows = run(args.agents, args.tasks, args.rounds, machine())
    save_scenario(rows, SCENARIO, args.results)
    print_table(rows, title="What an exchange costs the cluster (no HTTP)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
