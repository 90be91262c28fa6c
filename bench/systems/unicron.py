"""Unicron itself: ``python -m unicron run`` on ``examples/train_gpt.py``, measured by its log.

The node scenario runs ``--nnodes 2 --nproc-per-node 2`` (two agents on this machine, each
with its own zygote and heartbeat) and ``--inject node:node=1,step=S``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from bench.events import read_events
from bench.systems.base import Launched, Scenario, Settings, figures, python


@dataclass(frozen=True)
class UnicronArm:
    """The self-healing runtime with its defaults (exact reduce, embedded coordinator)."""

    system: str = "unicron"
    label: str = "unicron"

    def command(self, scenario: Scenario, settings: Settings, workdir: Path) -> list[str]:
        """The ``unicron run`` command line of one trial."""
        nodes = settings.nnodes if scenario.fault_kind == "node" else 1
        cmd = [
            python(),
            "-m",
            "unicron",
            "run",
            "--nnodes",
            str(nodes),
            "--nproc-per-node",
            str(settings.nproc // nodes),
            "--events",
            str(workdir / "events.jsonl"),
            "--quiet",
            "--log-dir",
            str(workdir / "logs"),
        ]
        for spec in scenario.faults:
            cmd += ["--inject", spec]
        return [
            *cmd,
            "examples/train_gpt.py",
            "--steps",
            str(scenario.run_steps(settings)),
            "--out",
            str(workdir / "out"),
        ]

    def run(self, scenario: Scenario, settings: Settings, workdir: Path) -> dict[str, float]:
        """One trial: launch, wait, measure from the event log."""
        t0 = time.time()
        launched = Launched.start(self.command(scenario, settings, workdir), workdir / "out.log")
        node = scenario.fault_kind == "node"
        rc = launched.wait(
            settings.node_trial_timeout_s if node else scenario.run_timeout_s(settings)
        )
        wall = time.time() - t0
        launched.check(rc, "unicron run")
        return figures(read_events(workdir / "events.jsonl"), wall, scenario)
