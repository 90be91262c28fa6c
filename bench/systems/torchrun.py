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
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.common import free_port
from bench.events import read_events
from bench.systems.base import (
    Launched,
    Scenario,
    Settings,
    TrialError,
    figures,
    python,
    reap_workers,
)

AGENT_DETECTS = r"Worker group (FAILED|UNHEALTHY)"
GLOO_DEFAULT_TIMEOUT_S = 1800.0
TUNED_RDZV = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2"
"""The rendezvous settings of TORCH-FACTS.md that cut torchrun's node-loss pause (+45 s -> +6 s).
Defaults: ``last_call_timeout=30``, ``keep_alive_interval=5``, ``keep_alive_max_attempt=3``."""
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"}


def _detection_writer(events_path: Path, node: int | None = None) -> Callable[[float, str], None]:
    """A callback writing torchrun's agent log line as an ``error_detected`` event."""

    def detected(ts: float, line: str) -> None:
        record = {
            "ts": ts,
            "event": "error_detected",
            "method": "torchrun agent",
            "kind": "worker exited",
            "reason": line[-200:],
        }
        if node is not None:
            record["node"] = node
        with open(events_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    return detected


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
            str(scenario.run_steps(settings)),
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
        t0 = time.time()
        launched = Launched.start(
            self.command(scenario, settings, workdir),
            workdir / "out.log",
            env=ENV,
            watch={AGENT_DETECTS: _detection_writer(events_path)},
        )
        try:
            rc = launched.wait(scenario.run_timeout_s(settings))
        finally:
            reap_workers(workdir)
        wall = time.time() - t0
        launched.check(rc, "torchrun")
        return figures(read_events(events_path), wall, scenario)


@dataclass(frozen=True)
class TorchrunNodeArm:
    """Two torchrun agents on this machine forming one elastic job (``--nnodes 1:2``).

    Agent 0 hosts the c10d rendezvous store (``is_host=1``; agent 1 is a client, as a second
    machine would be), both run ``--nproc-per-node nproc/2`` workers of
    ``bench/baselines/train_ckpt.py`` with ``--max-restarts``. The node fault is fired by
    node 1's local rank 0 at the faulted step: it SIGKILLs agent 1's process group and node
    1's workers, then itself (``bench.baselines.loop.vanish_node``). The survivors' gloo
    collectives fail, agent 0 restarts its workers, the rendezvous closes with agent 0 alone
    (after ``last_call_timeout`` and once agent 1's keep-alive has expired) and training
    resumes from the last checkpoint with 2 workers. ``tuned`` uses :data:`TUNED_RDZV`.
    """

    ckpt_every: int
    tuned: bool = False
    system: str = "torchrun"

    @property
    def label(self) -> str:
        """``torchrun K=10 nnodes=1:2`` (``rdzv=tuned`` with the short rendezvous settings)."""
        return f"torchrun K={self.ckpt_every} nnodes=1:2" + (" rdzv=tuned" if self.tuned else "")

    def command(
        self,
        node: int,
        port: int,
        rdzv_id: str,
        scenario: Scenario,
        settings: Settings,
        workdir: Path,
    ) -> list[str]:
        """The command line of agent ``node`` (0 hosts the rendezvous store)."""
        conf = f"is_host={int(node == 0)}" + (f",{TUNED_RDZV}" if self.tuned else "")
        cmd = [
            python(),
            "-m",
            "torch.distributed.run",
            "--nnodes",
            f"1:{settings.nnodes}",
            "--nproc-per-node",
            str(settings.nproc // settings.nnodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            rdzv_id,
            "--rdzv-conf",
            conf,
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
        ]
        for spec in scenario.faults:
            cmd += ["--inject", spec]
        return cmd

    def run(self, scenario: Scenario, settings: Settings, workdir: Path) -> dict[str, float]:
        """One trial: two agents, node 1 vanishes at the fault, agent 0 must finish alone."""
        events_path = workdir / "events.jsonl"
        port, rdzv_id = free_port(), f"bench-node-{uuid.uuid4().hex[:8]}"
        t0 = time.time()
        agents = [
            Launched.start(
                self.command(node, port, rdzv_id, scenario, settings, workdir),
                workdir / f"agent{node}.log",
                env={**ENV, "BENCH_NODE": str(node)},
                watch={AGENT_DETECTS: _detection_writer(events_path, node)},
            )
            for node in range(settings.nnodes)
        ]
        try:
            rc = agents[0].wait(settings.node_trial_timeout_s)
            wall = time.time() - t0
            others = [a.poll() for a in agents[1:]]
        finally:
            for agent in agents:
                agent.stop(grace_s=2.0)
            reap_workers(workdir)
        agents[0].check(rc, "torchrun agent 0")
        if any(code is None for code in others):
            raise TrialError("agent 1 still ran when agent 0 finished: the node never vanished")
        return figures(read_events(events_path), wall, scenario)
