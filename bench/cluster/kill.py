"""Coordinator ``kill -9``: a real coordinator and two agents on loopback, one task training
``examples/train_gpt.py`` on 4 workers; at a step the coordinator is SIGKILLed (its store,
its own process, lives on), and after ``down_s`` it is started again on the same state
directory. Per repetition, from the event log of the task (each line stamped when it
appeared in the file, i.e. when the coordinator logged it):

- ``answer_s``: the new coordinator's process start to its first answer over HTTP;
- ``adopt_s``: ... to its ``control_plane`` event (the task adopted);
- ``commit_s``: ... to the first ``step_end`` of a step committed after the restart, in the
  log (the issue's "until every task commits a step again"; goal < 5 s);
- ``logged_s``: ... to the first ``step_end`` the new coordinator logged (steps the workers
  committed while it was away come first, delivered by the agents' kept reports);
- ``pause_s``: the longest gap between two commits (workers' time stamps) from the kill on:
  whether the training waited for the control plane at all;
- ``away_s``: the control plane's absence as the ``control_plane`` event reports it;
- ``steps_lost`` (steps never logged), ``steps_twice`` (logged more than once; a rollback
  would show here), ``epochs`` (1: no worker was restarted), and ``bitwise_identical``
  (the final parameters' SHA-256 against a fault-free run of the same task on the same
  cluster set-up).
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.cluster.harness import EventTail, LiveCluster, Stamped, loadavg
from bench.common import Row, make_row
from bench.systems.base import TrialError

SCENARIO = "cluster-kill"
SYSTEM = "unicron cluster"
ROOT = Path(__file__).resolve().parents[2]
GOAL_S = 5.0
NODES = (("n0", 2), ("n1", 2))


def task_spec(name: str, steps: int) -> dict[str, Any]:
    return {
        "name": name,
        "script": str(ROOT / "examples" / "train_gpt.py"),
        "args": ["--steps", str(steps)],
        "workers": {"min": 1, "max": 4},
    }


def _cluster(workdir: Path) -> LiveCluster:
    c = LiveCluster(workdir)
    c.start_coordinator()
    c.answers()
    for name, slots in NODES:
        c.start_agent(name, slots)
    c.wait_nodes(len(NODES))
    return c


def _wait_step(tail: EventTail, step: int, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if any(s.event["event"] == "step_end" and s.event["step"] >= step for s in tail.snapshot()):
            return
        time.sleep(0.01)
    raise TrialError(f"step {step} not logged within {timeout_s:.0f} s")


def reference(workdir: Path, steps: int, timeout_s: float) -> str:
    """The fault-free run: its final parameters' SHA-256."""
    c = _cluster(workdir)
    try:
        c.submit(task_spec("ref", steps))
        view = c.wait_ended("ref", timeout_s)
    finally:
        c.close()
    if view["state"] != "done":
        raise TrialError(f"the fault-free run ended {view['state']}: {view['outcome']}")
    return str(view["outcome"]["params_sha256"])


def trial(
    workdir: Path, steps: int, kill_step: int, down_s: float, timeout_s: float, ref_sha: str
) -> dict[str, float]:
    """One repetition (see the module docstring): its figures."""
    c = _cluster(workdir)
    tail: EventTail | None = None
    try:
        uid = c.submit(task_spec("gpt", steps))["uid"]
        tail = EventTail(c.events_path(uid)).start()
        _wait_step(tail, kill_step, timeout_s)
        t_kill = c.kill_coordinator()
        time.sleep(down_s)
        t_start = c.start_coordinator()
        t_answer = c.answers()
        view = c.wait_ended("gpt", timeout_s)
        time.sleep(0.1)
        lines = tail.snapshot()
    finally:
        if tail is not None:
            tail.stop()
        c.close()
    if view["state"] != "done":
        raise TrialError(f"the task ended {view['state']}: {view['outcome']}")
    return figures(lines, steps, t_kill, t_start, t_answer, view, ref_sha)


def figures(
    lines: list[Stamped],
    steps: int,
    t_kill: float,
    t_start: float,
    t_answer: float,
    view: dict[str, Any],
    ref_sha: str,
) -> dict[str, float]:
    """The figures of one repetition from its stamped event log."""
    ends = [s for s in lines if s.event["event"] == "step_end"]
    adopted = [s for s in lines if s.event["event"] == "control_plane"]
    if not adopted:
        raise TrialError("no control_plane event: the restarted coordinator did not adopt")
    after = [s for s in ends if float(s.event["ts"]) >= t_start]
    logged = [s for s in ends if s.seen >= adopted[0].seen]
    if not after or not logged:
        raise TrialError("no step committed after the restart")
    counts = Counter(int(s.event["step"]) for s in ends)
    commits = sorted(float(s.event["ts"]) for s in ends)
    gaps = [b - a for a, b in itertools.pairwise(commits) if b > t_kill]
    return {
        "answer_s": t_answer - t_start,
        "adopt_s": adopted[0].seen - t_start,
        "commit_s": min(s.seen for s in after) - t_start,
        "logged_s": logged[0].seen - t_start,
        "pause_s": max(gaps, default=0.0),
        "step_gap_s": statistics.median(b - a for a, b in itertools.pairwise(commits)),
        "away_s": float(adopted[0].event.get("away_s") or 0.0),
        "steps_lost": float(sum(1 for s in range(steps) if s not in counts)),
        "steps_twice": float(sum(n - 1 for n in counts.values())),
        "epochs": float(sum(1 for s in lines if s.event["event"] == "epoch_begin")),
        "bitwise_identical": float(view["outcome"].get("params_sha256") == ref_sha),
    }


METRICS = {  # name: (unit, note)
    "answer_s": ("s", "restart (process start) to the service's first answer"),
    "adopt_s": ("s", "restart to the task adopted (its control_plane event)"),
    "commit_s": (
        "s",
        f"restart to a step committed after it, in the event log (goal < {GOAL_S:g} s)",
    ),
    "logged_s": ("s", "restart to the first step_end the new coordinator logged"),
    "pause_s": ("s", "longest gap between two commits from the kill on (workers' clocks)"),
    "step_gap_s": ("s", "median gap between two commits (for comparison with pause_s)"),
    "away_s": ("s", "the control_plane event's away_s (the coordinator's absence)"),
    "steps_lost": ("steps", "steps 0..N-1 never logged (goal 0)"),
    "steps_twice": ("steps", "steps logged more than once (a rollback would show; goal 0)"),
    "epochs": ("count", "epoch_begin events (1: no worker restarted)"),
    "bitwise_identical": ("", "final params SHA-256 equal to the fault-free run's (1 = yes)"),
}


def run(
    quick: bool,
    *,
    reps: int | None = None,
    steps: int | None = None,
    down_s: float = 1.0,
    host: str | None = None,
) -> list[Row]:
    """The rows of this scenario: a fault-free reference run, then ``reps`` kills."""
    reps = reps or (2 if quick else 5)
    steps = steps or (60 if quick else 150)  # enough left after the kill to outlast a restart
    kill_step = steps // 3
    timeout_s = 300.0 + 3.0 * steps
    samples: dict[str, list[float]] = {m: [] for m in METRICS}
    failures: list[str] = []
    before = loadavg()
    with tempfile.TemporaryDirectory(prefix="unicron-bench-kill-") as tmp:
        ref_sha = reference(Path(tmp) / "ref", steps, timeout_s)
        for rep in range(reps):
            workdir = Path(tmp) / f"rep{rep}"
            try:
                got = trial(workdir, steps, kill_step, down_s, timeout_s, ref_sha)
            except TrialError as exc:
                failures.append(f"rep {rep + 1}: {exc}")
                print(f"  rep {rep + 1}: FAILED {exc}", flush=True)
                continue
            print(f"  rep {rep + 1}: " + ", ".join(f"{k}={v:.3g}" for k, v in got.items()),
                  flush=True)  # fmt: skip
            for k, v in got.items():
                samples[k].append(v)
    after = loadavg()
    setup = (
        f"2 agents x 2 slots on loopback, examples/train_gpt.py {steps} steps on 4 workers, "
        f"kill -9 at step {kill_step}, restarted {down_s:g} s later"
    )
    rows = [
        make_row(
            system=SYSTEM,
            scenario=SCENARIO,
            metric=m,
            values=samples[m],
            unit=unit,
            note=f"{note}; {setup}" if m == "commit_s" else note,
            host=host,
        )
        for m, (unit, note) in METRICS.items()
        if samples[m]
    ]
    for row in rows:
        if row["metric"] == "commit_s":
            met = "met" if row["max"] < GOAL_S else "NOT met"
            row["note"] += (
                f"; {met} (max {row['max']:.2f} s); machine: {before} before, {after} after"
            )
    for why in failures:
        rows.append(make_row(system=SYSTEM, scenario=SCENARIO, metric="trial", status="failed",
                             note=why, host=host))  # fmt: skip
    return rows
