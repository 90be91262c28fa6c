"""Node loss on a cluster of real agents, side by side with torchrun's elastic agents.

``unicron cluster``: a real ``unicron coordinator`` and two ``unicron agent`` processes of 2
slots each on loopback (this machine, no network namespaces), one task of 4 workers
training ``examples/train_gpt.py`` with ``inject: [node:node=1,step=S]``: at step S node 1
vanishes (its agent and its workers SIGKILLed at once, the agent exits without a word).
Against it, the ``node`` scenario's torchrun arms
(:class:`bench.systems.torchrun.TorchrunNodeArm`: two ``torchrun --nnodes 1:2`` agents on a
c10d rendezvous, tuned and, in the full run, default settings), interleaved with it
repetition after repetition. Figures from each run's event log by the suite's
parser (:mod:`bench.events`): detection (first ``error_detected``), for Unicron also the
coordinator's heartbeat verdict (``detection_heartbeat_s``), recovery (the fault to the
next finished step; goal < 1 s), steps redone, wall time (submission or launch to the end).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.cluster.harness import LiveCluster, loadavg
from bench.common import Row, machine
from bench.events import read_events
from bench.systems.base import Arm, Scenario, Settings, TrialError, figures
from bench.systems.torchrun import TorchrunNodeArm

SCENARIO = "cluster-node"
ROOT = Path(__file__).resolve().parents[2]
GOAL_S = 1.0
"""the issue's goal: from the loss to the task's next finished step"""


@dataclass(frozen=True)
class ClusterNodeArm:
    """Unicron as a cluster: a coordinator and two agents of ``nproc / 2`` slots each."""

    system: str = "unicron"
    label: str = "unicron cluster"

    def run(self, scenario: Scenario, settings: Settings, workdir: Path) -> dict[str, float]:
        """One trial: submit the task with the node fault, wait for its end, measure."""
        c = LiveCluster(workdir)
        try:
            c.start_coordinator()
            c.answers()
            per_node = settings.nproc // settings.nnodes
            for n in range(settings.nnodes):
                c.start_agent(f"n{n}", per_node)
                c.wait_nodes(n + 1)  # registered in order: node ids 0, 1, ...
            t0 = time.time()
            spec = {
                "name": "gpt",
                "script": str(ROOT / "examples" / "train_gpt.py"),
                "args": ["--steps", str(scenario.run_steps(settings))],
                "workers": {"min": 1, "max": settings.nproc},
                "inject": list(scenario.faults),
            }
            uid = c.submit(spec)["uid"]
            view = c.wait_ended("gpt", settings.node_trial_timeout_s)
            wall = time.time() - t0
            events = read_events(c.events_path(uid))
        finally:
            c.close()
        if view["state"] != "done":
            raise TrialError(f"the task ended {view['state']}: {view['outcome']}")
        return figures(events, wall, scenario)


def scenario(settings: Settings) -> Scenario:
    return Scenario(
        name=SCENARIO,
        description=(
            f"{settings.nnodes} nodes of {settings.nproc // settings.nnodes} workers on "
            "loopback; node 1 (agent and workers) vanishes"
        ),
        faults=(f"node:node=1,step={settings.fault_step}",),
    )


def run(quick: bool, *, reps: int | None = None, host: str | None = None) -> list[Row]:
    """The rows of this scenario: the arms interleaved for ``reps`` repetitions."""
    from bench.suite import run_cells

    settings = Settings.make(quick, reps)
    scn = scenario(settings)
    tunings = (True,) if quick else (False, True)
    arms: list[Arm] = [ClusterNodeArm()]
    arms += [TorchrunNodeArm(ckpt_every=settings.ckpt_every[0], tuned=t) for t in tunings]
    host = host or machine()

    def progress(label: str, rep: int, result: dict[str, float] | str) -> None:
        if isinstance(result, str):
            print(f"  rep {rep + 1} {label}: FAILED {result}", flush=True)
        else:
            shown = ", ".join(f"{k}={v:.3g}" for k, v in result.items() if ":" not in k)
            print(f"  rep {rep + 1} {label}: {shown}", flush=True)

    before = loadavg()
    with tempfile.TemporaryDirectory(prefix="unicron-bench-cluster-node-") as tmp:
        rows = run_cells([(scn, a) for a in arms], settings, Path(tmp), host, progress)
    for row in rows:
        if row["metric"] == "recovery_s" and row["system"] == ClusterNodeArm.label:
            met = "met" if row["max"] < GOAL_S else "NOT met"
            row["note"] = f"goal < {GOAL_S:g} s: {met} (max {row['max']:.2f} s)"
        if row["metric"] == "wall_s":
            row["note"] += f"; machine: {before} before, {loadavg()} after"
    return rows
