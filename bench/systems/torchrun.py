"""The usual practice: torchrun ``--max-restarts`` with a rank-0 checkpoint every K steps.

The workers are ``bench/baselines/train_ckpt.py``. torchrun's agent detects a failure only when
a worker process exits; the moment it does is taken from its own log line ("Worker group
FAILED ... will restart worker group"), stamped as the line arrives, and written to the event
log as ``error_detected`` so that the shared parser measures it. The torch 2.13 gloo restart
bug is worked around with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (TORCH-FACTS.md).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from bench.events import read_events
from bench.systems.base import Launched, Scenario, Settings, figures, python, reap_workers

AGENT_DETECTS = r"Worker group (FAILED|UNHEALTHY)"
GLOO_DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class TorchrunArm:
    """torchrun with checkpoints every ``ckpt_every`` steps and a process-group timeout."""

    ckpt_every: int
    pg_timeout_s: float = GLOO_DEFAULT_TIMEOUT_S
    system: str = "torchrun"

    @property
    def label(self) -> str:
        """``torchrun K=10`` (and the timeout where it is not gloo's default)."""
        text = f"torchrun K={self.ckpt_every}"
        if self.pg_timeout_s != GLOO_DEFAULT_TIMEOUT_S:
            text += f" timeout={self.pg_timeout_s:g}s"
        return text

    def command(self, scenario: Scenario, settings: Settings, workdir: Path) -> list[str]:
        """The torchrun command line of one trial."""
        cmd = [
            python(),
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(settings.nproc),
            "--max-restarts",
            str(settings.torchrun_max_restarts),
            "-m",
            "bench.baselines.train_ckpt",
            "--steps",
            str(settings.steps),
            "--ckpt-every",
            str(self.ckpt_every),
            "--ckpt-dir",
            str(workdir),
            "--events",
            str(workdir / "events.jsonl"),
            "--pg-timeout-s",
            str(self.pg_timeout_s),
        ]
        for spec in scenario.faults:
            cmd += ["--inject", spec]
        return cmd

    def run(self, scenario: Scenario, settings: Settings, workdir: Path) -> dict[str, float]:
        """One trial: launch torchrun, stamp its agent's detections, measure the event log."""
        events_path = workdir / "events.jsonl"

        def detected(ts: float, line: str) -> None:
            record = {
                "ts": ts,
                "event": "error_detected",
                "method": "torchrun agent",
                "kind": "worker exited",
                "reason": line[-200:],
            }
            with open(events_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"}
        t0 = time.time()
        launched = Launched.start(
            self.command(scenario, settings, workdir),
            workdir / "out.log",
            env=env,
            watch={AGENT_DETECTS: detected},
        )
        try:
            rc = launched.wait(settings.trial_timeout_s)
        finally:
            reap_workers(workdir)
        wall = time.time() - t0
        launched.check(rc, "torchrun")
        return figures(read_events(events_path), wall, scenario)
