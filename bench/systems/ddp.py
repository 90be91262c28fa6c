"""A plain DDP/gloo loop with no fault handling at all: the steady-state reference."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from bench.events import read_events
from bench.systems.base import Launched, Scenario, Settings, TrialError, figures, python


@dataclass(frozen=True)
class DdpArm:
    """``bench/baselines/ddp_loop.py``: four processes, DDP, no checkpoints, no launcher."""

    system: str = "ddp"
    label: str = "plain DDP"

    def run(self, scenario: Scenario, settings: Settings, workdir: Path) -> dict[str, float]:
        """One fault-free trial (a plain loop does not survive faults)."""
        if scenario.faults:
            raise TrialError("the plain DDP loop runs fault-free scenarios only")
        cmd = [
            python(),
            "-m",
            "bench.baselines.ddp_loop",
            "--nproc",
            str(settings.nproc),
            "--steps",
            str(settings.steps),
            "--workdir",
            str(workdir),
            "--events",
            str(workdir / "events.jsonl"),
        ]
        t0 = time.time()
        launched = Launched.start(cmd, workdir / "out.log")
        rc = launched.wait(settings.trial_timeout_s)
        wall = time.time() - t0
        launched.check(rc, "ddp_loop")
        return figures(read_events(workdir / "events.jsonl"), wall, scenario)
